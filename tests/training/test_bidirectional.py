"""Bidirectional training (BiT; Ding et al., 2021; `train.bidirectional_epochs`): the first
epochs train on every pair in both directions, the rest on source->target. Checked against
the definition (pair n + i is pair i reversed), on the epochs a Trainer builds, and for the
determinism a resumed run needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.config import ConfigError
from aiayn.data.batching import collate
from aiayn.data.corpus import load_corpus
from aiayn.training.trainer import Trainer, train
from helpers import SMALL_TRAINING, losses_after_crash_and_resume, step_losses, tiny_config

SMALL = {**SMALL_TRAINING, "train.max_tokens": 1500, "max_steps": 30, "bidirectional_epochs": 1}


def cfg(**over: Any):
    return tiny_config(SMALL, **over)


def test_both_directions_is_every_pair_then_every_pair_reversed(small_data: Path) -> None:
    corpus = load_corpus(small_data, "train")
    both = corpus.both_directions()
    n = len(corpus)
    assert len(both) == 2 * n
    for i in range(n):
        assert (both.src(i), both.tgt(i)) == (corpus.src(i), corpus.tgt(i))
        assert (both.src(n + i), both.tgt(n + i)) == (corpus.tgt(i), corpus.src(i))
    assert torch.equal(both.src_lens, torch.cat([corpus.src_lens, corpus.tgt_lens]))
    assert torch.equal(both.tgt_lens, torch.cat([corpus.tgt_lens, corpus.src_lens]))
    assert torch.equal(both.line_numbers, corpus.line_numbers.repeat(2))
    # a reversed pair's batch: the German side is encoded and the English one predicted
    batch = collate(both, [n + 3])
    assert batch.src[0, :-1].tolist() == corpus.tgt(3)
    assert batch.tgt_out[0, :-1].tolist() == corpus.src(3)


def test_a_trainer_reverses_the_first_epochs_only(small_data: Path, tmp_path: Path) -> None:
    trainer = Trainer(cfg(bidirectional_epochs=2), small_data, tmp_path / "run")
    try:
        n = len(trainer.train_data)
        assert [len(trainer._epoch_data(e)) for e in range(4)] == [2 * n, 2 * n, n, n]
        assert trainer._epoch_data(1) is trainer._epoch_data(0)  # built once
        assert trainer._epoch_data(2) is trainer.train_data
    finally:
        trainer.close()
    # with BPE-dropout: that epoch's draw, then the same draw reversed
    trainer = Trainer(cfg(bidirectional_epochs=1, bpe_dropout=0.1), small_data, tmp_path / "bpe")
    try:
        n = len(trainer.train_data)
        drawn, both = trainer._epoch_data(0), trainer._bpe_dropout.epoch(1_000_003)
        assert len(drawn) == 2 * n
        assert [drawn.src(i) for i in range(n)] == [both.src(i) for i in range(n)]
        assert [drawn.src(n + i) for i in range(n)] == [both.tgt(i) for i in range(n)]
        assert [drawn.src(i) for i in range(n)] != [trainer.train_data.src(i) for i in range(n)]
        assert len(trainer._epoch_data(1)) == n
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="bidirectional_epochs"):
        cfg(bidirectional_epochs=-1).validate()


def test_bidirectional_training_resumes_exactly(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash inside the bidirectional epoch and a resume give an uninterrupted run's
    losses, through the switch to one direction; and they are not the one-way run's."""
    torch.set_num_threads(1)
    full, resumed = losses_after_crash_and_resume(cfg(), small_data, tmp_path, 13, monkeypatch)
    assert resumed == full
    train(cfg(bidirectional_epochs=0), small_data, tmp_path / "one_way")
    one_way = dict(step_losses(tmp_path / "one_way"))
    assert set(one_way) == set(full) == set(range(1, 31))
    assert one_way != full
    # the fault struck in the bidirectional epoch (after the checkpoint of step 10, the
    # resume's start), and the run went on past it
    records = map(json.loads, (tmp_path / "full" / "train_log.jsonl").read_text().splitlines())
    epochs = {r["step"]: r["epoch"] for r in records if "epoch" in r}
    assert epochs[13] == 0 and epochs[30] >= 2
