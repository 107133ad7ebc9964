"""The table: one run's result, the rows aggregated over seeds, their directions against
the paper's, and the text."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiayn.experiments.table3.paper import PAPER_TABLE3, SETTINGS, TIE

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass


@dataclass
class TableRow:
    """One row of the output table (and of its CSV): settings, our dev scores (mean over
    seeds, and their range), the row it is measured against (`base`) and the paper row
    it stands for (`paper`). What the paper says and the directions are derived from
    these (`compare`), so a CSV read back gives the same table."""

    row: str
    paper: str | None
    base: str
    N: int
    d_model: int
    d_ff: int
    h: int
    d_k: int
    d_v: int
    P_drop: float
    eps_ls: float
    positional: str
    steps: int
    steps_max: int
    seeds: int
    dev_ppl: float | None
    dev_ppl_min: float | None
    dev_ppl_max: float | None
    dev_bleu: float | None
    dev_bleu_min: float | None
    dev_bleu_max: float | None
    bleu_metric: str
    params: int | None
    source: str
    note: str = ""
    machine: str = ""  # where the row trained (`manifest.machine_name`); "" if not recorded


@dataclass(frozen=True)
class Verdict:
    """One metric of one row against its base row: our change, the paper's, the direction
    ("same", "opposite", "tie"; "" when either is unknown), and whether our change lies
    within the seeds' spread (None when the row and its base have one seed each)."""

    ours: float | None
    paper: float | None
    direction: str
    within_spread: bool | None


def direction(paper_delta: float | None, our_delta: float | None, tie: float) -> str:
    """ "same" when both changes have one sign, "opposite" when not, "tie" when either is
    smaller than `tie` (rounds to zero at the paper's precision), "" when one is unknown."""
    if paper_delta is None or our_delta is None:
        return ""
    if abs(paper_delta) < tie or abs(our_delta) < tie:
        return "tie"
    return "same" if (paper_delta > 0) == (our_delta > 0) else "opposite"


def _verdict(row: TableRow, base: TableRow | None, metric: str) -> Verdict:
    value, lo, hi = (getattr(row, f"dev_{metric}{s}") for s in ("", "_min", "_max"))
    paper = PAPER_TABLE3.get(row.paper or "")
    paper_delta = (
        None
        if paper is None
        else round(getattr(paper, metric) - getattr(PAPER_TABLE3["base"], metric), 4)
    )
    if base is None or value is None or getattr(base, f"dev_{metric}") is None:
        return Verdict(None, paper_delta, "", None)
    ours = value - getattr(base, f"dev_{metric}")
    within = None
    # one side's seeds are enough: a one-seed row against the base row's several seeds
    # (the cheap way to measure the spread) is within it when its value is in their range
    if row.seeds > 1 or base.seeds > 1:
        b_lo, b_hi = getattr(base, f"dev_{metric}_min"), getattr(base, f"dev_{metric}_max")
        within = lo <= b_hi and b_lo <= hi
    return Verdict(ours, paper_delta, direction(paper_delta, ours, TIE[metric]), within)


def compare(rows: Sequence[TableRow]) -> dict[str, tuple[Verdict, Verdict]]:
    """Each row (but base rows) by label: its dev PPL and dev BLEU verdicts."""
    by_label = {r.row: r for r in rows}
    return {
        r.row: (_verdict(r, by_label.get(r.base), "ppl"), _verdict(r, by_label.get(r.base), "bleu"))
        for r in rows
        if r.row != r.base
    }


def summary(rows: Sequence[TableRow]) -> list[str]:
    """One line per metric: "dev PPL: N of M rows point the paper's way (...)"."""
    verdicts = compare(rows)
    lines = []
    for i, name in enumerate(("dev PPL", "dev BLEU")):
        judged = {label: v[i] for label, v in verdicts.items() if v[i].direction}
        if not judged:
            continue
        same = [k for k, v in judged.items() if v.direction == "same"]
        opposite = [k for k, v in judged.items() if v.direction == "opposite"]
        ties = [k for k, v in judged.items() if v.direction == "tie"]
        line = (
            f"{name}: {len(same)} of {len(judged)} rows point the paper's way "
            f"({100 * len(same) / len(judged):.0f}%); {len(opposite)} opposite"
        )
        if opposite:
            covered = [k for k in opposite if judged[k].within_spread]
            unjudged = [k for k in opposite if judged[k].within_spread is None]
            line += f" ({', '.join(opposite)}"
            if len(unjudged) < len(opposite):
                line += f"; {len(covered)} of them within the seeds' spread"
                if unjudged:  # one seed for the row and its base: no spread to measure
                    line += f", {', '.join(unjudged)} one seed a side"
            line += ")"
        line += f", {len(ties)} tie{'' if len(ties) == 1 else 's'}"
        line += f" ({', '.join(ties)})" if ties else ""
        lines.append(line)
    return lines


