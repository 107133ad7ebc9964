"""Parsing's tuning stage: beam and alpha chosen on the development set by bracketing F1."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import DecodeConfig
from aiayn.experiments.tasks.parsing.data import SOURCE
from aiayn.files import read_lines

if TYPE_CHECKING:
    from aiayn.decoding.translate import Decoder, SubwordTokenizer
    from aiayn.decoding.tree_constraint import TreeLimits

log = logging.getLogger(__name__)


def tune_parse(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    dev: Path,
    decode: DecodeConfig,
    beams: tuple[int, ...],
    alphas: tuple[float, ...],
    out: Path,
    *,
    device: str = "cpu",
    limits: TreeLimits | None = None,
    linearization: str = "words",
    word_mass: bool = False,
) -> tuple[DecodeConfig, dict[str, Any]]:
    """Parse the development set at each beam x alpha and keep the best bracketing F1
    (aiayn's EVALB, COLLINS.prm); a tie goes to the setting listed first. `dev` is the
    prefix of .words and .trees files; the trees parsed stay in `out`. Decoding is
    constrained (`decoding.tree_constraint`), within `limits`, words scored as
    `word_mass` says."""
    from aiayn.decoding.parse import parse_file
    from aiayn.scoring.evalb import COLLINS
    from aiayn.scoring.evalb import score_files as score_trees_files

    # COLLINS.prm stops after 10 sentences of unequal length; a half-trained model's trees
    # never have that (their words are the input's), but a punctuation tag unlike the gold
    # one does, and choosing a setting must not stop on it
    params = replace(COLLINS, max_error=10**6)
    out.mkdir(parents=True, exist_ok=True)
    tried = []
    for beam in beams or (decode.beam,):
        for alpha in alphas or (decode.alpha,):
            cfg = replace(decode, beam=beam, alpha=alpha, nbest=1)
            hyp = out / f"beam{beam}.alpha{alpha:g}.trees"
            _, summary = parse_file(
                model,
                tokenizer,
                Path(f"{dev}.{SOURCE}"),
                hyp,
                cfg,
                device,
                limits=limits,
                linearization=linearization,
                word_mass=word_mass,
            )
            s = score_trees_files(Path(f"{dev}.trees"), hyp, params).all
            tried.append(
                {
                    "beam": beam,
                    "alpha": alpha,
                    "f1": s.f1,
                    "precision": s.precision,
                    "recall": s.recall,
                    "ill_formed": summary["ill_formed"],
                    "seconds": summary["seconds"],
                    "sentences_per_s": summary["sentences_per_s"],
                }
            )
            log.info("beam %d alpha %g on dev: F1 %.2f", beam, alpha, s.f1)
    best = max(tried, key=lambda r: r["f1"])  # max() keeps the first of equals
    return replace(decode, beam=best["beam"], alpha=best["alpha"]), {
        "criterion": "bracketing F1 (aiayn's EVALB, COLLINS.prm) on the development set",
        "sentences": len(list(read_lines(Path(f"{dev}.{SOURCE}")))),
        "tried": tried,
        "chosen": {"beam": best["beam"], "alpha": best["alpha"]},
    }
