"""The parsers of the stages that use models, and the tools: translate, evaluate, recipe,
bench, info."""

from __future__ import annotations

import argparse

from aiayn.cli.flags_generate import add_sampling_flags, add_workers_flag
from aiayn.cli.formatting import BASE, add_config_args, command_parser, preset_help
from aiayn.config import DecodeConfig

#: The paper's decoding settings (section 6.1), the presets' defaults.
PAPER = BASE.decode


def add_translate(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "translate",
        "translate a file or stdin with beam search",
        """\
One output line per input line, in input order; an empty line gives an empty line.
Decoding options default to the (first) checkpoint's, which are the paper's unless its
config changed them. A progress bar counts the lines on a terminal; a JSON summary goes
to stderr; invalid UTF-8 in the input gives exit code 3.

examples:
  aiayn translate --checkpoint runs/tiny/averaged.pt \\
      --input data/multi30k/test_2016_flickr.en.gz --output runs/tiny/test.de
  echo "A man rides a bike." | aiayn translate --checkpoint runs/a.pt --greedy
  aiayn translate --checkpoint runs/de-en.pt --input mono.de --output synthetic.en \\
      --sampling --top-k 10 --seed 1      # back-translation (docs/api.md)
  aiayn translate --checkpoint a.pt b.pt --input test.en --dtype int8 \\
      --workers 2""",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        metavar="FILE.pt",
        help="a model; several (same vocabulary) decode as an ensemble: the "
        "mean of their next-token probabilities, the first one's decoding "
        "options",
    )
    p.add_argument(
        "--input",
        metavar="FILE",
        help="source text, plain or gzip; - or none: stdin, read as lines arrive, each "
        "translation written (and flushed) as soon as it is decoded, lines that come "
        "within 20 ms of each other decoded as one batch",
    )
    p.add_argument(
        "--output",
        metavar="FILE",
        help="translations (default, or -: stdout; a device or FIFO is written in place, a "
        "symlink through to its target; a run's files are refused)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --output file that is a checkpoint or gzip file (refused otherwise; "
        "an input or a checkpoint given is never replaced)",
    )
    p.add_argument(
        "--beam", type=int, help=f"beam size (default: the checkpoint's; paper: {PAPER.beam})"
    )
    p.add_argument(
        "--alpha",
        type=float,
        help=f"length penalty ((5+|Y|)/6)^alpha (default: the checkpoint's; paper: {PAPER.alpha})",
    )
    p.add_argument("--greedy", action="store_true", help="greedy search: the same as --beam 1")
    p.add_argument(
        "--max-len-a",
        type=float,
        metavar="A",
        help="output length at most A x input length + B tokens (default: the "
        f"checkpoint's; paper: {PAPER.max_len_a:g})",
    )
    p.add_argument(
        "--max-len-b",
        type=int,
        metavar="B",
        help=f"see --max-len-a (default: the checkpoint's; paper: {PAPER.max_len_b})",
    )
    p.add_argument(
        "--nbest",
        type=int,
        metavar="N",
        help="the N best outputs of each line, as Moses-style 'i ||| text ||| score' "
        "lines (default: the checkpoint's, 1: the best translation only)",
    )
    p.add_argument(
        "--prefix",
        metavar="FILE",
        help="prefix-constrained decoding: FILE has one line per input line (plain or "
        ".gz), and each translation begins with its line of it (target text; a blank line "
        "leaves its translation free), as an interactive translator continues what its "
        "user accepted; scores cover the whole output. Needs --input FILE; not with "
        "--sampling",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="TOKENS",
        help=f"source tokens per batch (default: the checkpoint's; presets: {PAPER.max_tokens})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "int8"],
        help="inference precision: auto (the default) is the one this machine decodes "
        "fastest in, measured once and cached (`aiayn info`), whatever the checkpoint "
        "trained in (its int8 with 7-bit inputs without VNNI: ~1.4x faster products); bf16: "
        "weights and activations, oneDNN-packed (fast with AMX or AVX-512 BF16); int8: "
        "dynamic quantization, CPU, 8-bit inputs (AIAYN_INT8_ACTIVATIONS=7|8 sets the bits)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    add_workers_flag(
        p,
        "CPU: decode whole batches in this many forked processes of one thread each, "
        "the same outputs (one per core: faster than one process of all threads; "
        "docs/performance.md)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (drawn only when stderr is a terminal)",
    )
    add_sampling_flags(p)
    return p


