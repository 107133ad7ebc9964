"""CTranslate2 export: the converted model must translate like aiayn itself."""

from __future__ import annotations

import pytest
import torch

from aiayn.config import EOS_ID, ModelConfig
from aiayn.decoding.search import greedy_search
from aiayn.deploy.export import SPECIAL, to_ctranslate2, vocabulary
from aiayn.model import Transformer

ctranslate2 = pytest.importorskip("ctranslate2")
from helpers import copy_batch, random_strings, train_copy_model  # noqa: E402


def _model(positional: str = "sinusoidal") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        N=1,
        d_model=32,
        d_ff=64,
        h=4,
        d_k=8,
        d_v=8,
        vocab_size=60,
        max_positions=128,
        positional=positional,
    )
    return Transformer(cfg).eval()


def test_ctranslate2_greedy_output_equals_aiayn(tmp_path):
    """A half-trained copy model (120 of the copy task's 400 steps): outputs that depend on
    the source, end at different lengths and are often wrong, so they test the mapping."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model, _ = train_copy_model(g, steps=120)
    strings = random_strings(64, g)
    src, _, _ = copy_batch(strings)
    ours = greedy_search(model, src, max_len_a=0, max_len_b=12)
    assert len({tuple(o) for o in ours}) > 32 and len({len(o) for o in ours}) > 3
    assert 0 < sum(o == s for o, s in zip(ours, strings, strict=True)) < len(strings)

    path = to_ctranslate2(model, tmp_path / "ct2")
    tokens = vocabulary(model.cfg.vocab_size)
    translator = ctranslate2.Translator(str(path), device="cpu", compute_type="float32")
    batch = [[tokens[t] for t in s + [EOS_ID]] for s in strings]  # aiayn's source ends in EOS
    results = translator.translate_batch(batch, beam_size=1, max_decoding_length=12)
    theirs = [[tokens.index(t) for t in r.hypotheses[0]] for r in results]
    assert theirs == ours

    # Teacher-forced scores of the reference copies: the same log-probabilities.
    _, tgt_in, tgt_out = copy_batch(strings)
    with torch.no_grad():
        logp = torch.log_softmax(model(src, tgt_in), -1).gather(-1, tgt_out.unsqueeze(-1))
    expected = [float(logp[i, : len(s) + 1].sum()) for i, s in enumerate(strings)]
    scored = translator.score_batch(batch, [[tokens[t] for t in s] for s in strings])
    assert [sum(r.log_probs) for r in scored] == pytest.approx(expected, abs=1e-4)


def test_vocabulary_puts_ctranslate2_special_tokens_at_aiayn_ids():
    tokens = vocabulary(6, pieces=["a", "b", "c", "d", "x", "y"])
    assert tokens == [SPECIAL[0], SPECIAL[1], SPECIAL[2], SPECIAL[3], "x", "y"]
    with pytest.raises(ValueError, match="duplicate"):
        vocabulary(6, pieces=["a", "b", "c", "d", "x", "x"])


def test_export_refuses_learned_positions(tmp_path):
    with pytest.raises(ValueError, match="sinusoidal"):
        to_ctranslate2(_model("learned"), tmp_path / "ct2")
