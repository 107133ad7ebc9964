"""The seam (issue 52): the paper's model alone (`aiayn.model`) and the same weights with
the speed paths plugged in (`aiayn.fast.accelerate`) compute the same function.

Stated tolerances, float32 on the CPU: logits, encoder memory and gradients within 1e-5
(absolute, on values of order 1; the paths add, multiply and sum in other orders), and
greedy and beam search give the same tokens, with scores within 1e-4.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from aiayn.config import EOS_ID, PAD_ID, ModelConfig
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.fast import accelerate, is_accelerated
from aiayn.fast.caches import PathKVCache
from aiayn.fast.decoder_step import NativeStates
from aiayn.fast.layers import FastTransformer
from aiayn.fast.packing import Packing
from aiayn.model import KVCache, Transformer

CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=60)
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def pair(**changes: object) -> tuple[Transformer, Transformer]:
    """The paper's model and a fast copy with the same weights."""
    torch.manual_seed(0)
    paper = Transformer(replace(CFG, **changes))
    return paper, accelerate(copy.deepcopy(paper))


def ragged(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources and targets of different lengths, EOS-terminated sources."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 60, (5, 11), generator=g)
    tgt = torch.randint(4, 60, (5, 9), generator=g)
    for i, (s, t) in enumerate([(11, 4), (5, 9), (8, 2), (3, 6), (10, 9)]):
        src[i, s - 1], src[i, s:], tgt[i, t:] = EOS_ID, PAD_ID, PAD_ID
    return src, tgt


def test_accelerate_keeps_the_parameters_and_the_state_dict() -> None:
    paper, _ = pair()
    before = {k: v for k, v in paper.state_dict().items()}
    params = [id(p) for p in paper.parameters()]
    fast = accelerate(paper)
    assert fast is paper and is_accelerated(fast) and isinstance(fast, FastTransformer)
    assert [id(p) for p in fast.parameters()] == params
    assert fast.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in fast.state_dict().items())
    assert accelerate(fast) is fast  # again: only the options change


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_evaluation_gives_the_papers_logits(positional: str) -> None:
    paper, fast = pair(positional=positional)
    src, tgt = ragged()
    with torch.no_grad():
        want, got = paper.eval()(src, tgt), fast.eval()(src, tgt)
    real = tgt != PAD_ID
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL)


def test_training_on_the_real_tokens_gives_the_papers_logits_and_gradients(monkeypatch) -> None:
    """In training on the CPU the fast model leaves padding out of the position-wise
    layers (`Packing`): the real positions' logits, and every gradient, are the paper's."""
    monkeypatch.setattr(Packing, "granule", 1)
    paper, fast = pair()
    src, tgt = ragged()
    real = tgt != PAD_ID
    grads = []
    for model in (paper.train(), fast.train()):
        logits = model(src, tgt)
        logits[real].logsumexp(-1).sum().backward()
        grads.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, g0), (got, g1) = grads
    assert fast.packing(tgt) is not None  # the fast path did run
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=ATOL)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("step", ["per layer", "one call"])
@pytest.mark.parametrize("beam", [1, 4])
def test_search_gives_the_papers_translations(beam: int, step: str, monkeypatch) -> None:
    """Decoding: the fast model's compiled cache and grouped attention (per layer), or the
    whole step as one compiled call (`decoder_step`), against the paper's cache and copied
    keys; the same tokens, scores within 1e-4."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "0" if step == "per layer" else "1")
    paper, fast = pair()
    src, _ = ragged(2)
    outs = []
    for model in (paper.eval(), fast.eval()):
        with torch.inference_mode():
            memory, _ = model.encode(src)
            states = model.init_state(memory, 8)
            outs.append(
                (
                    type(states)
                    if isinstance(states, NativeStates)
                    else type(states[0].self_cache),
                    greedy_search(model, src, 1.0, 8)
                    if beam == 1
                    else beam_search(model, src, beam, 0.6, 1.0, 8, nbest=beam),
                )
            )
    (cache0, want), (cache1, got) = outs
    assert cache0 is KVCache
    if cache1 is not (PathKVCache if step == "per layer" else NativeStates):
        pytest.skip("no compiled library here: the fast model decodes with PyTorch ops")
    if beam == 1:  # token lists
        assert sum(map(len, want)) > 10  # something to compare
        assert got == want
        return
    for a, b in zip(want, got, strict=True):  # each sentence's n-best, best first
        assert [h.tokens for h in b] == [h.tokens for h in a]
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-4)