def add_evaluate(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    from aiayn.experiments.tasks import TASKS  # the scorers: each task's score_files

    p = command_parser(
        sub,
        "evaluate",
        "score translations (BLEU, chrF, tokenized BLEU) or parses (EVALB)",
        """\
--task translate: BLEU and chrF come with their sacreBLEU signatures; tok_bleu is
Moses-tokenized and lowercased (the Multi30k literature's); paper_bleu is the paper's
Table 2 convention: cased, Moses-tokenized, unsmoothed, and for German compounds split
at hyphens ("a ##AT##-##AT## b", tensor2tensor's get_ende_bleu.sh).
--task parse: labelled bracketing precision, recall and F1, complete match and tagging
accuracy, computed exactly as EVALB computes them (Sekine and Collins 1997; the tests
compare the two), with COLLINS.prm's settings unless --params names another parameter
file: punctuation and TOP ignored, ADVP = PRT, sentences of unequal length or words
counted as errors and left out. --report prints EVALB's own report (per sentence, then
all sentences and those of <= 40 words), to compare with EVALB's output.
Files with different line counts are refused.

examples:
  aiayn evaluate --hyp runs/tiny/test.de \\
      --ref data/multi30k/test_2016_flickr.de.gz
  aiayn evaluate --hyp out.de --ref ref.de --bootstrap 1000 --json
  aiayn evaluate --task parse --hyp runs/parse/test.trees --ref data/ptb/test.trees
  aiayn evaluate --task parse --hyp test.trees --ref gold.trees --report""",
    )
    p.add_argument(
        "--task",
        choices=list(TASKS),
        default="translate",
        help="what the files hold: translations, or trees (one bracketed tree a line)",
    )
    p.add_argument("--hyp", required=True, metavar="FILE", help="translations or trees, one a line")
    p.add_argument(
        "--ref",
        required=True,
        metavar="FILE",
        help="references (plain or gzip) or gold trees, one a line",
    )
    p.add_argument(
        "--lang",
        help="target language (default: the reference's suffix, e.g. de from test.de.gz, else en)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="N",
        help="95%% confidence interval of BLEU from N resamples (sacreBLEU's fixed "
        "seed, recorded in the signature); 0: none",
    )
    p.add_argument(
        "--params",
        metavar="FILE.prm",
        help="parse: an EVALB parameter file (default: COLLINS.prm's settings, built in)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="parse: print EVALB's full report instead of the summary",
    )
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    return p


def add_parse(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "parse",
        "parse sentences into constituency trees with a parsing model",
        """\
One bracketed tree a line per input line (space-separated words, as the treebank
tokenizes them; a bracket in a word is written -LRB-/-RRB-), in input order. The model
writes the tree linearized ("(S (NP The cat )NP ... )S"). By default it decodes under a
tree constraint: only an open bracket, the innermost constituent's close bracket or the
next word's pieces may come next, so every output is a tree over exactly the input's words
by construction. With --no-constrained it writes freely, and whatever it writes is rebuilt
into a well-formed tree over exactly the input's words, the repairs that took counted
in the JSON summary on stderr. A bracket inside a word is escaped as the treebank does
("f(x)" -> f-LRB-x-RRB-). Pre-terminals carry the treebank's punctuation tags for
punctuation (as EVALB needs to ignore it) and XX elsewhere: the parser does not tag.
An empty input line is an error naming it; invalid UTF-8 is replaced (U+FFFD), warned about
with its line and gives exit code 3, as in translate. Decoding options default to the checkpoint's:
for the parse preset the paper's beam 21, alpha 0.3, length <= input + 300.

examples:
  aiayn parse --checkpoint runs/parse/checkpoint_avg.pt --input data/ptb/test.words \\
      --output test.trees
  echo "The cat sat on the mat ." | aiayn parse --checkpoint runs/parse/checkpoint_avg.pt""",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        metavar="FILE.pt",
        help="a parsing model; several (same vocabulary) decode as an ensemble",
    )
    p.add_argument("--input", metavar="FILE", help="sentences, plain or gzip (default: stdin)")
    p.add_argument(
        "--output",
        metavar="FILE",
        help="trees (default, or -: stdout; written as translate's --output is)",
    )
    p.add_argument(
        "--raw-output",
        metavar="FILE",
        help="also write the model's raw linearized outputs here, before repairs",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an output that is a checkpoint or gzip file (refused otherwise)",
    )
    p.add_argument("--beam", type=int, help="beam size (default: the checkpoint's; paper: 21)")
    p.add_argument(
        "--alpha", type=float, help="length penalty (default: the checkpoint's; paper: 0.3)"
    )
    p.add_argument(
        "--max-len-a",
        type=float,
        metavar="A",
        help="output length at most A x input length + B tokens (default: the checkpoint's)",
    )
    p.add_argument(
        "--max-len-b",
        type=int,
        metavar="B",
        help="see --max-len-a (default: the checkpoint's; paper: 300)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="TOKENS",
        help="source tokens per batch (default: the checkpoint's)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "int8"],
        help="inference precision, as for translate (auto: this machine's fastest)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    add_workers_flag(p, "CPU: decode batches in this many forked processes, as for translate")
    p.add_argument(
        "--constrained",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode under the tree constraint: every output a tree over exactly the input's "
        "words by construction (default); --no-constrained decodes freely and repairs",
    )
    p.add_argument(
        "--tree-form",
        default="words",
        choices=["words", "gafl"],
        help="the model's target: each word in its place (words, the recipe's) or XX (gafl)",
    )
    p.add_argument(
        "--word-mass",
        action="store_true",
        help="constrained: score each word by the probability of any word there, only the tree's "
        "structure (recipe.word_mass); default: by the input word's own probability",
    )
    p.add_argument(
        "--limits-from",
        metavar="FILE",
        help="constrained: the deepest nesting and longest run of open brackets allowed are "
        "those of these linearized training trees (e.g. RUN/data/ptb/train.linw); default: 64",
    )
    for flag, what in (
        ("--max-depth", "deepest nesting"),
        ("--max-opens", "most open brackets in a row"),
    ):
        help_ = f"constrained: {what} (default: --limits-from's, else 64)"
        p.add_argument(flag, type=int, metavar="N", help=help_)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def add_recipe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "recipe",
        "run an experiment file end to end: data to BLEU (or to F1, for parsing)",
        """\
The stages: data -> prepare -> train -> average -> choose the length penalty on the
validation set (the file's recipe.tune_alpha grid, as section 6.1) -> translate the test
set -> evaluate. A parsing file (recipe.dataset = "ptb", e.g. configs/ptb-sample-parse.toml)
chooses beam and alpha on the development set by F1, parses the test set and scores it,
a right-branching baseline and the unrepaired outputs with aiayn's EVALB and, when
recipe.evalb names EVALB's source, with EVALB itself.
RUN ends with checkpoint_avg.pt, the test translation (or trees), curve.png and
results.json (scores with signatures, data and vocabulary hashes, resolved config,
versions, machine, wall times, FLOPs). Rerunning the same command resumes.

WMT14 (configs/wmt14-*.toml, Table 2 at full scale) downloads ~1.7 GB (En-De) or ~6.6 GB
(En-Fr) of archives checked against published hashes (--data: a local mirror of them, or
an `aiayn data wmt14 --out` directory), prepares them in bounded memory (4.5M pairs: ~3
minutes on 2 CPU cores) and trains under torchrun: rank 0 prepares while the others wait,
every rank trains, rank 0 averages, decodes and scores. The run directory must be on a
filesystem every node sees. Times and costs on 8 GPUs: docs/scaling.md.

examples:
  aiayn recipe configs/multi30k-en-de.toml --out runs/en-de
  aiayn recipe configs/multi30k-en-de.toml --out runs/smoke \\
      --data ../shared/data/multi30k --max-minutes 2 \\
      --set recipe.max_train_pairs=300
  torchrun --nproc-per-node=8 --max-restarts=3 -m aiayn recipe \\
      configs/wmt14-en-de-base.toml --out /shared/runs/base --device cuda""",
    )
    p.add_argument(
        "config", metavar="FILE.toml", help="experiment file, e.g. configs/multi30k-en-de.toml"
    )
    p.add_argument("--out", required=True, metavar="RUN", help="run directory (rerun to resume)")
    p.add_argument(
        "--data",
        metavar="PATH",
        help="local copy of the corpus: a directory (Multi30k's files; for WMT14 its archives "
        "or `aiayn data wmt14`'s text), or for parsing a treebank zip or folder "
        "(default: download it)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        metavar="MINUTES",
        help="training wall-clock budget in minutes; the run warns early if it will "
        "end training before max_steps (default: the file's)",
    )
    p.add_argument("--seed", type=int, help="training seed (default: the file's)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key or a recipe.* key, e.g. "
        "recipe.max_train_pairs=300 (a smoke run), recipe.lowercase=true, "
        "recipe.ensemble=K (K models, seeds seed..seed+K-1); repeatable "
        "(default: none)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--no-progress", action="store_true", help="no training progress bar")
    return p


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "bench",
        "measure training, decoding and matrix-product throughput",
        """\
One line (or JSON object) per measurement: train gives tokens/s, decode sentences/s with
outputs forced to --out-len tokens, peak the device's matrix-product ceiling.

examples:
  aiayn bench train --preset base --dtype bf16 --json
  aiayn bench decode --preset base --beam 4 --out-len 20 --dtype fp32,bf16,int8
  aiayn bench peak --dtype fp32,bf16""",
    )
    p.add_argument("what", choices=["train", "decode", "peak"], help="what to measure")
    p.add_argument("--preset", default="base", metavar="NAME", help=preset_help())
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto, fp32, bf16 (decode and peak also int8; train and peak also fp16, "
        "trained with dynamic loss scaling, the scale reached printed as loss_scale); "
        "auto: what train or translate would use on this machine (peak: its training "
        "precision); a comma-separated list runs each (default: auto)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps (median)")
    p.add_argument(
        "--beam", type=int, default=DecodeConfig.beam, help="decode: beam size (1 = greedy)"
    )
    p.add_argument("--alpha", type=float, default=DecodeConfig.alpha, help="decode: length penalty")
    p.add_argument(
        "--out-len", type=int, default=20, metavar="TOKENS", help="decode: tokens per output"
    )
    p.add_argument("--sentences", type=int, default=500, help="decode: sentences")
    p.add_argument(
        "--batch-sentences",
        type=int,
        metavar="N",
        help="sentences per batch (default: 291 for train, 64 for decode)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="train: the model's forward through torch.compile (compiling falls "
        "in the warm-up, reported as warmup_seconds)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="decode: batches in this many processes of one thread each (CPU)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=10_000,
        metavar="V",
        help="train and decode: the random model's vocabulary (WMT14 En-De: 37000) "
        "(default: 10000)",
    )
    p.add_argument(
        "--lengths",
        default="12,16",
        metavar="LO,HI",
        help="train: sentence lengths in subwords, uniform in [LO, HI] on both sides "
        "(Multi30k-like by default; WMT14-like: 20,34, mean 27) (default: 12,16)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    return p


def add_info(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "info",
        "print a configuration's hyperparameters and parameter count, and this machine's "
        "CPU class and defaults",
        """\
The last lines name this machine's CPU, its class (amx, avx512_bf16, avx512, avx2,
portable), what dtype auto trains and decodes in here, the instruction set of the
compiled kernels and the rates the probe measured (cached under AIAYN_CACHE_DIR,
default ~/.cache/aiayn; --reprobe measures again). AIAYN_CPU_ISA=avx2 (or another
class) holds a process, PyTorch's kernels included, to that class.

examples:
  aiayn info --preset base --vocab-size 37000
  aiayn info --config configs/multi30k-en-de.toml --vocab-size 8000 --json
  aiayn info --preset big --set N=8
  AIAYN_CPU_ISA=avx2 aiayn info --reprobe""",
    )
    add_config_args(p)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=37000,
        help="shared vocabulary size the count assumes (the paper's WMT En-De)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print as JSON, with the parameter formula and the full config",
    )
    p.add_argument(
        "--reprobe",
        action="store_true",
        help="measure this machine's product rates again instead of reading the cache",
    )
    return p
