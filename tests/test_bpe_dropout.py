"""BPE-dropout (Provilkov et al., 2020; `train.bpe_dropout`): each epoch re-segments the
training text by skipping each BPE merge with probability p. Checked against the
definition (p -> 1 leaves characters, p = 0 the fixed segmentation), for text
preservation, and for the determinism a resumed run needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.config import ConfigError, apply_overrides, get_preset
from aiayn.data import BPEDropout, load_corpus, load_tokenizer
from aiayn.train import train

SMALL = {"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "d_k": 16, "d_v": 16, "P_drop": 0.1,
         "train.max_tokens": 400, "max_steps": 30, "warmup_steps": 10,
         "save_interval_steps": 5, "keep_last": 20, "log_interval_steps": 1,
         "valid_interval_steps": 10, "dtype": "fp32", "bpe_dropout": 0.1}

TEXT = ["Two young, White males are outside near many bushes.",
        "Several men in hard hats are operating a giant pulley system."]


def cfg(**over: Any):
    return apply_overrides(get_preset("tiny"), {**SMALL, **over})


def test_sampled_segmentations_keep_the_text_and_follow_the_seed(small_data: Path) -> None:
    tok = load_tokenizer(small_data)
    fixed = tok.encode_batch(TEXT)
    a = tok.encode_batch_dropout(TEXT, 0.3, seed=5)
    assert a == tok.encode_batch_dropout(TEXT, 0.3, seed=5)
    draws = [tok.encode_batch_dropout(TEXT, 0.3, seed=s) for s in range(6)]
    assert len({json.dumps(d) for d in draws}) > 1
    for draw in draws:
        assert [tok.decode(ids) for ids in draw] == [tok.decode(ids) for ids in fixed]
        # dropping merges can only make pieces shorter, so sequences longer
        assert all(len(d) >= len(f) for d, f in zip(draw, fixed, strict=True))
    assert sum(map(len, a)) > sum(map(len, fixed))


def test_all_merges_dropped_leaves_characters(small_data: Path) -> None:
    """p close to 1 skips every merge: the pieces are the single characters (with
    sentencepiece's word-boundary mark "▁" as one of them)."""
    tok = load_tokenizer(small_data)
    pieces = [tok.id_to_piece(i) for i in tok.encode_batch_dropout(TEXT[:1], 0.999999, 1)[0]]
    expected = list("\u2581" + TEXT[0].replace(" ", "\u2581"))
    assert pieces == expected
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        tok.encode_batch_dropout(TEXT, 0.0, 1)
    with pytest.raises(ConfigError, match="bpe_dropout"):
        cfg(bpe_dropout=1.0).validate()


def test_each_epoch_is_a_resegmentation_of_the_same_pairs(small_data: Path) -> None:
    tok, corpus = load_tokenizer(small_data), load_corpus(small_data, "train")
    drop = BPEDropout(corpus, tok, 0.1, max_len=256)
    e1, e1_again, e2 = drop.epoch(1), drop.epoch(1), drop.epoch(2)
    n = len(corpus)
    assert len(e1) == n and torch.equal(e1.line_numbers, corpus.line_numbers)
    for side in ("src", "tgt"):
        prep = [getattr(corpus, side)(i) for i in range(n)]
        one = [getattr(e1, side)(i) for i in range(n)]
        assert one == [getattr(e1_again, side)(i) for i in range(n)]
        assert one != [getattr(e2, side)(i) for i in range(n)]
        assert one != prep
        assert [tok.decode(x) for x in one] == [tok.decode(x) for x in prep]
    # a side the draw makes longer than max_len keeps its prepared segmentation
    cap = int(corpus.src_lens.max())
    capped = BPEDropout(corpus, tok, 0.5, max_len=cap).epoch(1)
    assert int(capped.src_lens.max()) <= cap
    longest = int(corpus.src_lens.argmax())
    assert capped.src(longest) == corpus.src(longest)


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "event" not in r}


def test_training_with_bpe_dropout_resumes_exactly(small_data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash and a resume replay the same segmentations (they come from seed and epoch),
    so the losses equal an uninterrupted run's; and they are not the fixed segmentation's."""
    torch.set_num_threads(1)
    train(cfg(), small_data, tmp_path / "full")
    full = _losses(tmp_path / "full")
    monkeypatch.setenv("AIAYN_FAULTS", "raise_at_step=18")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg(), small_data, tmp_path / "resumed")
    monkeypatch.delenv("AIAYN_FAULTS")
    train(cfg(), small_data, tmp_path / "resumed")
    assert _losses(tmp_path / "resumed") == full
    train(cfg(bpe_dropout=0.0), small_data, tmp_path / "fixed")
    fixed = _losses(tmp_path / "fixed")
    assert fixed[1] != full[1]
    assert set(fixed) == set(full) == set(range(1, 31))
