"""Tests for aiayn.decoding.ensemble: several models decoding as the mean of their distributions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from aiayn.checkpoints import FORMAT, CheckpointError, load_ensemble, save_checkpoint_file
from aiayn.config import BOS_ID, EOS_ID, PAD_ID, Config, ModelConfig
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.model import Transformer
from helpers import A, B, TableModel, fast_transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=50)


def transformer(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return fast_transformer(CFG).eval()


def sources(b: int = 5, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, CFG.vocab_size, (b, 7), generator=gen)
    src[:, -1] = EOS_ID
    src[1, 4:] = PAD_ID
    src[1, 3] = EOS_ID
    return src


def test_one_step_is_the_log_of_the_mean_probability() -> None:
    """log P_ens = log (1/K) sum_k softmax(member k's logits), with each member's logits
    taken from its teacher-forced decoder over the whole prefix (not the incremental path)."""
    members = [transformer(s) for s in (1, 2, 3)]
    ens = Ensemble(members)
    src = sources()
    prefix = torch.tensor([[BOS_ID, 7, 9, 11]] * src.size(0))
    memory, mask = ens.encode(src)
    states = ens.init_state(memory, 20)
    with torch.no_grad():
        for t in range(prefix.size(1)):
            got = ens.decode_step(prefix[:, t : t + 1], mask, states)
        want = (
            torch.stack([m(src, prefix).double().softmax(-1)[:, -1] for m in members]).mean(0).log()
        )
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert torch.allclose(got.exp().sum(-1), torch.ones(src.size(0)), atol=1e-5)


def test_mean_of_probabilities_not_of_log_probabilities() -> None:
    """A hand-set case where the two rules disagree. First step: member 1 gives A 0.1,
    B 0.9; member 2 gives A 0.5, B 0.01, EOS 0.49. The mean of probabilities ranks B
    (0.455) over A (0.3) and EOS (0.245); a mean of log-probabilities (a geometric mean)
    would rank A (sqrt 0.05 = 0.22) over B (sqrt 0.009 = 0.095)."""
    one = TableModel({(): {A: 0.1, B: 0.9}}, default={EOS_ID: 1.0})
    two = TableModel({(): {A: 0.5, B: 0.01, EOS_ID: 0.49}}, default={EOS_ID: 1.0})
    src = torch.tensor([[A, EOS_ID]])
    assert greedy_search(one, src, 0, 5) == [[B]]
    assert greedy_search(two, src, 0, 5) == [[A]]
    assert greedy_search(Ensemble([one, two]), src, 0, 5) == [[B]]
    (best,) = beam_search(Ensemble([one, two]), src, beam=2, alpha=0.0, max_len_a=0, max_len_b=5)[0]
    assert best.tokens == [B] and best.log_prob == pytest.approx(math.log(0.455), abs=1e-6)


def test_copies_of_one_model_search_like_the_model() -> None:
    """K copies of one model have its distribution: the same beam and greedy outputs and
    scores as the model alone (float rounding apart)."""
    model = transformer(4)
    src = sources(b=6, seed=1)
    ens = Ensemble([model, model, model])
    for got, want in zip(
        beam_search(ens, src, 4, 0.6, 1, 10, nbest=2),
        beam_search(model, src, 4, 0.6, 1, 10, nbest=2),
        strict=True,
    ):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)
    assert greedy_search(ens, src, 1, 10) == greedy_search(model, src, 1, 10)


def test_batch_size_does_not_change_ensemble_outputs() -> None:
    """F6 for an ensemble: each sentence decoded alone gives what it gives in the batch."""
    ens = Ensemble([transformer(5), transformer(6)])
    src = sources(b=4, seed=2)
    batch = beam_search(ens, src, 4, 0.6, 1, 10)
    for i in range(src.size(0)):
        row = src[i : i + 1]
        row = row[:, : int((row != PAD_ID).sum())]
        assert [h.tokens for h in beam_search(ens, row, 4, 0.6, 1, 10)[0]] == [
            h.tokens for h in batch[i]
        ]


def test_members_must_agree_on_the_vocabulary_size() -> None:
    other = fast_transformer(
        ModelConfig(N=1, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, vocab_size=60)
    )
    with pytest.raises(ValueError, match="vocabulary sizes: 50, 60"):
        Ensemble([transformer(1), other])
    with pytest.raises(ValueError, match="at least one"):
        Ensemble([])


def _checkpoint(path: Path, seed: int, vocab_sentences: list[str]) -> Path:
    tok = Tokenizer.train_from_sentences(vocab_sentences, 40, None)
    cfg = ModelConfig(N=1, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, vocab_size=tok.vocab_size)
    torch.manual_seed(seed)
    model = fast_transformer(cfg)
    config = Config(model=cfg)
    save_checkpoint_file(
        path,
        {
            "format": FORMAT,
            "config": config.to_dict(),
            "vocab_sha256": tok.sha256,
            "tokenizer": torch.frombuffer(bytearray(tok.to_bytes()), dtype=torch.uint8),
            "model": model.state_dict(),
            "step": 1,
        },
    )
    return path


@pytest.mark.rows("F11")
def test_load_ensemble_refuses_members_with_other_vocabularies(tmp_path: Path) -> None:
    text = [f"a dog runs on the beach number {i} with a red ball" for i in range(50)]
    other = [f"eine Katze schläft auf dem Sofa Nummer {i} neben dem Hund" for i in range(50)]
    a = _checkpoint(tmp_path / "a.pt", 1, text)
    b = _checkpoint(tmp_path / "b.pt", 2, text)
    c = _checkpoint(tmp_path / "c.pt", 3, other)
    models, tokenizer, _ = load_ensemble([a, b])
    assert (
        len(models) == 2
        and tokenizer.sha256 == Tokenizer.train_from_sentences(text, 40, None).sha256
    )
    with pytest.raises(
        CheckpointError,
        match=r"c\.pt: its vocabulary .* differs from "
        r".*a\.pt",
    ):
        load_ensemble([a, c])
