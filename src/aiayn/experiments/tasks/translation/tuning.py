"""Translation's tuning stage: the length penalty alpha chosen on the validation set, after
a screen that flags a model not trained enough to be worth tuning."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import DecodeConfig
from aiayn.files import write_text_atomic

if TYPE_CHECKING:
    from aiayn.decoding.translate import Decoder, SubwordTokenizer

log = logging.getLogger(__name__)

#: The training steps that the En->De recipe's model needs to score well above
#: UNUSABLE_BLEU (about what a 2-core Sapphire Rapids VM trains in 10 minutes of bf16).
USABLE_STEPS = 2500


def not_trained_enough(
    bleu: float, train: dict[str, Any], max_minutes: float, dtype: str
) -> dict[str, Any] | None:
    """None for a usable model; else what results.json and the summary say of one whose
    test BLEU is near 0: how far it trained, how fast on this CPU, and the budget that
    would reach `USABLE_STEPS` at that pace."""
    if bleu >= UNUSABLE_BLEU:
        return None
    from aiayn.fast import machine

    steps, seconds = int(train["steps"]), float(train["train_seconds"])
    minutes = seconds / 60
    rate = train["tokens"] / max(seconds, 1e-9)
    need = math.ceil(minutes * USABLE_STEPS / max(steps, 1) / 5) * 5 if steps else None
    cls = machine.cpu().cls
    advice = (
        f"try MINUTES={need} (bash scripts/quickstart.sh) or --max-minutes {need}"
        if need and need > minutes
        else "train longer (--max-minutes) or check the data"
    )
    message = (
        f"not trained enough: {steps} steps in {minutes:.1f} minutes at {rate:,.0f} tokens/s "
        f"on this CPU (class {cls}, training in {dtype}); test sacreBLEU "
        f"{bleu:.2f} is below {UNUSABLE_BLEU:g}, {advice}"
    )
    return {
        "message": message,
        "steps": steps,
        "train_minutes": minutes,
        "tokens_per_s": rate,
        "cpu_class": cls,
        "dtype": dtype,
        "budget_minutes": max_minutes,
        "suggested_minutes": need,
    }


#: Validation sentences decoded first, at the grid's first alpha, before tuning the length
#: penalty: a model below UNUSABLE_BLEU there is reported as not trained enough instead of
#: being decoded once per alpha (an undertrained model's outputs run to the length cap).
ALPHA_SCREEN_SENTENCES = 100
#: sacreBLEU below which a model counts as not usable (untrained models score 0-0.5).
UNUSABLE_BLEU = 1.0


def tune_alpha(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    src_path: Path,
    ref_path: Path,
    target_lang: str,
    decode: DecodeConfig,
    grid: tuple[float, ...],
    out: Path,
    *,
    device: str = "cpu",
    screen: int = ALPHA_SCREEN_SENTENCES,
) -> tuple[DecodeConfig, dict[str, Any]]:
    """Translate the validation set at each length penalty in `grid` and keep the best.

    The criterion is sacreBLEU; a tie goes to the value listed first. The hypotheses stay
    in `out` (one file per alpha) for inspection. Where the set has more than `screen`
    sentences, its first `screen` are decoded at grid[0] first, and a model scoring below
    `UNUSABLE_BLEU` there keeps `decode`'s alpha: the record says "skipped".

    Returns:
        The decode settings with the chosen alpha, and a record of every alpha's scores.
    """
    from aiayn.decoding.translate import translate_file
    from aiayn.files import read_lines
    from aiayn.scoring.bleu import score_files

    if not grid:
        raise ValueError("tune_alpha needs at least one alpha to try")
    out.mkdir(parents=True, exist_ok=True)
    if screen:
        src_lines = list(read_lines(src_path))
        if len(src_lines) > screen:
            ref_lines = list(read_lines(ref_path))[:screen]
            first = {"src": src_lines[:screen], "ref": ref_lines}
            for side, lines in first.items():
                write_text_atomic(out / f"screen.{side}", "".join(f"{x}\n" for x in lines))
            cfg = replace(decode, alpha=grid[0])
            hyp = out / "screen.hyp"
            summary = translate_file(model, tokenizer, out / "screen.src", hyp, cfg, device=device)
            s = score_files(hyp, out / "screen.ref", target_lang)
            record = {
                "sentences": screen,
                "alpha": grid[0],
                "sacrebleu": s.sacrebleu,
                "tok_bleu": s.tok_bleu,
                "seconds": summary["seconds"],
            }
            if s.sacrebleu < UNUSABLE_BLEU:
                log.warning(
                    "alpha tuning skipped: sacreBLEU %.2f on the first %d sentences of %s "
                    "at alpha %g, below %g: the model is not trained enough to tune",
                    s.sacrebleu,
                    screen,
                    src_path.name,
                    grid[0],
                    UNUSABLE_BLEU,
                )
                return decode, {
                    "criterion": "sacrebleu",
                    "skipped": "model not usable",
                    "screen": record,
                    "sentences": 0,
                    "tried": [],
                    "chosen": decode.alpha,
                }
    tried = []
    for alpha in grid:
        cfg = replace(decode, alpha=alpha)
        hyp = out / f"alpha{alpha:g}.hyp"
        summary = translate_file(model, tokenizer, src_path, hyp, cfg, device=device)
        s = score_files(hyp, ref_path, target_lang)
        tried.append(
            {
                "alpha": alpha,
                "sacrebleu": s.sacrebleu,
                "tok_bleu": s.tok_bleu,
                "chrf": s.chrf,
                "seconds": summary["seconds"],
            }
        )
        log.info(
            "alpha %g on %s: sacreBLEU %.2f, tok-BLEU %.2f",
            alpha,
            src_path.name,
            s.sacrebleu,
            s.tok_bleu,
        )
    best = max(tried, key=lambda r: r["sacrebleu"])  # max() keeps the first of equals
    return replace(decode, alpha=best["alpha"]), {
        "criterion": "sacrebleu",
        "sentences": s.n_lines,
        "tried": tried,
        "chosen": best["alpha"],
    }
