"""The fast model (aiayn.fast.layers): each speed path against the paper's formulas or the
paper's own module."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from aiayn.config import PAD_ID, PRESETS, ModelConfig
from aiayn.fast import accelerate, cpu_ops, layers, native
from aiayn.fast.attention import scaled_dot_product_attention
from aiayn.fast.caches import PathKVCache, compiled_decoding
from aiayn.fast.cpu_ops import FastDropout
from aiayn.fast.packing import Packing
from aiayn.model import PositionwiseFeedForward, Transformer


def accelerate_module(module: nn.Module) -> nn.Module:
    """One paper module (and its children) swapped for the fast subclasses."""
    for m in module.modules():
        fast = layers.FAST_CLASSES.get(type(m))
        if fast is not None:
            m.__class__ = fast
    return module


SMALL = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=12, P_drop=0.1, vocab_size=50)


def small_model(**changes: object) -> Transformer:
    torch.manual_seed(0)
    return accelerate(Transformer(replace(SMALL, **changes)).double().eval())


def literal_attention(q, k, v, mask=None):
    """Eq. 1 written out: softmax(Q K^T / sqrt(d_k)) V with -inf at illegal connections."""
    d_k = q.shape[-1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d_k)
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf"), dtype=scores.dtype))
    w = torch.exp(scores - scores.amax(-1, keepdim=True))
    w = w / w.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", w, v)


def test_attention_equals_eq1_in_float64():
    """Section 3.2.1, Eq. 1, with a padding mask, in float64."""
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64),
    )
    v = torch.randn(2, 3, 7, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[1, ..., 4:] = False
    causal = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # queries = last 5 keys
    for fused in (True, False):  # PyTorch's kernel and the written-out formula
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, mask, fused=fused),
            literal_attention(q, k, v, mask),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, causal=True, fused=fused),
            literal_attention(q, k, v, causal),
            rtol=1e-12,
            atol=1e-12,
        )
        torch.testing.assert_close(
            scaled_dot_product_attention(q, k, v, mask, causal=True, fused=fused),
            literal_attention(q, k, v, mask & causal),
            rtol=1e-12,
            atol=1e-12,
        )


def _ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sources and targets of different lengths (one sentence unpadded)."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 50, (4, 9), generator=g)
    tgt = torch.randint(4, 50, (4, 7), generator=g)
    for i, (s, t) in enumerate([(9, 3), (4, 7), (6, 1), (2, 5)]):
        src[i, s:], tgt[i, t:] = PAD_ID, PAD_ID
    return src, tgt


@pytest.fixture
def granule_one(monkeypatch):
    """Pack exactly the real tokens (the default rounds their number up to 64 rows)."""
    monkeypatch.setattr(Packing, "granule", 1)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_packed_batch_equals_padded_batch(positional, granule_one):
    """Running the position-wise sublayers on the real tokens only (`Packing`) computes the
    same logits, memory and gradients as running the padded batch; padded rows are zeros."""
    src, tgt = _ragged_batch()
    real = tgt != PAD_ID
    results = {}
    for packed in (False, True):
        m = small_model(positional=positional, P_drop=0.0).train()
        m.pack_padding = packed
        logits = m(src, tgt)
        memory, _ = m.encode(src)
        logits[real].logsumexp(-1).sum().backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        results[packed] = logits.detach(), memory.detach(), grads
    (l0, m0, g0), (l1, m1, g1) = results[False], results[True]
    torch.testing.assert_close(l1[real], l0[real], rtol=0, atol=1e-12)
    assert l1[~real].abs().max() == 0 and l0[~real].abs().max() > 0
    src_real = src != PAD_ID
    torch.testing.assert_close(m1[src_real], m0[src_real], rtol=0, atol=1e-12)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12, msg=name)


def test_packing_is_the_default_for_training_on_the_cpu(granule_one):
    """Packed by default when training on the CPU (padded rows come out as zeros); not in
    evaluation, not for a batch without padding, and not when switched off."""
    m = small_model(P_drop=0.0).train()
    src, tgt = _ragged_batch()
    assert m.packing(tgt) is not None and m.packing(src[:1]) is None
    assert m(src, tgt)[tgt == PAD_ID].abs().max() == 0
    m.eval()
    assert m.packing(tgt) is None and m(src, tgt)[tgt == PAD_ID].abs().max() > 0
    m.train().pack_padding = False
    assert m.packing(tgt) is None and m(src, tgt)[tgt == PAD_ID].abs().max() > 0


def test_packing_rows_round_trip(granule_one):
    """pack picks the real rows in batch order; unpack puts them back, zeros elsewhere."""
    tokens = torch.tensor([[5, 6, PAD_ID], [7, PAD_ID, PAD_ID]])
    p = Packing(tokens)
    x = torch.arange(6.0).view(2, 3, 1)
    assert p.pack(x).flatten().tolist() == [0.0, 1.0, 3.0]
    assert p.unpack(p.pack(x)).flatten().tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]


def test_packed_rows_are_a_multiple_of_the_granule():
    """The real tokens, then the first padded positions needed for a multiple of 64 rows
    (so few product shapes recur); a batch with too little padding is not packed."""
    tokens = torch.full((10, 20), 7)
    lengths = torch.tensor([20, 3, 17, 9, 20, 12, 5, 19, 14, 8])  # 127 real tokens
    tokens[torch.arange(20) >= lengths[:, None]] = PAD_ID
    p = Packing(tokens)
    real = (tokens.flatten() != PAD_ID).nonzero().squeeze(1)
    pads = (tokens.flatten() == PAD_ID).nonzero().squeeze(1)
    assert p.rows.numel() == 128 and p.padded
    assert p.rows.tolist() == sorted(real.tolist() + pads[:1].tolist())
    m = small_model().train()
    assert m.packing(tokens) is not None
    two = torch.full((2, 40), 7)
    two[1, 39] = PAD_ID  # 79 real tokens: 128 rows would be more than the batch's 80
    assert Packing(two).rows.numel() == 80 and m.packing(two) is None


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_rate_scale_and_gradient(p: float):
    """Section 5.4 dropout: each element zeroed with probability P_drop, survivors scaled by
    1/(1 - P_drop), the gradient passing through the same mask; the same seed, the same mask."""
    x = torch.randn(1001, 999, dtype=torch.float64, requires_grad=True)  # odd element count
    d = FastDropout(p).train()
    torch.manual_seed(7)
    y = d(x)
    dropped = y == 0
    n = x.numel()
    assert abs(dropped.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    for half in (dropped.flatten()[: n // 2], dropped.flatten()[n // 2 :]):  # both bit fields
        assert abs(half.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / half.numel())
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p), rtol=1e-12, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (~dropped).double() / (1 - p))
    torch.manual_seed(7)
    assert torch.equal(d(x), y)
    assert torch.equal(d.eval()(x), x)


@pytest.mark.skipif(native.library() is None, reason="no compiled library")
@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_dropout_rate_scale_independence_and_gradient(p: float, dtype: torch.dtype):
    """The compiled masks (`Dropout.compiled`, float32 and bf16 on the CPU): each element
    zeroed with probability P_drop (rounded to 2^-16), in each of the four 16-bit lanes
    one 64-bit draw feeds and for neighbouring elements jointly (p^2: independent), the
    survivors scaled by 1/(1 - P_drop), the gradient through the same mask; the same seed,
    the same mask; another seed, another one."""
    x = torch.randn(1001, 999).to(dtype).requires_grad_()  # odd element count
    d = FastDropout(p).train()
    assert d.compiled
    torch.manual_seed(7)
    y = d(x)
    dropped = (y == 0) & (x != 0)
    n = x.numel()
    rate = round(p * 65536) / 65536

    def near(frac: torch.Tensor, want: float, count: int) -> bool:
        return abs(frac.double().mean().item() - want) < 5 * math.sqrt(want * (1 - want) / count)

    assert near(dropped, rate, n)
    flat = dropped.flatten()
    for lane in range(4):
        assert near(flat[lane::4], rate, n // 4)
    for lag in (1, 2, 3, 4, 999):  # within a draw, across draws, the next row
        assert near(flat[:-lag] & flat[lag:], rate**2, n - lag)
    scale = torch.full((), 1 / (1 - p), dtype=dtype)
    assert torch.equal(y[~dropped], x[~dropped] * scale)
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.where(dropped, 0.0, scale.item()).to(dtype))
    torch.manual_seed(7)
    assert torch.equal(d(x), y)
    assert not torch.equal(d(x), y)  # the generator moved on: a new mask


def test_grouped_cross_attention_equals_attention_to_copies():
    """Beam search keeps the encoder keys/values once per sentence; a sentence's g
    hypotheses attend to them as one block. Same output (and observed weights) as g
    copies of the keys/values, padding mask included."""
    from aiayn.analysis.attention import AttentionObserver

    m = small_model()
    attn = m.decoder[0].cross_attn
    a, g, s = 3, 4, 6
    memory = torch.randn(a, s, m.cfg.d_model, dtype=torch.float64)
    src = torch.randint(4, 50, (a, s))
    src[1, 3:] = PAD_ID
    mask = m.src_mask(src)
    x = torch.randn(a * g, 2, m.cfg.d_model, dtype=torch.float64)
    k, v = attn.project_kv(memory)
    with AttentionObserver(m) as seen:
        grouped = attn(x, mask=mask.repeat_interleave(g, 0), kv=(k, v))
        grouped_w = seen.weights[attn]
        copies = attn(
            x,
            mask=mask.repeat_interleave(g, 0),
            kv=(k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)),
        )
    torch.testing.assert_close(grouped, copies, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grouped_w, seen.weights[attn], rtol=1e-12, atol=1e-12)
    assert grouped_w[g : 2 * g, :, :, 3:].abs().max() == 0  # sentence 1's padding: no weight


def test_path_kv_cache_reordering_equals_reordering_the_prefix():
    """The compiled step's cache keeps each step's projection rows in place and follows a
    path through them: after reorders between steps it holds exactly the rows the reorders
    select (as `KVCache` does by copying), at the widths of the fused projection."""
    h, d_k, d_v = 2, 3, 4
    cache = PathKVCache(h, d_k, d_v, capacity=2)  # grows past two steps
    width = h * (2 * d_k + d_v)
    ref = torch.empty(4, 0, width, dtype=torch.float64)
    for index in ([1, 1, 0, 3], [2, 0], [1, 0, 0]):  # shrinks to 2 rows, then grows to 3
        rows = torch.randn(ref.size(0), width, dtype=torch.float64)
        cache.add(rows)
        ref = torch.cat([ref, rows[:, None]], dim=1)
        k, v = cache.keys_values()
        assert torch.equal(k.transpose(1, 2).flatten(2), ref[..., h * d_k : 2 * h * d_k])
        assert torch.equal(v.transpose(1, 2).flatten(2), ref[..., 2 * h * d_k :])
        cache.reorder(torch.tensor(index))
        ref = ref[index]
    cache.reorder(torch.tensor([2, 0]))  # two reorders before the next step compose
    ref = ref[[2, 0]]
    cache.add(torch.zeros(2, width, dtype=torch.float64))
    assert torch.equal(
        cache.keys_values()[0][:, :, :3],
        ref[..., h * d_k : 2 * h * d_k].unflatten(-1, (h, d_k)).transpose(1, 2),
    )
    assert cache.length == 4
    with pytest.raises(ValueError, match="3 new rows for a cache of 2"):
        cache.add(torch.zeros(3, width, dtype=torch.float64))


def compiled_and_torch_steps(m: Transformer, dtype: torch.dtype, monkeypatch):  # type: ignore[no-untyped-def]
    """Decoding steps with beam-style reorders, run with the compiled attention and with
    PyTorch ops: both logits, per step."""
    m = m.to(dtype)
    src = torch.randint(4, 50, (3, 7))
    src[1, 4:] = PAD_ID
    runs = []
    for compiled in (True, False):
        g = torch.Generator().manual_seed(3)  # the same reorders and tokens both times
        if not compiled:
            monkeypatch.setattr(native, "attention_applies", lambda *a: False)
        with torch.inference_mode():
            memory, mask = m.encode(src)
            states = m.init_state(memory, 4)  # fewer than the steps: the cache grows
            assert isinstance(states[0].self_cache, PathKVCache) == compiled
            rows, tokens, steps = torch.arange(3), torch.full((3, 1), 2), []
            for i in range(6):
                steps.append(m.decode_step(tokens, mask[rows], states))
                # beam-like: 2 hypotheses per sentence from step 1 on, rows re-drawn
                index = (
                    torch.randint(0, len(rows), (6,), generator=g)
                    if i
                    else torch.arange(3).repeat_interleave(2)
                )
                for state in states:
                    state.reorder(index)
                rows, tokens = rows[index], torch.randint(4, 50, (6, 1), generator=g)
        runs.append(steps)
    return runs


@pytest.mark.skipif(native.library() is None, reason="no compiled library")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decoding_steps_equal_pytorch_ops(dtype, monkeypatch):
    """Decoding steps on the CPU (no gradients) attend with the compiled kernels: the same
    logits as PyTorch's ops through reorders, within float32 rounding (bf16: the C code
    rounds once where PyTorch rounds scores and weights to bf16 too)."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")  # the per-layer kernels
    compiled, torch_ops = compiled_and_torch_steps(
        small_model(d_k=8, d_v=8).float(), dtype, monkeypatch
    )
    for a, b in zip(compiled, torch_ops, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:  # logits of ~N(0, 1): bf16's step near 1 is 2^-7
            assert (a.float() - b.float()).abs().max() < 0.1


@pytest.mark.skipif(native.library() is None, reason="no compiled library")
def test_compiled_decoding_steps_can_be_observed():
    """A picture of the weights during a compiled decoding step (`AttentionObserver`, from
    outside the model) reads the compiled cache: the weights the PyTorch ops' cache gives."""
    from aiayn.analysis.attention import AttentionObserver

    m = small_model().float()
    src = torch.randint(4, 50, (2, 5))
    seen_by_cache = []
    for compiled in (True, False):
        with AttentionObserver(m) as seen, torch.inference_mode():
            memory, mask = m.encode(src)
            states = m.init_state(memory, 5) if compiled else paper_states(m, memory)
            assert isinstance(states[0].self_cache, PathKVCache) == compiled
            for t in range(3):
                m.decode_step(torch.full((2, 1), 4 + t), mask, states)
        seen_by_cache.append(seen.weights)
    w = seen_by_cache[0][m.decoder[0].self_attn]
    assert w.shape == (2, 4, 1, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 1))
    assert seen_by_cache[0][m.decoder[0].cross_attn].shape == (2, 4, 1, 5)
    for layer in m.decoder:
        for attn in (layer.self_attn, layer.cross_attn):
            torch.testing.assert_close(seen_by_cache[0][attn], seen_by_cache[1][attn])


