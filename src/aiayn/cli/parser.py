"""The `aiayn` argument parser: the top level; each subcommand's is in flags_*.py.

`aiayn --help` and `aiayn COMMAND --help` are the command line's reference; the README
points here. Building the parser imports no torch and no aiayn module but `aiayn.config`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from aiayn.cli import (
    commands,
    commands_analysis,
    commands_deploy,
    commands_speed,
    flags_analysis,
    flags_deploy,
    flags_eval,
    flags_generate,
    flags_plot,
    flags_table3,
    flags_train,
)
from aiayn.cli.environment import MALLOC_ENV, ONEDNN_PRIMITIVE_CACHE_CAPACITY
from aiayn.cli.formatting import HelpFormatter

DESCRIPTION = """\
The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch. One
subcommand per stage of the paper's pipeline; files pass between stages."""

EPILOG = f"""\
the pipeline, by hand (each COMMAND --help explains its flags):
  aiayn data multi30k --out data/multi30k
  aiayn prepare -s en -t de --trainpref data/multi30k/train \\
      --validpref data/multi30k/val --testpref data/multi30k/test_2016_flickr \\
      --out data/multi30k-en-de
  aiayn train data/multi30k-en-de --out runs/tiny --preset tiny \\
      --max-minutes 10
  aiayn average runs/tiny --last 5 --out runs/tiny/averaged.pt
  aiayn translate --checkpoint runs/tiny/averaged.pt \\
      --input data/multi30k/test_2016_flickr.en.gz --output runs/tiny/test.de
  aiayn evaluate --hyp runs/tiny/test.de \\
      --ref data/multi30k/test_2016_flickr.de.gz
or all of it, from an experiment file:
  aiayn recipe configs/multi30k-en-de.toml --out runs/en-de
parsing (section 6.3), the same way:
  aiayn recipe configs/ptb-sample-parse.toml --out runs/parse \\
      --data ../shared/data/ptb-sample/treebank.zip

exit codes:
  0    done
  1    bad input or a failed step: one line on stderr (the traceback with -v)
  2    bad command line or configuration, refused before any work (an output over an
       input, a file this command did not write, an unknown --device or config table)
  3    translate: the input had invalid UTF-8; recipe: done, but the model is not
       trained enough to use (test BLEU near 0; results.json says so, with what to try)
  4    the system refused: a disk full, a read-only or missing directory (one line)
  130  train or recipe stopped by Ctrl-C (143: by SIGTERM), after saving a checkpoint
  141  the output's reader went away (`aiayn ... | head`), as with `cat`

environment:
  AIAYN_NO_MALLOC_TUNING=1
      train, translate, recipe and bench re-execute themselves once with
      glibc malloc settings that avoid page-fault overhead; this turns that
      off. The settings (values already set win):
      {" ".join(MALLOC_ENV)}
  ONEDNN_PRIMITIVE_CACHE_CAPACITY
      oneDNN's compiled-kernel cache: aiayn sets {ONEDNN_PRIMITIVE_CACHE_CAPACITY} unless it (or
      DNNL_PRIMITIVE_CACHE_CAPACITY) is set; oneDNN's default of 1024 is too
      small for bf16 training on length-bucketed batches
  AIAYN_CACHE_DIR
      where the C kernels (aiayn/csrc) are compiled on first use, and the
      machine probe's rates are kept (default: ~/.cache/aiayn)
  AIAYN_CPU_ISA=amx|avx512_bf16|avx512|avx2|portable
      hold the process to a CPU class: PyTorch's kernels (oneDNN, ATen, MKL)
      and aiayn's C kernels as on such a CPU, and the defaults (dtype auto)
      chosen as there; `aiayn info` shows the class and choices
  AIAYN_NO_NATIVE=1
      use PyTorch ops instead of the compiled C kernels
  AIAYN_DIST_TIMEOUT_S
      under torchrun: seconds before the ranks give up on one that hangs
      (default: 1800)"""


class VersionAction(argparse.Action):
    """`--version`: aiayn's and torch's versions; torch is imported only when asked."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: Any = argparse.SUPPRESS,
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.exit(message=version_text() + "\n")


def version_text() -> str:
    """`aiayn 0.1.0 (torch 2.x.y)`."""
    import torch

    from aiayn import __version__

    return f"aiayn {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    """The parser of `aiayn`; each subcommand's namespace has `func`, its cmd_* function."""
    parser = argparse.ArgumentParser(
        prog="aiayn", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at debug level; errors also print their traceback",
    )
    parser.add_argument(
        "--version", action=VersionAction, help="print aiayn's and torch's versions and exit"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands (in pipeline order)"
    )
    for add, func in (
        (flags_train.add_data, commands.cmd_data),
        (flags_train.add_prepare, commands.cmd_prepare),
        (flags_train.add_train, commands.cmd_train),
        (flags_train.add_average, commands.cmd_average),
        (flags_eval.add_translate, commands.cmd_translate),
        (flags_generate.add_score, commands.cmd_score),
        (flags_eval.add_evaluate, commands.cmd_evaluate),
        (flags_eval.add_parse, commands.cmd_parse),
        (flags_eval.add_recipe, commands.cmd_recipe),
        (flags_eval.add_bench, commands_speed.cmd_bench),
        (flags_analysis.add_table1, commands_analysis.cmd_table1),
        (flags_analysis.add_attention, commands_analysis.cmd_attention),
        (flags_table3.add_table3, commands_analysis.cmd_table3),
        (flags_plot.add_plot, commands_analysis.cmd_plot),
        (flags_deploy.add_export, commands_deploy.cmd_export),
        (flags_deploy.add_serve, commands_deploy.cmd_serve),
        (flags_eval.add_info, commands_speed.cmd_info),
    ):
        p = add(sub)
        p.set_defaults(func=func)
        for action in p._actions:  # every float flag: NaN and inf are no setting's value
            if action.type is float:
                action.type = finite_float
    return parser


def finite_float(text: str) -> float:
    """A float flag's value: `nan`, `inf` and `-inf` are refused by argparse, naming them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: not a finite number")
    return value
