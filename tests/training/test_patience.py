"""Early stopping on the configured best metric (issue 73): train.patience counts the
validations that measured valid BLEU (where BLEU is measured) and stops after that many
without a better one; without BLEU it watches validation NLL, as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiayn.training.state import TrainState
from aiayn.training.trainer import train
from aiayn.training.validation import Validator
from aiayn.training.watch import patience_metric
from helpers import SMALL_TRAINING, tiny_config

#: valid BLEU at each step it is measured: better, better, worse, worse, better
BLEU = {10: 5.0, 20: 6.0, 30: 4.0, 40: 5.5, 50: 7.0}


def cfg(**over: object):  # type: ignore[no-untyped-def]
    return tiny_config(SMALL_TRAINING, **over)


def scripted_bleu(monkeypatch: pytest.MonkeyPatch, measured: list[int]) -> None:
    """The trainer's validator returns BLEU[step] instead of decoding (what is tested is
    what the trainer does with the number)."""

    def fake(self: Validator, state: TrainState) -> dict[str, float]:
        measured.append(state.step)
        return {"valid_bleu": BLEU[state.step]}

    monkeypatch.setattr(Validator, "_valid_bleu", fake)


def test_patience_watches_valid_bleu_counting_only_the_validations_with_bleu(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NLL every 5 steps, BLEU every 10: BLEU best at 20, worse at 30 and 40: with patience
    2 the run stops at step 40, the validations at 25 and 35 (NLL only) not counted."""
    torch.set_num_threads(1)
    measured: list[int] = []
    scripted_bleu(monkeypatch, measured)
    c = cfg(max_steps=60, valid_interval_steps=5, valid_bleu_interval_steps=10, patience=2)
    assert patience_metric(c.train) == "valid_bleu"
    result = train(c, small_data, tmp_path / "run")
    assert result.stopped_by == "patience"
    assert result.state.step == 40 and measured == [10, 20, 30, 40]
    assert result.state.valid_without_improvement == 2
    assert result.state.best_checkpoint_step == 20


def test_with_one_more_patience_a_better_bleu_resets_the_count(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    measured: list[int] = []
    scripted_bleu(monkeypatch, measured)
    c = cfg(max_steps=50, valid_interval_steps=10, valid_bleu_interval_steps=10, patience=3)
    result = train(c, small_data, tmp_path / "run")
    assert result.stopped_by == "max_steps" and result.state.step == 50
    assert result.state.valid_without_improvement == 0  # 7.0 at step 50 beat 6.0


def test_the_watched_metric_follows_best_metric() -> None:
    assert patience_metric(cfg().train) == "valid_nll"  # no valid BLEU: NLL, as before
    bleu = cfg(valid_interval_steps=5, valid_bleu_interval_steps=10)
    assert patience_metric(bleu.train) == "valid_bleu"
    assert patience_metric(cfg(best_metric="ppl").train) == "valid_ppl"
    none = cfg(valid_interval_steps=5, valid_bleu_interval_steps=10, best_metric="none")
    assert patience_metric(none.train) == "valid_nll"
