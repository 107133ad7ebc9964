"""BPE-dropout (Provilkov et al., 2020; `train.bpe_dropout`): each epoch re-segments the
training text, discarding each BPE merge with probability p. Checked against
sentencepiece's own segmentation (p = 0), against the definition (one possible merge is
discarded with probability p; p -> 1 leaves characters), C against Python draw for draw,
and for the determinism a resumed run needs (the same draws in another process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.config import ConfigError
from aiayn.data.bpe_dropout import BPEDropout, _bpe_dropout_words
from aiayn.data.corpus import load_corpus, load_tokenizer
from aiayn.data.tokenizer import Tokenizer
from aiayn.fast import native
from aiayn.files import read_lines
from aiayn.training.trainer import train
from helpers import (
    MULTI30K,  # noqa: E402
    SMALL_TRAINING,
    losses_after_crash_and_resume,
    step_losses,
    tiny_config,
)

SMALL = {**SMALL_TRAINING, "max_steps": 30, "bpe_dropout": 0.1}


def cfg(**over: Any):
    return tiny_config(SMALL, **over)


def _sides(corpus: Any, n: int) -> list[list[int]]:
    return [corpus.src(i) for i in range(n)] + [corpus.tgt(i) for i in range(n)]


def _words(drop: BPEDropout, seed: int, p: float, python: bool) -> tuple[torch.Tensor, ...]:
    """Each word's pieces, compacted (what the epoch is built from)."""
    threshold = round(p * 2**53)
    if python:
        out, count = _bpe_dropout_words(drop._sym, drop._word_off, drop._merges, seed, threshold)
    else:
        done = native.bpe_dropout(
            drop._sym,
            drop._word_off,
            drop._keys,
            drop._merged,
            drop._score,
            drop._v,
            seed,
            threshold,
        )
        assert done is not None
        out, count = done
    pieces = [
        out[int(a) : int(a) + int(c)] for a, c in zip(drop._word_off[:-1], count, strict=True)
    ]
    return torch.cat(pieces), count


def test_at_p0_the_merges_give_sentencepieces_segmentation() -> None:
    """The sampler rebuilds each word from its characters with `Tokenizer.bpe_merges`; with
    no merge discarded that must be exactly what sentencepiece's encoder gives for the raw
    text: 3,000 Multi30k pairs under a 2,000-piece vocabulary, C and Python."""
    if not MULTI30K.is_dir():
        pytest.skip("needs ../shared/data/multi30k")
    text = {
        lang: list(islice(read_lines(MULTI30K / f"train.{lang}.gz"), 3000)) for lang in ("en", "de")
    }
    tok = Tokenizer.train_from_sentences(text["en"] + text["de"], 2000, None)
    from aiayn.data.prepare import Corpus, _pack

    src_ids, src_off = _pack(tok.encode_batch(text["en"]))
    tgt_ids, tgt_off = _pack(tok.encode_batch(text["de"]))
    corpus = Corpus(
        {
            "src_ids": src_ids,
            "src_offsets": src_off,
            "tgt_ids": tgt_ids,
            "tgt_offsets": tgt_off,
            "line_numbers": torch.arange(1, 3001),
        }
    )
    drop = BPEDropout(corpus, tok, 0.1, max_len=256)
    assert not bool(drop._fixed.any())
    # the words start as characters, not as the prepared pieces
    assert drop._sym.numel() > 2 * (src_ids.numel() + tgt_ids.numel())
    for python in (False, True) if native.library() is not None else (True,):
        pieces, _ = _words(drop, seed=7, p=0.0, python=python)
        assert torch.equal(pieces, torch.cat([src_ids, tgt_ids]))


def test_c_and_python_draw_the_same_segmentations(small_data: Path) -> None:
    if native.library() is None:
        pytest.skip("needs the compiled library")
    drop = BPEDropout(load_corpus(small_data, "train"), load_tokenizer(small_data), 0.3, 256)
    for seed, p in ((1, 0.1), (2**64 - 5, 0.3), (12345, 0.9)):
        c, c_count = _words(drop, seed, p, python=False)
        py, py_count = _words(drop, seed, p, python=True)
        assert torch.equal(c_count, py_count) and torch.equal(c, py)


