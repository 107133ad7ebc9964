"""The decoder's step as one compiled call (`aiayn.fast.decoder_step`) against the per-layer
path and the paper's model: the same logits through reorders and dropped sentences, the
same searches, for float32 and int8, post- and pre-norm."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from aiayn.config import EOS_ID, PAD_ID, ModelConfig
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.fast import accelerate, int8_ops, native
from aiayn.fast.decoder_step import MAX_SENTENCES, NativeStates, plan_for
from aiayn.fast.inference import Int8Linear, cast
from aiayn.model import Transformer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(native.library() is None, reason="no compiled library"),
]

CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=60)


def models(dtype: str = "fp32", **changes: object) -> tuple[Transformer, Transformer]:
    """The paper's model (float32, eval) and the fast model in `dtype` with its weights
    ("int8-r7": int8 with 7-bit activations, AIAYN_INT8_ACTIVATIONS=7). The output layer
    is scaled up so that the next-token distributions are peaked: a random model's
    near-ties would make token identity a matter of the last bit."""
    torch.manual_seed(0)
    paper = Transformer(replace(CFG, **changes)).eval()
    with torch.no_grad():
        paper.generator.weight.mul_(4.0)
    fast = cast(accelerate(copy.deepcopy(paper)), dtype.removesuffix("-r7")).eval()
    if dtype == "int8-r7":
        for m in fast.modules():
            if isinstance(m, Int8Linear):
                m.act_bits = 7
    return paper, fast


def sources(seed: int = 1, n: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 60, (n, 11), generator=g)
    for i in range(n):
        s = 3 + (i * 5) % 9
        src[i, s - 1], src[i, s:] = EOS_ID, PAD_ID
    return src


def steps(model: Transformer, src: torch.Tensor, native_step: bool, monkeypatch) -> list:
    """Logits of six steps of a search-like walk: rows repeated (a beam of 2), reordered
    every step, and a sentence dropped after step 3."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1" if native_step else "0")
    out = []
    with torch.inference_mode():
        memory, mask = model.encode(src)
        states = model.init_state(memory, 4)  # capacity 4 < 6 steps: the tables grow
        assert isinstance(states, NativeStates) == native_step
        a = src.size(0)
        rows = torch.arange(a).repeat_interleave(2)  # 2 rows a sentence
        mask = mask.index_select(0, rows)
        for s in states:
            s.reorder(rows)
        tokens = torch.full((2 * a, 1), 1, dtype=torch.long)
        g = torch.Generator().manual_seed(5)
        for t in range(6):
            logits = model.decode_step(tokens, mask, states)
            out.append(logits.float().clone())
            r = tokens.size(0)
            keep = torch.arange(r)
            sentences = None
            if t == 3:  # the first sentence is done: its two rows go
                keep, sentences = keep[2:], torch.arange(1, r // 2)
            # each pair of rows swaps or repeats its first row, as beams do
            pair = keep.view(-1, 2)
            swap = torch.randint(0, 3, (pair.size(0),), generator=g)
            first, second = pair[:, 0], pair[:, 1]
            index = torch.stack(
                [
                    torch.where(swap == 1, second, first),
                    torch.where(swap == 0, second, first),
                ],
                dim=1,
            ).reshape(-1)
            for s in states:
                s.reorder(index, sentences)
            mask = mask.index_select(0, index)
            tokens = logits.index_select(0, index).argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("d_v", [8, 16])
def test_float32_steps_equal_the_per_layer_path(norm: str, d_v: int, monkeypatch) -> None:
    _, fast = models(norm=norm, d_v=d_v)
    src = sources()
    one_call = steps(fast, src, True, monkeypatch)
    per_layer = steps(fast, src, False, monkeypatch)
    assert len(one_call) == 6
    for a, b in zip(one_call, per_layer, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "int8-r7"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_int8_steps_equal_the_per_layer_path(dtype: str, norm: str, monkeypatch) -> None:
    """The int8 layers' arithmetic is the same C code in both paths; LayerNorm sums in
    another order, and where that moves an activation across a rounding boundary of its
    row's quantization one product changes by a step: a few logits by ~1e-3 at most."""
    _, fast = models(dtype, norm=norm)
    assert any(isinstance(m, Int8Linear) and m._r7 for m in fast.modules()) == (dtype == "int8-r7")
    src = sources()
    one_call = steps(fast, src, True, monkeypatch)
    per_layer = steps(fast, src, False, monkeypatch)
    for a, b in zip(one_call, per_layer, strict=True):
        diff = (a - b).abs()
        assert diff.max() < 5e-2
        assert (diff > 1e-4).float().mean() < 0.05


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int8-r7"])
@pytest.mark.parametrize("beam", [1, 4])
def test_searches_give_the_papers_translations(dtype: str, beam: int, monkeypatch) -> None:
    """Greedy and beam search (n-best) with the one-call step: the tokens of the paper's
    model (fp32) and of the per-layer int8 path (int8), scores within 1e-4 (fp32) and 1e-2
    (int8, against its per-layer path)."""
    paper, fast = models(dtype)
    src = sources(n=6)

    def search(model: Transformer) -> list:
        with torch.inference_mode():
            if beam == 1:
                return greedy_search(model, src, 1.0, 8)
            return beam_search(model, src, beam, 0.6, 1.0, 8, nbest=beam)

    monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")
    want = search(paper if dtype == "fp32" else fast)
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    got = search(fast)
    if beam == 1:
        assert sum(map(len, want)) > 10 and got == want
        return
    tol = 1e-4 if dtype == "fp32" else 1e-2
    for a, b in zip(want, got, strict=True):
        assert [h.tokens for h in b] == [h.tokens for h in a]
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=tol)


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int8-r7"])
def test_a_sentence_alone_steps_as_in_a_batch(dtype: str, monkeypatch) -> None:
    """Each row is computed on its own: given the same encoder output, a sentence's logits
    alone are its logits in a batch, bit for bit."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    _, fast = models(dtype)
    src = sources(n=4)

    def walk(memory: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        states = fast.init_state(memory, 8)
        tokens = torch.full((memory.size(0), 1), 1, dtype=torch.long)
        out = []
        for _ in range(4):
            logits = fast.decode_step(tokens, mask, states)
            out.append(logits)
            tokens = logits.argmax(-1, keepdim=True)
        return out

    with torch.inference_mode():
        memory, mask = fast.encode(src)
        together = walk(memory, mask)
        for i in range(src.size(0)):
            alone = walk(memory[i : i + 1], mask[i : i + 1])
            assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, together, strict=True))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_where_the_one_call_step_applies(monkeypatch) -> None:
    monkeypatch.delenv("AIAYN_NATIVE_STEP", raising=False)
    paper, fast = models()
    with torch.inference_mode():
        assert plan_for(fast, 1) is not None
        assert plan_for(fast, MAX_SENTENCES + 1) is None  # large float32 batches: MKL's
        _, int8 = models("int8")
        assert plan_for(int8, MAX_SENTENCES + 1) is not None  # int8 on one thread: always
        with torch_threads(2):  # on two: where aiayn's kernel multiplies (no VNNI)
            monkeypatch.setattr(int8_ops, "backend", lambda: "aiayn")
            assert plan_for(int8, MAX_SENTENCES + 1) is not None
            assert plan_for(fast, MAX_SENTENCES + 1) is None
            monkeypatch.setattr(int8_ops, "backend", lambda: "torch")  # PyTorch's VNNI
            assert plan_for(int8, MAX_SENTENCES + 1) is None
            assert plan_for(int8, MAX_SENTENCES) is not None
        memory, _ = fast.encode(sources(n=1))
        assert isinstance(fast.init_state(memory, 4), NativeStates)
        assert not isinstance(paper.init_state(memory, 4), NativeStates)  # the paper's own

        class OwnStep(type(fast)):  # type: ignore[misc]
            def decode_step(self, tokens, src_mask, states):  # type: ignore[no-untyped-def]
                return super().decode_step(tokens, src_mask, states)

        fast.__class__ = OwnStep  # a subclass's decoding step is what it says: not compiled
        assert not isinstance(fast.init_state(memory, 4), NativeStates)
        fast.__class__ = OwnStep.__mro__[1]
        monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")
        assert plan_for(fast, 1) is None
        monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
        assert plan_for(fast, 10_000) is not None
        _, bf16 = models("bf16")
        assert plan_for(bf16, 1) is None  # bf16 takes the per-layer path
        handle = fast.decoder[0].register_forward_hook(lambda *a: None)
        assert plan_for(fast, 1) is None  # someone watches the modules (attention pictures)
        handle.remove()
    assert plan_for(fast, 1) is None  # gradients on: not decoding


def test_a_plan_follows_weights_written_in_place(monkeypatch) -> None:
    """The plan points into the weights; weights written in place (load_state_dict) make a
    new one, so the step never reads stale int8 copies."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    _, fast = models("int8")
    src = sources(n=2)
    with torch.inference_mode():
        first = plan_for(fast, 1)
        assert plan_for(fast, 1) is first
        before = beam_search(fast, src, 2, 0.6, 1.0, 6)
        other = Transformer(CFG).eval()
        fast.load_state_dict(cast(accelerate(other), "int8").state_dict())
        assert plan_for(fast, 1) is not first
        monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")
        want = beam_search(fast, src, 2, 0.6, 1.0, 6)
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    with torch.inference_mode():
        got = beam_search(fast, src, 2, 0.6, 1.0, 6)
    assert (
        [h[0].tokens for h in got] == [h[0].tokens for h in want] != [h[0].tokens for h in before]
    )


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_one_call_encoder_and_memory_keys_are_the_per_layer_paths(norm, monkeypatch) -> None:
    """`encode` in one C call (padded batch, post- and pre-LN) equals the PyTorch path at
    every real position to float32 rounding, and the encoder-decoder keys and values of
    `DecoderPlan.memory_kv` equal `project_kv`'s; in int8 the products are the same C
    code, so the outputs differ only where a value rounds to the neighbouring step."""
    src = sources(n=5)
    for dtype, tol in (("fp32", 1e-5), ("int8", 0.1)):
        paper, fast = models(dtype, norm=norm)
        with torch.inference_mode():
            monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")
            want, mask = fast.encode(src)
            ref, _ = paper.encode(src)
            monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
            got, got_mask = fast.encode(src)
            plan = plan_for(fast, src.size(0))
            assert plan is not None
            kv = plan.memory_kv(want)
        assert torch.equal(got_mask, mask)
        real = mask[:, 0, 0, :, None]
        err = ((got - want).abs() * real).max().item()
        assert err <= tol, (dtype, err)
        if dtype == "int8":  # no further from the paper's float32 model than PyTorch's
            n = real.sum().item()
            c_err = ((got - ref).abs() * real).sum().item() / n
            torch_err = ((want - ref).abs() * real).sum().item() / n
            assert c_err <= 1.1 * torch_err
        for layer, (k, v) in zip(fast.decoder, kv, strict=True):
            k_want, v_want = layer.cross_attn.project_kv(want)
            assert torch.allclose(k, k_want, atol=1e-5) and torch.allclose(v, v_want, atol=1e-5)


def test_a_step_of_fused_adam_between_searches_is_seen(monkeypatch) -> None:
    """Fused Adam writes the weights in place without bumping their version counters, so
    a plan cannot notice it: the one call must read trainable float32 weights live (as a
    validation decode between training steps does), never a stale packed copy."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    _, fast = models()
    fast.requires_grad_(True)  # trainable, as in training (inference.cast turns it off)
    src = sources(n=2)
    with torch.inference_mode():
        before = beam_search(fast, src, 2, 0.6, 1.0, 6)
    opt = torch.optim.Adam(fast.parameters(), lr=0.5, fused=True)
    for p in fast.parameters():
        p.grad = torch.randn_like(p)
    versions = [p._version for p in fast.parameters()]
    opt.step()
    assert [p._version for p in fast.parameters()] == versions  # the hazard itself
    with torch.inference_mode():
        got = beam_search(fast, src, 2, 0.6, 1.0, 6)
        monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")
        want = beam_search(fast, src, 2, 0.6, 1.0, 6)
    tokens = [[h.tokens for h in hs] for hs in got]
    assert tokens == [[h.tokens for h in hs] for hs in want]
    assert tokens != [[h.tokens for h in hs] for hs in before]


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int8-r7"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_the_compiled_search_is_the_python_search(dtype: str, norm: str, monkeypatch) -> None:
    """The whole search in C (csrc/beam_search.c) against search.py's loop over the same
    compiled step: the same hypotheses, scores and log-probabilities to the bit, over
    beams of 1-5, with and without a length penalty and a minimum length, caps that cut
    hypotheses off, n-best lists of the whole beam, and sentences ending at different steps."""
    from aiayn import speed

    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    _, fast = models(dtype, norm=norm)
    src = sources(seed=3, n=7)
    hook = speed.IMPLEMENTATIONS["whole_search"]
    calls = []

    def counted(*a):
        found = hook(*a)
        calls.append(found is not None)
        return found

    def run(beam: int, alpha: float, min_len: int, b: int) -> list:
        with torch.inference_mode():
            if beam == 1:
                return greedy_search(fast, src, 1.0, b, min_len=min_len)
            return beam_search(fast, src, beam, alpha, 1.0, b, nbest=beam, min_len=min_len)

    cases = [
        (1, 0.0, 0, 8),
        (1, 0.0, 3, 5),
        (2, 0.6, 0, 8),
        (4, 0.6, 3, 8),
        (5, 0.0, 0, 3),
        (4, 1.0, 0, 20),
    ]
    for beam, alpha, min_len, b in cases:
        monkeypatch.setitem(speed.IMPLEMENTATIONS, "whole_search", counted)
        got = run(beam, alpha, min_len, b)
        monkeypatch.delitem(speed.IMPLEMENTATIONS, "whole_search")
        want = run(beam, alpha, min_len, b)
        assert calls.pop() is True  # the C search ran
        if beam == 1:
            assert got == want and sum(map(len, want)) > 10
            continue
        assert [[(h.tokens, h.score, h.log_prob) for h in x] for x in got] == [
            [(h.tokens, h.score, h.log_prob) for h in x] for x in want
        ]
        assert sum(len(x) for x in want) == beam * len(want)  # whole n-best lists compared


def test_the_compiled_search_declines_what_it_cannot_do(monkeypatch) -> None:
    """Fewer tokens to choose from than the beam, a state already stepped or one that
    already served a search: None, and the search runs in Python."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    _, fast = models("fp32", vocab_size=6)
    src = sources(n=2).clamp(max=5)
    with torch.inference_mode():
        memory, mask = fast.encode(src)
        states = fast.init_state(memory, 10)
        assert isinstance(states, NativeStates)
        # before min_len: 6 tokens - PAD, BOS and EOS = 3 < 4
        assert states.search(mask, [5, 5], 4, 0.6, 1) is None
        assert states.search(mask, [5, 5], 4, 0.6, 0) is not None
        assert states.search(mask, [5, 5], 4, 0.6, 0) is None  # spent: its K/V were moved
        with pytest.raises(ValueError, match="whole search"):
            fast.decode_step(torch.full((2, 1), 2, dtype=torch.long), mask, states)
        stepped = fast.init_state(memory, 10)
        fast.decode_step(torch.full((2, 1), 1, dtype=torch.long), mask, stepped)
        assert stepped.search(mask, [5, 5], 2, 0.6, 0) is None
        hyps = beam_search(fast, src, 4, 0.6, 1.0, 4, nbest=2, min_len=1)
    assert [len(h) for h in hyps] == [2, 2]
