"""Table 3 as the paper prints it, and how a row's settings move from its base."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from aiayn.config import (
    Config,
    get_preset,
)

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass


@dataclass(frozen=True)
class PaperRow:
    """One line of the paper's Table 3: dev (newstest2013) perplexity and BLEU, and the
    parameters in millions where the paper prints them. The settings are the preset of
    the same name (`aiayn.config.PRESETS`)."""

    ppl: float
    bleu: float
    params_m: float | None = None


#: The paper's Table 3 (../shared/PAPER.md, section 4): dev PPL, dev BLEU, params (M).
PAPER_TABLE3: dict[str, PaperRow] = {
    "base": PaperRow(4.92, 25.8, 65),
    "A1": PaperRow(5.29, 24.9),
    "A2": PaperRow(5.00, 25.5),
    "A3": PaperRow(4.91, 25.8),
    "A4": PaperRow(5.01, 25.4),
    "B1": PaperRow(5.16, 25.1, 58),
    "B2": PaperRow(5.01, 25.4, 60),
    "C1": PaperRow(6.11, 23.7, 36),
    "C2": PaperRow(5.19, 25.3, 50),
    "C3": PaperRow(4.88, 25.5, 80),
    "C4": PaperRow(5.75, 24.5, 28),
    "C5": PaperRow(4.66, 26.0, 168),
    "C6": PaperRow(5.12, 25.4, 53),
    "C7": PaperRow(4.75, 26.2, 90),
    "D1": PaperRow(5.77, 24.6),
    "D2": PaperRow(4.95, 25.5),
    "D3": PaperRow(4.67, 25.3),
    "D4": PaperRow(5.47, 25.7),
    "E": PaperRow(4.92, 25.7),
    "big": PaperRow(4.33, 26.4, 213),
}

#: Table 3's columns of settings, and `positional` (row E: learned instead of sinusoids).
SETTINGS = ("N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls", "positional")
_RATES = ("P_drop", "eps_ls")  # moved by a difference; the sizes by a ratio

#: A change smaller than this is a tie: it rounds to 0 at the paper's printed precision.
TIE = {"ppl": 0.005, "bleu": 0.05}


def settings_of(cfg: Config) -> dict[str, Any]:
    """A config's Table 3 settings, by column."""
    m = cfg.model
    return {
        "N": m.N,
        "d_model": m.d_model,
        "d_ff": m.d_ff,
        "h": m.h,
        "d_k": m.d_k,
        "d_v": m.d_v,
        "P_drop": m.P_drop,
        "eps_ls": cfg.train.eps_ls,
        "positional": m.positional,
    }


def paper_settings(label: str) -> dict[str, Any]:
    """The settings of the paper's row `label` (its preset), and its steps."""
    cfg = get_preset(label)
    return {**settings_of(cfg), "steps": cfg.train.max_steps}


def moves(base: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """The settings `row` changes from `base`: log ratio for sizes, difference for P_drop
    and eps_ls, 1 for positional."""
    out: dict[str, float] = {}
    for key in SETTINGS:
        a, b = base[key], row[key]
        if a == b:
            continue
        if key == "positional":
            out[key] = 1.0
        elif key in _RATES:
            out[key] = float(b) - float(a)
        else:
            out[key] = math.log(b / a)
    return out


def _same_way(ours: dict[str, float], theirs: dict[str, float]) -> bool:
    return set(ours) == set(theirs) and all((ours[k] > 0) == (theirs[k] > 0) for k in ours)


def paper_analog(base: dict[str, Any], row: dict[str, Any]) -> str | None:
    """The paper's row that changes the same settings in the same directions as `row` does
    from `base`, the nearest in size (the sum of the moves' distances); "base" for no
    change, None when no paper row changes those settings so (e.g. two rows' at once)."""
    ours = moves(base, row)
    if not ours:
        return "base"
    paper_base = paper_settings("base")
    best: tuple[float, str] | None = None
    for label in PAPER_TABLE3:
        if label == "base":
            continue
        theirs = moves(paper_base, paper_settings(label))
        if not _same_way(ours, theirs):
            continue
        distance = sum(abs(ours[k] - theirs[k]) for k in ours)
        if best is None or distance < best[0]:
            best = (distance, label)
    return None if best is None else best[1]


def _describe(m: dict[str, float]) -> str:
    return ", ".join(f"{k} {'up' if v > 0 else 'down'}" for k, v in m.items()) or "nothing"