def test_one_possible_merge_is_discarded_with_probability_p(small_data: Path) -> None:
    """A word of two symbols whose pair is a piece: merged unless its one draw falls below
    p, so over 20,000 words (independent draws) the unmerged share is p within 4.5 sigma;
    and p -> 1 leaves every word as its characters."""
    tok = load_tokenizer(small_data)
    (a, b), (c, _) = next(
        (k, m)
        for k, m in tok.bpe_merges().items()
        if len(tok.id_to_piece(k[0])) == 1 and len(tok.id_to_piece(k[1])) == 1
    )
    drop = BPEDropout(load_corpus(small_data, "train"), tok, 0.3, 256)
    n = 20_000
    drop._sym = torch.tensor([a, b] * n, dtype=torch.int32)
    drop._word_off = torch.arange(0, 2 * n + 1, 2, dtype=torch.int64)
    for python in (False, True) if native.library() is not None else (True,):
        for p in (0.1, 0.3):
            _, count = _words(drop, seed=3, p=p, python=python)
            unmerged = float((count == 2).float().mean())
            assert set(count.tolist()) == {1, 2}
            assert abs(unmerged - p) < 4.5 * (p * (1 - p) / n) ** 0.5
        whole, _ = _words(drop, seed=3, p=0.0, python=python)
        assert whole.tolist() == [c] * n
    # all merges discarded: the characters, with the word-boundary mark "▁" as one of them
    drop = BPEDropout(load_corpus(small_data, "train"), tok, 0.3, 256)
    chars, _ = _words(drop, seed=9, p=1.0 - 2**-50, python=native.library() is None)
    assert all(len(tok.id_to_piece(int(i))) == 1 for i in chars)
    assert torch.equal(chars, drop._sym)


def test_each_epoch_is_a_resegmentation_of_the_same_pairs(small_data: Path) -> None:
    tok, corpus = load_tokenizer(small_data), load_corpus(small_data, "train")
    drop = BPEDropout(corpus, tok, 0.1, max_len=256)
    e1, e1_again, e2 = drop.epoch(1), drop.epoch(1), drop.epoch(2)
    n = len(corpus)
    assert len(e1) == n and torch.equal(e1.line_numbers, corpus.line_numbers)
    prep, one = _sides(corpus, n), _sides(e1, n)
    assert one == _sides(e1_again, n)
    assert one != _sides(e2, n) and one != prep
    assert [tok.decode(x) for x in one] == [tok.decode(x) for x in prep]
    # left-out merges make pieces shorter on the whole (not always: a merge left out at
    # one step can let another, longer piece form)
    assert sum(map(len, one)) > sum(map(len, prep))
    # a side the draw makes longer than max_len keeps the pair's prepared segmentation
    cap = int(corpus.src_lens.max())
    capped = BPEDropout(corpus, tok, 0.5, max_len=cap).epoch(1)
    assert int(capped.src_lens.max()) <= cap
    longest = int(corpus.src_lens.argmax())
    assert capped.src(longest) == corpus.src(longest)
    assert capped.tgt(longest) == corpus.tgt(longest)
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        BPEDropout(corpus, tok, 0.0, 256)
    with pytest.raises(ConfigError, match="bpe_dropout"):
        cfg(bpe_dropout=1.0).validate()


def test_another_process_draws_the_same_epoch(small_data: Path) -> None:
    """What removed the first version of this option: sentencepiece's seeded sampling
    differed between processes. These draws come from (seed, word) only."""
    code = (
        "import sys, hashlib, json\n"
        "import aiayn.fast\n"  # the compiled merges, as in this process
        "from aiayn.data.bpe_dropout import BPEDropout\n"
        "from aiayn.data.corpus import load_corpus, load_tokenizer\n"
        "d = sys.argv[1]; c = load_corpus(d, 'train')\n"
        "e = BPEDropout(c, load_tokenizer(d), 0.1, 256).epoch(42)\n"
        "print(json.dumps([[e.src(i), e.tgt(i)] for i in range(len(c))]))"
    )
    tok, corpus = load_tokenizer(small_data), load_corpus(small_data, "train")
    here = BPEDropout(corpus, tok, 0.1, 256).epoch(42)
    expected = [[here.src(i), here.tgt(i)] for i in range(len(corpus))]
    for env in ({}, {"AIAYN_NO_NATIVE": "1"}):
        out = subprocess.run(
            [sys.executable, "-c", code, str(small_data)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        ).stdout
        assert json.loads(out) == expected


def test_training_with_bpe_dropout_resumes_exactly(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash and a resume replay the same segmentations (they come from seed and epoch),
    so the losses equal an uninterrupted run's; and they are not the fixed segmentation's."""
    torch.set_num_threads(1)
    full, resumed = losses_after_crash_and_resume(cfg(), small_data, tmp_path, 18, monkeypatch)
    assert resumed == full
    train(cfg(bpe_dropout=0.0), small_data, tmp_path / "fixed")
    fixed = dict(step_losses(tmp_path / "fixed"))
    assert fixed[1] != full[1]
    assert set(fixed) == set(full) == set(range(1, 31))


def test_training_with_bpe_dropout_on_aiayns_kernel_cache_says_to_shrink_it(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """New batch shapes every epoch grow aiayn's large oneDNN cache (docs/performance.md):
    a bf16 CPU run says to start with 1,024, and one that did is not told again."""
    import aiayn

    advice = "ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024"
    for capacity, warned in ((aiayn.config.ONEDNN_PRIMITIVE_CACHE_CAPACITY, True), (1024, False)):
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
        caplog.clear()
        with caplog.at_level("WARNING"):
            train(cfg(dtype="bf16", max_steps=2), small_data, tmp_path / str(capacity))
        assert (advice in caplog.text) is warned
