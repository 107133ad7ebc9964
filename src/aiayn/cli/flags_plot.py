"""The parser of `aiayn plot`: a run's curves (or several runs', overlaid) as a PNG."""

from __future__ import annotations

import argparse

from aiayn.cli.formatting import command_parser

#: What --metrics may name (aiayn.experiments.curves.PLOT_METRICS, not imported: the
#: parser stays free of torch; tests/test_plot.py checks that the two agree).
METRICS = "loss,nll,valid_ppl,valid_nll,valid_bleu,lr,gnorm,tokens_per_s"
DEFAULT_METRICS = "loss,valid_ppl,valid_bleu,lr"


def add_plot(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "plot",
        "draw a training run's curves (several runs overlaid) as a PNG",
        """\
Reads RUN/train_log.jsonl, the log every `aiayn train` writes (one JSON record per
line), and draws one panel per metric against training steps: the training loss (the
mean over each log interval), the validation perplexity (log scale), the validation
BLEU (sacreBLEU of the fixed validation subset, logged when
train.valid_bleu_interval_steps > 0) and the learning rate (Eq. 3). Several runs share
the axes, each named by its directory (by the path given where two names are the same).
A run resumed after a crash logs the steps it redid twice: the later pass is drawn. A
metric a run never logged leaves a note in its panel. The same numbers are in
RUN/tensorboard/ for TensorBoard (`tensorboard --logdir RUN`).

Errors name the file and line: a missing run directory or log, a log with no training
records yet, a line that is not a JSON record (a last line cut short by a kill is left
out). Needs matplotlib (pip install 'aiayn[plot]').

examples:
  aiayn plot runs/en-de/train
  aiayn plot runs/en-de/train --out curves.png --metrics valid_bleu,valid_ppl
  aiayn plot runs/base runs/big --out base-vs-big.png
  aiayn plot runs/*/seed1 --metrics loss,lr,gnorm,tokens_per_s --out speed.png""",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run directories (each holding train_log.jsonl); several are overlaid",
    )
    p.add_argument(
        "--out",
        metavar="FILE.png",
        help="the PNG to write (default: curves.png in the first RUN)",
    )
    p.add_argument(
        "--metrics",
        default=DEFAULT_METRICS,
        metavar="M1,M2,...",
        help=f"panels, in order, from: {METRICS.replace(',', ', ')}",
    )
    return p