def _score(value: float | None, lo: float | None, hi: float | None, seeds: int) -> str:
    if value is None:
        return ""
    if seeds > 1 and lo is not None and hi is not None:
        return f"{value:.2f} ({lo:.2f}-{hi:.2f})"
    return f"{value:.2f}"


def _way(v: Verdict) -> str:
    if v.direction == "opposite" and v.within_spread:
        return "opposite (in spread)"
    return v.direction


def cells(rows: Sequence[TableRow]) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells, in the paper's layout: a setting equal to the base
    row's is left blank (the base row shows all of them)."""
    verdicts = compare(rows)
    by_label = {r.row: r for r in rows}
    with_paper = any(r.row != r.paper for r in rows)
    with_seeds = any(r.seeds > 1 for r in rows)
    metrics = {r.bleu_metric for r in rows if r.dev_bleu is not None}
    header = ["row"] + (["paper row"] if with_paper else [])
    header += ["N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls", "positional"]
    header += ["steps"] + (["seeds"] if with_seeds else []) + ["dev PPL", "dev BLEU"]
    header += ["BLEU"] if len(metrics) > 1 else []
    header += ["params", "paper PPL", "paper BLEU", "paper params", "PPL way", "BLEU way"]
    with_machine = len({r.machine for r in rows}) > 1
    header += ["machine"] if with_machine else []
    body = []
    for r in rows:
        base = by_label.get(r.base)
        shown = r.row == r.base or base is None
        line = [r.row] + ([r.paper or ""] if with_paper else [])
        for key in SETTINGS:
            value = getattr(r, key)
            if not shown and base is not None and getattr(base, key) == value:
                line.append("")
            else:
                line.append(f"{value:g}" if isinstance(value, float) else str(value))
        steps = str(r.steps) if r.steps == r.steps_max else f"{r.steps}-{r.steps_max}"
        line += [steps] + ([str(r.seeds)] if with_seeds else [])
        line += [
            _score(r.dev_ppl, r.dev_ppl_min, r.dev_ppl_max, r.seeds),
            _score(r.dev_bleu, r.dev_bleu_min, r.dev_bleu_max, r.seeds),
        ]
        line += [r.bleu_metric] if len(metrics) > 1 else []
        paper = PAPER_TABLE3.get(r.paper or "")
        line += [
            "" if r.params is None else f"{r.params / 1e6:.2f}M",
            "" if paper is None else f"{paper.ppl:.2f}",
            "" if paper is None else f"{paper.bleu:.1f}",
            "" if paper is None or paper.params_m is None else f"{paper.params_m:g}M",
        ]
        v = verdicts.get(r.row)
        line += ["", ""] if v is None else [_way(v[0]), _way(v[1])]
        line += [r.machine] if with_machine else []
        body.append(line)
    return header, body


def format_table(rows: Sequence[TableRow], title: str = "") -> str:
    """The table as aligned text, then the summary lines."""
    header, body = cells(rows)
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = [title] if title else []
    for line in [header, *body]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    return "\n".join([*lines, "", *summary(rows)])


def markdown(rows: Sequence[TableRow]) -> str:
    """The table as markdown (docs/results.md), then the summary lines."""
    header, body = cells(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    text = "\n".join(lines)
    return text + "\n\n" + "\n".join(f"{s}." if not s.endswith(".") else s for s in summary(rows))


@dataclass
class RunResult:
    """One row, one seed: what training did and what the averaged model scored on dev."""

    row: str
    seed: int
    run_dir: str
    steps: int
    stopped_by: str
    train_seconds: float
    params: int
    dev_ppl: float
    dev_nll: float
    dev_bleu: float  # sacreBLEU
    dev_tok_bleu: float
    dev_chrf: float
    bleu_signature: str
    trainer_valid_ppl: float | None  # the trainer's last validation (raw model, not averaged)
    averaged: list[str]
    train_key: dict[str, Any] = field(default_factory=dict)
    score_key: dict[str, Any] = field(default_factory=dict)
    machine: str = ""  # `manifest.machine_name`; "" for runs scored before it was kept


@dataclass
class Table3Report:
    """A sweep's outcome: the table's rows, every run's result, what is not in the table."""

    rows: list[TableRow]
    runs: list[RunResult]
    missing: list[str]
    files: list[Path] = field(default_factory=list)