def paper_states(m: Transformer, memory: torch.Tensor) -> list:  # type: ignore[type-arg]
    """The paper's decoding states (`KVCache`), for a model that would take the compiled one."""
    return Transformer.init_state(m, memory, 5)


def test_compiled_decoding_only_without_gradients_on_the_cpu():
    x = torch.zeros(2, 3)
    applies = native.attention_applies(torch.float32, 4, 8, 8)
    with torch.no_grad():
        assert compiled_decoding(x, 4, 8, 8) == applies
        assert not compiled_decoding(x.double(), 4, 8, 8)
    assert not compiled_decoding(x, 4, 8, 8)  # gradients on: PyTorch ops


needs_fused_ffn = pytest.mark.skipif(
    not cpu_ops.fused_linear_relu_available(),
    reason="no oneDNN bf16 product with a fused ReLU here",
)


def _ffn_and_grads(ffn: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(3)  # the same relu-dropout masks in both runs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ffn(x)
    # a gradient that is not all ones, so that every element of the backward matters
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [y.detach(), x.grad] + [p.grad.clone() for p in ffn.parameters()]
    ffn.zero_grad(set_to_none=True)
    return grads


@needs_fused_ffn
@pytest.mark.parametrize("relu_dropout", [0.0, 0.2])
def test_fused_ffn_gives_the_unfused_bits(monkeypatch, relu_dropout):
    """The bf16 FFN's one-product bias + ReLU (CPU) changes no bit of the output or of any
    gradient against Linear -> ReLU under autocast, so fusing never changes a run."""
    torch.manual_seed(0)
    ffn = accelerate_module(PositionwiseFeedForward(64, 192, relu_dropout)).train()
    x = torch.randn(5, 11, 64) * 3
    calls = []
    apply = cpu_ops.LinearReLU.apply
    monkeypatch.setattr(cpu_ops.LinearReLU, "apply", lambda *a: calls.append(1) or apply(*a))
    fused = _ffn_and_grads(ffn, x)
    assert calls  # the fused product ran
    monkeypatch.setattr(layers, "fused_linear_relu_available", lambda: False)
    plain = _ffn_and_grads(ffn, x)
    pre = ffn.w_1(x)
    assert (pre < 0).any() and (pre > 0).any()  # the ReLU cuts something
    for a, b in zip(fused, plain, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@needs_fused_ffn
def test_fused_ffn_training_steps_match_the_unfused_ones(monkeypatch):
    """Three Adam steps of a small model in bf16 autocast: every gradient and parameter
    bit-identical (gradients compared too: Adam's first steps hide a rescaled gradient)."""
    from aiayn.training.trainer import make_optimizer

    cfg = replace(
        PRESETS["tiny"].model, N=2, d_model=64, d_ff=128, h=4, d_k=16, d_v=16, vocab_size=50
    )
    src = torch.randint(4, 50, (6, 9))
    tgt = torch.randint(4, 50, (6, 8))
    runs, calls = [], []
    apply = cpu_ops.LinearReLU.apply
    monkeypatch.setattr(cpu_ops.LinearReLU, "apply", lambda *a: calls.append(1) or apply(*a))
    for fused in (True, False):
        if not fused:
            assert len(calls) == 3 * 2 * cfg.N  # every FFN of every step ran fused
            monkeypatch.setattr(layers, "fused_linear_relu_available", lambda: False)
        torch.manual_seed(0)
        m = accelerate(Transformer(cfg)).train()
        opt = make_optimizer(m, PRESETS["tiny"].train)
        tensors = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(src, tgt)
            torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), tgt.flatten()
            ).backward()
            tensors += [p.grad.clone() for p in m.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(tensors + list(m.state_dict().values()))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_cuda_attention_leaves_cudnn_out_and_restores_the_users_settings() -> None:
    """On CUDA, PyTorch's fused attention runs without its cuDNN backend (it plans every
    new shape: docs/performance.md), the flag restored afterwards, even on an error; a
    user who turned cuDNN's attention off keeps it off; CPU tensors change nothing."""
    from types import SimpleNamespace

    from aiayn.fast.attention import NoCudnnAttention

    flags = torch.backends.cuda
    on_cuda = SimpleNamespace(is_cuda=True)  # the only property consulted
    assert flags.cudnn_sdp_enabled()
    flash = flags.flash_sdp_enabled()
    with NoCudnnAttention(on_cuda):  # type: ignore[arg-type]
        assert not flags.cudnn_sdp_enabled() and flags.flash_sdp_enabled() == flash
    assert flags.cudnn_sdp_enabled()
    with pytest.raises(ValueError), NoCudnnAttention(on_cuda):  # type: ignore[arg-type]
        raise ValueError
    assert flags.cudnn_sdp_enabled()
    with NoCudnnAttention(torch.zeros(1)):
        assert flags.cudnn_sdp_enabled()
    flags.enable_cudnn_sdp(False)
    try:
        with NoCudnnAttention(on_cuda):  # type: ignore[arg-type]
            pass
        assert not flags.cudnn_sdp_enabled()
    finally:
        flags.enable_cudnn_sdp(True)
