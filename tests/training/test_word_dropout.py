"""Word dropout (Sennrich and Zhang, 2019; `train.word_dropout`): source tokens and decoder
inputs become <unk> at rate p, never EOS, BOS, padding or what the decoder predicts.
Checked against that definition (the rate within a few standard errors), on the batches a
Trainer feeds the model, and for the determinism a resumed run needs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, ConfigError
from aiayn.data.batching import Batch, collate
from aiayn.data.corpus import load_corpus
from aiayn.training.trainer import train
from helpers import SMALL_TRAINING, losses_after_crash_and_resume, step_losses, tiny_config

SMALL = {**SMALL_TRAINING, "train.max_tokens": 1500, "max_steps": 30, "word_dropout": 0.1}


def cfg(**over: Any):
    return tiny_config(SMALL, **over)


def test_drop_words_replaces_inputs_at_rate_p_and_nothing_else(small_data: Path) -> None:
    corpus = load_corpus(small_data, "train")
    batch = collate(corpus, list(range(len(corpus))))
    torch.manual_seed(0)
    p = 0.3
    dropped = batch.drop_words(p)
    assert torch.equal(dropped.tgt_out, batch.tgt_out) and torch.equal(dropped.ids, batch.ids)
    for new, old, kept in (
        (dropped.src, batch.src, EOS_ID),
        (dropped.tgt_in, batch.tgt_in, BOS_ID),
    ):
        changed = new != old
        assert bool((new[changed] == UNK_ID).all())  # a change is always to <unk>
        special = (old == PAD_ID) | (old == kept)
        assert not bool(changed[special].any())  # padding, EOS and BOS stay
        eligible = ((~special) & (old != UNK_ID)).sum().item()
        rate = changed.sum().item() / eligible
        assert eligible > 5_000
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / eligible), rate
    torch.manual_seed(0)
    again = batch.drop_words(p)
    assert torch.equal(again.src, dropped.src) and torch.equal(again.tgt_in, dropped.tgt_in)
    torch.manual_seed(0)
    assert torch.equal(batch.drop_words(0.0).src, batch.src)
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="word_dropout"):
            cfg(word_dropout=bad).validate()


def test_a_trainer_feeds_the_model_dropped_words(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[Batch, Batch]] = []
    original = Batch.drop_words

    def spy(self: Batch, p: float) -> Batch:
        out = original(self, p)
        seen.append((self, out))
        return out

    monkeypatch.setattr(Batch, "drop_words", spy)
    train(cfg(max_steps=3), small_data, tmp_path / "on")
    assert len(seen) == 3
    for before, after in seen:
        assert bool((after.src == UNK_ID).any()) and bool((after.tgt_in == UNK_ID).any())
        assert torch.equal(after.tgt_out, before.tgt_out)
    seen.clear()
    train(cfg(max_steps=3, word_dropout=0.0), small_data, tmp_path / "off")
    assert not seen


def test_word_dropout_resumes_exactly(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash and a resume give an uninterrupted run's losses, and these are not the
    losses without word dropout."""
    torch.set_num_threads(1)
    full, resumed = losses_after_crash_and_resume(cfg(), small_data, tmp_path, 13, monkeypatch)
    assert resumed == full
    train(cfg(word_dropout=0.0), small_data, tmp_path / "off")
    off = dict(step_losses(tmp_path / "off"))
    assert set(off) == set(full) == set(range(1, 31))
    assert off != full
