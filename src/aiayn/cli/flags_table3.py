"""The parser of `aiayn table3`: Table 3's rows trained and scored at a stated scale."""

from __future__ import annotations

import argparse

from aiayn.cli.formatting import command_parser


def add_table3(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "table3",
        "train and score Table 3's rows (A-E) at a stated scale, beside the paper's",
        """\
An experiment file (configs/table3-multi30k.toml) names a recipe whose model is the base
row, the settings every row shares ([sweep.set]: steps, minutes, checkpoints: the same
budget for each) and the rows as changes of the base ([rows]: N, d_model, d_ff, h, d_k,
d_v, P_drop, eps_ls, positional, steps). Each row and seed trains in its own run
directory, DIR/ROW/seedS, with the recipe's stages (train, average), and its averaged
checkpoint is scored on the validation set: dev PPL (unsmoothed NLL per subword), dev
BLEU (sacreBLEU; beam 4, alpha 0.6, or greedy: the file's sweep.dev_decode) and params.

It prints the table in the paper's layout (a setting equal to the base row's left blank)
with the paper's dev PPL / BLEU / params beside ours, and for each row whether its change
from the base row goes the paper's way, PPL and BLEU separately: "same" (one sign),
"opposite", or "tie" when either change rounds to zero at the paper's precision (PPL
0.01, BLEU 0.1: the paper's A3 BLEU and E PPL equal its base's, so those are ties). With
several seeds: the mean and the range (min-max), and "(in spread)" where an opposite
row's range overlaps the base row's (a one-seed row's value, when only the base row
has several seeds: --rows base --seeds 3 measures the spread). Then one line a metric:
"N of M rows point the paper's way". DIR gets table3.csv and table3.json; --markdown
prints the table for docs/results.md, and --csv FILE renders a table3.csv again without
training; several --csv put sweeps from several machines in one table, each row against
the base row of its own file (its own machine's bf16 kernels), the base rows named by the
machine they trained on (table3_row.json and the CSV record it).

Resuming: rerun the same command. A run with its table3_row.json is not trained again;
one without it resumes from its checkpoints. A run whose training settings changed since
(the file, --set, --max-minutes-per-row where it would have cut the run short) is refused
before any training, each named with the keys that differ; --rerun-changed moves those
directories aside (ROW/seedS.stale-K) and trains them again. Scoring settings alone
(dev_decode, recipe.average_last) rescore from the checkpoints without training.

Runtime on this machine (2-core AMD EPYC VM, no AMX): configs/table3-multi30k.toml, 19 rows
of 4,000 steps, ~9 hours for one seed (base row ~0.40 s a step: ~27 minutes; scoring
~1 minute a row), each row capped at 120 minutes; ~6 hours on a 2-core Sapphire Rapids;
--seeds 3 triples it. --jobs 2 (a thread each) made ~1.2x the steps an hour, each row
taking ~1.7x its own minutes: leave C5 (d_model 256, ~3x the base row's FLOPs a step)
out of it (--rows) and train it alone, or it meets the 120-minute cap. On a 2-core
Sapphire Rapids with --jobs 2, C5 took 64 minutes and a base-sized row 35-40. A micro grid
(tests/experiments/test_table3.py) takes seconds.

examples:
  aiayn table3 configs/table3-multi30k.toml --data ../shared/data/multi30k \\
      --out runs/table3
  aiayn table3 configs/table3-multi30k.toml --out runs/table3 --rows base,A,E \\
      --seeds 3 --max-minutes-per-row 30
  aiayn table3 configs/table3-multi30k.toml --out runs/table3 --no-train --markdown
  aiayn table3 --csv runs/table3/table3.csv --markdown
  aiayn table3 --csv docs/table3-multi30k-amd-epyc.csv --csv runs/table3/table3.csv \\
      --markdown
  aiayn table3 --import-probes docs/m30k-en-de-probes.csv --out runs/probes-table3""",
    )
    p.add_argument(
        "config",
        nargs="?",
        metavar="FILE.toml",
        help="Table 3 experiment file, e.g. configs/table3-multi30k.toml (default: none: "
        "--csv or --import-probes alone)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="the sweep's directory: a run directory per row and seed, table3.csv, "
        "table3.json (rerun to resume; default: none, required with FILE.toml)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="local copy of Multi30k, e.g. ../shared/data/multi30k (default: download it)",
    )
    p.add_argument(
        "--prepared",
        metavar="DIR",
        help="train every row on this prepared data directory (`aiayn prepare`'s, or a "
        "recipe run's RUN/data/prepared) instead of preparing DIR/data (default: none)",
    )
    p.add_argument(
        "--rows",
        metavar="A,B,...",
        help="the rows to train: names (A1, C4) or group letters (A: A1-A4); the base row "
        "always (default: all of the file's)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        metavar="K",
        help="seeds per row: train.seed, train.seed + 1, ... (default: the file's sweep.seeds)",
    )
    p.add_argument(
        "--max-minutes-per-row",
        type=float,
        metavar="M",
        help="training budget of each row and seed in minutes, as train.max_minutes; a row "
        "cut short shows it in its steps (default: the file's)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config or recipe.* key for every row, after the file's "
        "[sweep.set], e.g. train.max_steps=2000; repeatable (default: none)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="K",
        help="runs trained at once, each in its own process with its share of the cores "
        "(per-step progress bars give way to a line per finished row): for a GPU, which one "
        "row of the tiny model leaves mostly idle; on a 2-core CPU 2 (a thread each) made "
        "~1.2x the steps of 1 with two threads (AMD EPYC VM, Table 3's rows) (default: 1)",
    )
    p.add_argument(
        "--rerun-changed",
        action="store_true",
        help="move the runs whose training settings changed aside and train them again "
        "(default: refuse, naming them)",
    )
    p.add_argument(
        "--no-train",
        action="store_true",
        help="train and score nothing: the table of the runs already finished",
    )
    p.add_argument(
        "--import-probes",
        metavar="CSV",
        help="add the Table 3 probes of a probes CSV (docs/m30k-en-de-probes.csv: val "
        "tok-BLEU, no PPL) as rows, each against its paired recipe runs (default: none)",
    )
    p.add_argument(
        "--probes-recipe",
        default="configs/multi30k-en-de.toml",
        metavar="FILE.toml",
        help="the recipe the probes changed (with FILE.toml: its sweep.recipe)",
    )
    p.add_argument(
        "--csv",
        metavar="CSV",
        action="append",
        help="render this table3.csv (not with FILE.toml); repeat it to put sweeps from "
        "several machines in one table, each row against its own file's base row, the base "
        "rows named by their machines (default: none)",
    )
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json", action="store_true", help="print table3.json's content instead")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--no-progress", action="store_true", help="no training progress bar")
    return p
