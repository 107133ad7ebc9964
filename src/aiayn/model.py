"""The Transformer (section 3 of "Attention Is All You Need"), in the paper's order.

Shape letters used in comments:
    B batch, S source length, T target length, D d_model, H heads (h),
    K d_k, Vd d_v, F d_ff, V vocabulary size.

Mask convention (one, everywhere): boolean tensors, True = "may attend".
Everything is batch-first. Token id 0 is padding (config.PAD_ID).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import kernels, native
from aiayn.config import PAD_ID, ModelConfig


# --------------------------------------------------------------------------- padding
class Packing:
    """Where the real (non-pad) tokens of a right-padded (B, T) batch are: rows of its
    (B*T, ...) view.

    Every sublayer but attention itself works on each position alone (section 3.3: the
    projections, the FFN, residuals, LayerNorm, dropout), so when training on the CPU the
    model runs them on the N real rows only (N, D), and lays rows out as (B, T, .) just
    for the attention products, whose masks already keep padding out of every real
    position's result. Padding is ~12% of the target side of the recipe's length-bucketed
    batches, and 12.5% of the benchmark's (issue 5): work that was computed and thrown
    away. Zeros stand at the padded positions left out; no real row sees them.

    The rows are the real tokens plus the first few padded positions that make their
    number a multiple of `granule`: each product shape is a oneDNN kernel compiled and
    cached once (bf16), and a count that changed with every batch would make new ones
    every step; padded positions are harmless to compute, as before.
    """

    granule = 64

    def __init__(self, tokens: Tensor) -> None:
        self.batch, self.length = tokens.shape
        keep = tokens.flatten() != PAD_ID
        extra = -int(keep.sum()) % self.granule
        if extra:
            keep[(~keep).nonzero()[:extra]] = True
        self.rows = keep.nonzero().squeeze(1)

    @property
    def padded(self) -> bool:
        return self.rows.numel() < self.batch * self.length

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (N, C), the rows kept."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.rows)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B, T, C), zeros at the padding left out."""
        out = x.new_zeros(self.batch * self.length, x.size(-1))
        return out.index_copy_(0, self.rows, x).view(self.batch, self.length, -1)


# --------------------------------------------------------------------------- 5.4
class Dropout(nn.Module):
    """Dropout (section 5.4): zero each element with probability p, scale the rest by 1/(1-p).

    On CPU, PyTorch's dropout draws one random number per element through a slow path
    (bernoulli_: ~15% of a base training step). Here, with `compiled` (the default), the
    mask comes from a counter-based generator in C seeded from PyTorch's generator
    (`native.dropout_multiplier`: p applied to within 2^-16; a (4,416, 512) dropout's
    forward and backward 2-3x faster than the next way at two threads); without it, or
    without the compiled library, each 31-bit integer from PyTorch's generator gives two
    16-bit (resp. 15-bit) uniform draws (p within 2^-15: 0.1 -> 0.100006; 2.3x
    `F.dropout`'s speed). Either way `torch.manual_seed` decides the masks. Elsewhere
    (CUDA) it is PyTorch's own dropout.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        #: draw CPU masks with the compiled generator (`Transformer.use_cpu_kernels`)
        self.compiled = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        if self.compiled and not torch.compiler.is_compiling():
            multiplier = native.dropout_multiplier(x, self.p)
            if multiplier is not None:
                return x * multiplier
        keep = cpu_keep_mask(x.shape, self.p)
        scale = torch.full((), 1.0 / (1.0 - self.p), dtype=x.dtype)
        # 0 or scale, the same values as where(keep, scale, 0): converting the mask's bytes
        # (a uint8 view) took ~0.1 ms for 0.5M elements where where() took ~4.5 ms (one
        # thread; no whole-step change was measurable through this VM's noise).
        return x * keep.view(torch.uint8).to(x.dtype).mul_(scale)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def cpu_keep_mask(shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """Boolean mask of `shape`, True with probability 1 - p (p rounded to 2^-16 / 2^-15)."""
    n = math.prod(shape)
    r = torch.empty((n + 1) // 2, dtype=torch.int32).random_()  # uniform in [0, 2^31)
    keep = torch.empty(2, r.numel(), dtype=torch.bool)
    torch.ge(r & 0xFFFF, round(p * 65536), out=keep[0])  # the low 16 random bits
    torch.ge(r, round(p * 32768) << 16, out=keep[1])  # the high 15: r >> 16 >= t
    return keep.view(-1)[:n].view(shape)


# --------------------------------------------------------------------------- 3.2.1
# Scaled dot-product attention, Eq. 1: softmax(Q K^T / sqrt(d_k)) V


class _NoCudnnAttention:
    """PyTorch's fused attention on CUDA without its cuDNN backend, the others as the user
    left them.

    cuDNN plans each new shape on first use, and translation's batches come in many
    (lengths vary from batch to batch, and from step to step in a search): on an H100 the
    Multi30k recipe's first 150 training steps took ~50 s with it (0.3 s a step) and ~7 s
    without, and later steps 43 ms against 38 (docs/performance.md, "cuDNN's attention
    and changing shapes"). Flash and memory-efficient attention compute the same
    formula. A flag flipped and restored (~0.3 us), not `sdpa_kernel` (~14 us a call, and
    it would re-enable backends the user turned off); left alone while torch.compile
    traces.
    """

    def __init__(self, q: Tensor) -> None:
        self.active = (q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()
                       and not torch.compiler.is_compiling())

    def __enter__(self) -> None:
        if self.active:
            torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc: object) -> None:
        if self.active:
            torch.backends.cuda.enable_cudnn_sdp(True)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
    causal: bool = False, dropout_p: float = 0.0, fused: bool | None = None,
) -> Tensor:
    """Eq. 1, softmax(Q K^T / sqrt(d_k)) V, with illegal connections set to -inf first.

    Three exact implementations of the same formula: PyTorch's fused kernels (flash,
    memory-efficient attention; not cuDNN's on CUDA: `_NoCudnnAttention`), aiayn's own
    Triton kernel for short sequences on CUDA (`aiayn.kernels`: at translation's sentence
    lengths PyTorch's kernels mostly compute padding of their tiles), and the formula
    written out as two matrix products and a softmax, which on CPU is 2-4x faster to train
    through in bf16 (the fused CPU kernel's backward is slow for short sequences).
    `fused=None` picks by device and shape: the written-out formula on CPU; on CUDA the
    Triton kernel where it applies and measured faster (`kernels.preferred`: training in
    bf16 on large batches, both lengths <= 64, a key-padding mask, no attention dropout),
    else PyTorch's. `fused=True` forces PyTorch's.
    All are tested against a float64 transcription of Eq. 1.

    Args:
        q: (B, H, Tq, K) queries. k: (B, H, Tk, K) keys. v: (B, H, Tk, Vd) values.
        mask: boolean, broadcastable to (B, H, Tq, Tk), True = may attend. Illegal
            connections get -inf before the softmax (section 3.2.3).
        causal: also forbid attending to later positions (decoder self-attention); the
            queries are the last Tq of the Tk positions.
        dropout_p: dropout on the attention weights (0 in the paper).
    Returns:
        (B, H, Tq, Vd).
    """
    if fused is None:
        if q.device.type == "cpu":
            fused = False
        elif kernels.preferred(q, k, v, mask, causal, dropout_p):
            return kernels.attention(q, k, v, mask, causal)
        else:
            fused = True
    if fused:
        # is_causal aligns the mask top-left; with a cache (Tq < Tk) it must align bottom-right.
        if causal and (mask is not None or q.size(2) != k.size(2)):
            tri = _causal_mask(q.size(2), k.size(2), q.device)
            mask, causal = (tri if mask is None else mask & tri), False
        with _NoCudnnAttention(q):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=dropout_p, is_causal=causal)
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.size(-1) ** -0.5)  # (B, H, Tq, Tk)
    if causal:
        scores.masked_fill_(~_causal_mask(q.size(2), k.size(2), q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


def _causal_mask(tq: int, tk: int, device: torch.device) -> Tensor:
    """(Tq, Tk), True = may attend: query i (the last of Tk keys aligned) sees keys <= i."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=tk - tq)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """The softmax of Eq. 1 itself, for analysis and pictures: (B, H, Tq, Tk)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


# --------------------------------------------------------------------------- 3.2.2
class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O (section 3.2.2),
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections are stored as one matrix each (W^Q: D x h*K, ...); for
    self-attention Q, K and V come from one fused matrix, which is the same parameters laid
    side by side and one matrix product instead of three. No biases: the paper's formula has
    none (tensor2tensor agrees).
    """

    def __init__(self, d_model: int, h: int, d_k: int, d_v: int, *, self_attention: bool,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.h, self.d_k, self.d_v, self.dropout = h, d_k, d_v, dropout
        self.self_attention = self_attention
        if self_attention:
            self.w_qkv = nn.Linear(d_model, h * (2 * d_k + d_v), bias=False)
        else:
            self.w_q = nn.Linear(d_model, h * d_k, bias=False)
            self.w_kv = nn.Linear(d_model, h * (d_k + d_v), bias=False)
        self.w_o = nn.Linear(h * d_v, d_model, bias=False)
        self.record_weights = False  # set to keep the last attention weights (for pictures)
        self.last_weights: Tensor | None = None

    def _split(self, x: Tensor, d: int) -> Tensor:
        # (B, T, H*d) -> (B, H, T, d)
        return x.unflatten(-1, (self.h, d)).transpose(1, 2)

    def project_kv(self, memory: Tensor, packing: Packing | None = None
                   ) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output, computed once per sentence when decoding.

        memory: (B, S, D), or its real rows (N, D) with their `packing`.
        """
        kv = self.w_kv(memory)
        if packing is not None:
            kv = packing.unpack(kv)
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self._split(k, self.d_k), self._split(v, self.d_v)

    def forward(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
                *, causal: bool = False, kv: tuple[Tensor, Tensor] | None = None,
                cache: KVCache | None = None, packing: Packing | None = None,
                memory_packing: Packing | None = None) -> Tensor:
        """Attend from x (B, Tq, D) to itself, or to `memory` (B, Tk, D) / precomputed `kv`.

        `cache` (self-attention, incremental decoding): the new keys/values are appended to
        it and attention covers everything cached so far. `packing` / `memory_packing`:
        x / memory are the real rows (N, D) of a padded batch (`Packing`); so is the result.
        """
        if self.self_attention:
            qkv = self.w_qkv(x)
            if isinstance(cache, PathKVCache):  # a decoding step on the CPU: compiled Eq. 1
                rows = qkv.squeeze(1)  # (B, H*(2K+Vd)): one new position per row
                cache.add(rows)
                if not self.record_weights:
                    return self.w_o(cache.attend(rows[:, :self.h * self.d_k]).unsqueeze(1))
            if packing is not None:
                qkv = packing.unpack(qkv)
            q, k, v = qkv.split(
                [self.h * self.d_k, self.h * self.d_k, self.h * self.d_v], dim=-1)
            q, k, v = self._split(q, self.d_k), self._split(k, self.d_k), self._split(v, self.d_v)
            if cache is not None:  # (for a picture of the weights, PyTorch ops read `PathKVCache`)
                k, v = cache.keys_values() if isinstance(cache, PathKVCache) else cache.append(k, v)
                causal = causal and q.size(2) > 1  # a single new query may see all the past
        else:
            q = self.w_q(x)
            if (kv is not None and mask is not None and q.size(1) == 1 and not self.record_weights
                    and compiled_decoding(q, self.h, self.d_k, self.d_v)):
                # a decoding step on the CPU: compiled Eq. 1 over each sentence's keys/values
                out = native.memory_attention(q.squeeze(1), *kv, mask.flatten(1).contiguous())
                if out is not None:
                    return self.w_o(out.unsqueeze(1))
            q = self._split(q if packing is None else packing.unpack(q), self.d_k)
            k, v = kv if kv is not None else \
                self.project_kv(memory, memory_packing)  # type: ignore[arg-type]
            if k.size(0) != q.size(0):
                return self.w_o(self._attend_grouped(q, k, v, mask))
        if self.record_weights:
            m = mask
            if causal:
                tri = _causal_mask(q.size(2), k.size(2), q.device)
                m = tri if m is None else m & tri
            self.last_weights = attention_weights(q, k, m).detach()
        p = self.dropout if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, mask, causal=causal, dropout_p=p)
        # (B, H, Tq, Vd) -> (B, Tq, H*Vd)
        out = out.transpose(1, 2).flatten(2)
        return self.w_o(out if packing is None else packing.pack(out))

    def _attend_grouped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Beam search: the g = B / A hypotheses of each of A sentences attend to that
        sentence's keys/values (A, H, S, K), kept once per sentence instead of g copies.

        The g queries become one block of g*Tq queries (Eq. 1 treats each query row on its
        own), so the products are A*H blocks of g rows instead of B*H single rows.
        q: (B, H, Tq, K) with B = A*g, sentence-major; mask: (B, 1, 1, S). -> (B, Tq, H*Vd).
        """
        b, h, tq, d_k = q.shape
        a = k.size(0)
        g = b // a
        if g * a != b:
            raise ValueError(f"{b} query rows do not split into groups over {a} sentences")
        q = q.view(a, g, h, tq, d_k).transpose(1, 2).reshape(a, h, g * tq, d_k)
        if mask is not None:
            mask = mask[::g]  # the rows of one sentence share its source mask
        if self.record_weights:
            self.last_weights = attention_weights(q, k, mask).detach().view(
                a, h, g, tq, -1).transpose(1, 2).reshape(b, h, tq, -1)
        out = scaled_dot_product_attention(q, k, v, mask)  # (A, H, g*Tq, Vd); eval only
        return out.view(a, h, g, tq, self.d_v).permute(0, 2, 3, 1, 4).reshape(b, tq, h * self.d_v)


class KVCache:
    """Self-attention keys and values of the tokens decoded so far: (B, H, t, K), contiguous.

    Contiguous because on the CPU a bf16 matrix product first copies any other layout (a
    slice of a preallocated max-length buffer included), and a beam reordering copies the
    cache anyway. So each step writes the cache once, into a new buffer one position
    longer: the pending reordering is gathered straight into it (no extra pass), then the
    new keys/values go at the end.
    """

    def __init__(self, batch: int, h: int, d_k: int, d_v: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.k = torch.empty(batch, h, 0, d_k, device=device, dtype=dtype)
        self.v = torch.empty(batch, h, 0, d_v, device=device, dtype=dtype)
        self._index: Tensor | None = None  # rows to keep, not yet applied

    @property
    def length(self) -> int:
        return self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k, self.v = self._grow(self.k, k), self._grow(self.v, v)
        self._index = None
        return self.k, self.v

    def _grow(self, old: Tensor, new: Tensor) -> Tensor:
        t = old.size(2)
        out = new.new_empty(new.size(0), new.size(1), t + new.size(2), new.size(3))
        if self._index is None:
            out[:, :, :t] = old
        else:
            torch.index_select(old, 0, self._index, out=out[:, :, :t])
        out[:, :, t:] = new
        return out

    def reorder(self, index: Tensor) -> None:
        """Keep the rows `index` (beam search reordering); applied at the next append."""
        self._index = index if self._index is None else self._index.index_select(0, index)


def compiled_decoding(x: Tensor, h: int, d_k: int, d_v: int) -> bool:
    """Whether a decoding step on `x` attends with the compiled kernels (`native`): on the
    CPU, without gradients (they have no backward), for float32 and bf16."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled()
            and native.attention_applies(x.dtype, h, d_k, d_v))


class PathKVCache:
    """Self-attention keys and values for the compiled decoding step
    (`native.cached_attention`): each step's fused projection output (B, H*(2K+Vd)) stays
    where it was written, and `path` (B, steps) says which row of each step's table holds
    a hypothesis's key and value. A beam reordering permutes `path`, 8 bytes a row and
    step, where `KVCache` copies the whole cache.
    """

    def __init__(self, h: int, d_k: int, d_v: int, capacity: int = 64) -> None:
        self.h, self.d_k, self.d_v = h, d_k, d_v
        self.tables: list[Tensor] = []  # step i's projection output, (B_i, H*(2K+Vd))
        self.addresses = torch.empty(max(1, capacity), dtype=torch.int64)  # of the tables
        self.path: Tensor | None = None  # (B, capacity) int64
        self._index: Tensor | None = None  # rows to keep, not yet applied

    @property
    def length(self) -> int:
        return len(self.tables)

    def add(self, rows: Tensor) -> None:
        """The newest position: row i of `rows` belongs to hypothesis row i."""
        t, b = len(self.tables), rows.size(0)
        if rows.stride(1) != 1 or rows.size(1) != self.h * (2 * self.d_k + self.d_v):
            raise ValueError(f"expected rows of the fused projection, got {tuple(rows.shape)}")
        if t == self.addresses.numel():  # more steps than planned: twice the room
            self.addresses = torch.cat([self.addresses, torch.empty_like(self.addresses)])
            if self.path is not None:
                self.path = torch.cat([self.path, torch.empty_like(self.path)], dim=1)
        if self.path is None:
            self.path = torch.empty(b, self.addresses.numel(), dtype=torch.int64)
        elif self._index is not None:
            self.path = self.path.index_select(0, self._index)
        if self.path.size(0) != b:
            raise ValueError(f"{b} new rows for a cache of {self.path.size(0)}")
        self.path[:, t] = torch.arange(b)
        self.tables.append(rows)
        self.addresses[t] = rows.data_ptr()
        self._index = None

    def attend(self, q: Tensor) -> Tensor:
        """Eq. 1 for the newest query of each row, q (B, H*K), over all its positions:
        (B, H*Vd)."""
        hk = self.h * self.d_k
        return native.cached_attention(
            q, self.addresses[:self.length], self.tables[-1].stride(0), hk, 2 * hk,
            self.path, self.h, self.d_k, self.d_v)  # type: ignore[arg-type]

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """The cached keys and values as `KVCache` holds them, (B, H, t, K) and
        (B, H, t, Vd), for PyTorch ops (a picture of the attention weights)."""
        assert self.path is not None
        hk = self.h * self.d_k
        rows = torch.stack([table.index_select(0, self.path[:, i])
                            for i, table in enumerate(self.tables)], dim=1)  # (B, t, .)
        k = rows[..., hk:2 * hk].unflatten(-1, (self.h, self.d_k)).transpose(1, 2)
        v = rows[..., 2 * hk:].unflatten(-1, (self.h, self.d_v)).transpose(1, 2)
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Keep the rows `index` (beam search reordering); applied at the next `add`."""
        self._index = index if self._index is None else self._index.index_select(0, index)


# --------------------------------------------------------------------------- 3.3
class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2).

    Under bf16 autocast on the CPU, max(0, x W1 + b1) is one oneDNN product with the bias
    and the ReLU applied to its accumulator (`_LinearReLU`): the same bits as the three
    steps, without two passes over the (tokens, d_ff) activation, the largest of the
    model (the product itself 1.6x faster; ~2% of a base training step: docs/performance.md).
    """

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float = 0.0) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.relu_dropout = Dropout(relu_dropout)

    def forward(self, x: Tensor) -> Tensor:
        # Not under torch.compile: inductor could not lower this op (a LoweringException
        # in bf16 training); it generates its own code for the bias and ReLU.
        if (x.device.type == "cpu" and not torch.compiler.is_compiling()
                and torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16
                and type(self.w_1) is nn.Linear and fused_linear_relu_available()):
            bf16 = torch.bfloat16
            hidden = _LinearReLU.apply(x.to(bf16), self.w_1.weight.to(bf16),
                                       self.w_1.bias.to(bf16))
        elif (fused := getattr(self.w_1, "forward_relu", None)) is not None:
            hidden = fused(x)  # int8 decoding (translate.Int8Linear): ReLU while dequantizing
        else:
            hidden = torch.relu(self.w_1(x))
        return self.w_2(self.relu_dropout(hidden))


class _LinearReLU(torch.autograd.Function):
    """max(0, x W^T + b) for bf16 CPU tensors in one oneDNN product; the backward is the
    one autograd would run for relu(linear(x, W, b)) (same operations, same bits)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu", [None], "")
        ctx.save_for_backward(x, weight, out)  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, weight, out = ctx.saved_tensors  # type: ignore[attr-defined]
        grad = torch.ops.aten.threshold_backward(grad, out, 0)  # ReLU's backward
        g = grad.reshape(-1, grad.size(-1))
        grad_x = (g @ weight).view(x.shape)
        return grad_x, g.t() @ x.reshape(-1, x.size(-1)), g.sum(0)


def onednn_bf16() -> bool:
    """Whether this PyTorch build has oneDNN and this CPU runs its bf16 kernels (AVX-512
    or AMX): the condition for the oneDNN ops used directly here and in `translate`."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def fused_linear_relu_available() -> bool:
    """Whether oneDNN's fused bf16 product + bias + ReLU exists here and gives exactly
    relu(linear(x, W, b)) on a probe product (on the AMX CPUs we measure on it equalled
    it on every shape tried; where the probe differs, the FFN keeps the unfused steps)."""
    if not onednn_bf16():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*shape, generator=gen).to(torch.bfloat16)
                   for shape in ((37, 64), (96, 64), (96,)))
        with torch.no_grad():
            fused = torch.ops.mkldnn._linear_pointwise(x, w, b, "relu", [None], "")
            return bool(torch.equal(fused, torch.relu(F.linear(x, w, b))))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# --------------------------------------------------------------------------- 3.1
class EncoderLayer(nn.Module):
    """Self-attention then FFN, each as LayerNorm(x + Dropout(Sublayer(x))) (post-norm)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.d_k, cfg.d_v,
                                            self_attention=True, dropout=cfg.attn_dropout)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.P_drop)

    def forward(self, x: Tensor, src_mask: Tensor, packing: Packing | None = None) -> Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=src_mask, packing=packing)))
        return self.norm2(x + self.dropout(self.ffn(x)))


@dataclass
class LayerState:
    """Incremental state of one decoder layer: its self-attention cache and the encoder K/V."""

    self_cache: KVCache | PathKVCache
    memory_kv: tuple[Tensor, Tensor]

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep hypothesis rows `index`; and sentences `sentences` of the encoder K/V, which
        are kept once per sentence (None: the same sentences as before)."""
        self.self_cache.reorder(index)
        if sentences is not None:
            k, v = self.memory_kv
            self.memory_kv = (k.index_select(0, sentences), v.index_select(0, sentences))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN; each post-norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.d_k, cfg.d_v,
                                            self_attention=True, dropout=cfg.attn_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.h, cfg.d_k, cfg.d_v,
                                             self_attention=False, dropout=cfg.attn_dropout)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.P_drop)

    def forward(self, y: Tensor, memory: Tensor, src_mask: Tensor,
                state: LayerState | None = None, packing: Packing | None = None,
                memory_packing: Packing | None = None) -> Tensor:
        cache = state.self_cache if state is not None else None
        kv = state.memory_kv if state is not None else None
        y = self.norm1(y + self.dropout(self.self_attn(y, causal=True, cache=cache,
                                                       packing=packing)))
        y = self.norm2(y + self.dropout(self.cross_attn(
            y, memory, src_mask, kv=kv, packing=packing, memory_packing=memory_packing)))
        return self.norm3(y + self.dropout(self.ffn(y)))


# --------------------------------------------------------------------------- 3.5
def sinusoidal_positions(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same): (P, D)."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    div = torch.pow(10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe.float()


class Embeddings(nn.Module):
    """Token embedding x sqrt(d_model) + positional encoding, then dropout (3.4, 3.5, 5.4)."""

    def __init__(self, cfg: ModelConfig, token: nn.Embedding) -> None:
        super().__init__()
        self.token = token
        self.scale = math.sqrt(cfg.d_model)
        self.learned: nn.Embedding | None = None
        if cfg.positional == "learned":
            self.learned = nn.Embedding(cfg.max_positions, cfg.d_model)
            nn.init.normal_(self.learned.weight, std=cfg.d_model**-0.5)
        else:
            self.register_buffer("pe", sinusoidal_positions(cfg.max_positions, cfg.d_model),
                                 persistent=False)
        self.dropout = Dropout(cfg.P_drop)
        self.max_positions = cfg.max_positions

    def forward(self, tokens: Tensor, offset: int = 0, packing: Packing | None = None
                ) -> Tensor:
        """tokens (B, T) at positions offset..offset+T-1 -> (B, T, D); with `packing`, the
        real tokens' rows only: (N, D)."""
        t = tokens.size(1)
        if offset + t > self.max_positions:
            raise ValueError(f"sequence of length {offset + t} exceeds max_positions="
                             f"{self.max_positions}")
        table = self.learned.weight if self.learned is not None else self.pe
        if packing is not None:
            ids = tokens.flatten().index_select(0, packing.rows)
            pos = table.index_select(0, packing.rows % t + offset)  # type: ignore[operator]
        else:
            ids, pos = tokens, table[offset:offset + t]  # type: ignore[index]
        return self.dropout(self.token(ids) * self.scale + pos)


# --------------------------------------------------------------------------- 3
class Transformer(nn.Module):
    """Encoder-decoder Transformer. `forward(src, tgt_in)` gives logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (it comes from the vocabulary)")
        self.cfg = cfg
        #: Run the position-wise sublayers on the real tokens only (`packing`); None: when
        #: training on the CPU; False: always the whole padded batch (train.pack_padding).
        self.pack_padding: bool | None = None
        emb = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.src_embed = Embeddings(cfg, emb)
        tgt_emb = emb if cfg.share_embeddings else nn.Embedding(cfg.vocab_size, cfg.d_model,
                                                                padding_idx=PAD_ID)
        self.tgt_embed = Embeddings(cfg, tgt_emb)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.N))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.N))
        self.generator = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_parameters()
        if cfg.share_embeddings:
            self.generator.weight = emb.weight  # the pre-softmax projection is the embedding

    def _init_parameters(self) -> None:
        # tensor2tensor: Glorot-uniform matrices, N(0, d_model^-0.5) embeddings so that the
        # sqrt(d_model) scaling brings them to unit size; the padding row is zero.
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                nn.init.xavier_uniform_(p)
        for emb in {self.src_embed.token, self.tgt_embed.token}:
            nn.init.normal_(emb.weight, std=self.cfg.d_model**-0.5)
            with torch.no_grad():
                emb.weight[PAD_ID].zero_()

    def use_cpu_kernels(self, on: bool) -> None:
        """Dropout masks from the compiled generator (`Dropout.compiled`, the default) or
        from PyTorch's: `train.cpu_kernels`, whose other half, the loss, is an argument of
        `loss.generator_loss`."""
        for module in self.modules():
            if isinstance(module, Dropout):
                module.compiled = on

    @staticmethod
    def src_mask(src: Tensor) -> Tensor:
        """(B, S) -> (B, 1, 1, S) boolean, True at real tokens: every query may attend there."""
        return (src != PAD_ID)[:, None, None, :]

    def packing(self, tokens: Tensor) -> Packing | None:
        """How to run a padded batch on its real tokens only (`Packing`), or None to run it
        as it is: where `pack_padding` says so and the batch has padding to leave out.

        `pack_padding` None means: when training on the CPU, outside torch.compile. A GPU
        would wait for the rows to be found (and padding is cheap there: not measured);
        evaluation and decoding keep the padded batch, whose encoder pass is a small part
        of a search, so their outputs stay those of earlier versions bit for bit.
        """
        use = self.pack_padding
        if use is None:
            use = (self.training and tokens.device.type == "cpu"
                   and not torch.compiler.is_compiling())
        if not use:
            return None
        packing = Packing(tokens)
        return packing if packing.padded else None

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, D) and its mask (B, 1, 1, S)."""
        mask = self.src_mask(src)
        packing = self.packing(src)
        memory = self._encode(src, mask, packing)
        return (memory if packing is None else packing.unpack(memory)), mask

    def _encode(self, src: Tensor, mask: Tensor, packing: Packing | None) -> Tensor:
        x = self.src_embed(src, packing=packing)
        for layer in self.encoder:
            x = layer(x, mask, packing)
        return x

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, *,
               features_only: bool = False, memory_packing: Packing | None = None) -> Tensor:
        """Teacher-forced decoder: tgt_in (B, T) -> logits (B, T, V), or with
        `features_only` the last layer's output (B, T, D) before the pre-softmax projection
        (training projects it inside the loss: `aiayn.loss.generator_loss`). Positions
        after a sentence's end mean nothing (mostly zeros when the batch was packed).

        Target padding needs no mask: it only ever follows real tokens, and the causal mask
        already keeps every real position from seeing later ones.
        """
        packing = self.packing(tgt_in)
        y = self.tgt_embed(tgt_in, packing=packing)
        for layer in self.decoder:
            y = layer(y, memory, src_mask, packing=packing, memory_packing=memory_packing)
        if not features_only:
            y = self.generator(y)
        return y if packing is None else packing.unpack(y)

    def forward(self, src: Tensor, tgt_in: Tensor, *, features_only: bool = False) -> Tensor:
        mask = self.src_mask(src)
        packing = self.packing(src)
        memory = self._encode(src, mask, packing)  # the real rows, when packed
        return self.decode(tgt_in, memory, mask, features_only=features_only,
                           memory_packing=packing)

    # -- incremental decoding (section 6.1 inference) ---------------------------------
    def init_state(self, memory: Tensor, max_len: int) -> list[LayerState]:
        """Per-layer state for incremental decoding: encoder K/V once, empty self caches.

        On the CPU without gradients (decoding), attention runs compiled (`PathKVCache`,
        `native`), else with PyTorch ops (`KVCache`). `max_len`, the output cap, sizes
        `PathKVCache`'s tables of addresses (they grow if it is exceeded).
        """
        b, cfg = memory.size(0), self.cfg
        compiled = compiled_decoding(memory, cfg.h, cfg.d_k, cfg.d_v)
        states = []
        for layer in cast(Iterable[DecoderLayer], self.decoder):
            cache: KVCache | PathKVCache = (
                PathKVCache(cfg.h, cfg.d_k, cfg.d_v, max_len) if compiled
                else KVCache(b, cfg.h, cfg.d_k, cfg.d_v, memory.device, memory.dtype))
            # contiguous once here, or the CPU's bf16 matrix products copy them every step
            k, v = layer.cross_attn.project_kv(memory)
            states.append(LayerState(cache, (k.contiguous(), v.contiguous())))
        return states

    def decode_step(self, tokens: Tensor, src_mask: Tensor,
                    states: list[LayerState]) -> Tensor:
        """One step: the newest tokens (B, 1) -> logits for the next token (B, V).

        Equals the last row of `decode` on the whole prefix (tested), at O(T) cost per step.
        """
        return self.generator(self.decode_hidden(tokens, src_mask, states))

    def decode_hidden(self, tokens: Tensor, src_mask: Tensor,
                      states: list[LayerState]) -> Tensor:
        """`decode_step` before the output layer: the decoder's last output (B, d_model),
        for a search that applies `generator` its own way (`search.best_next_tokens`)."""
        offset = states[0].self_cache.length
        y = self.tgt_embed(tokens, offset=offset)
        for layer, state in zip(self.decoder, states, strict=True):
            y = layer(y, None, src_mask, state)  # type: ignore[arg-type]
        return y[:, -1]


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_formula(cfg: ModelConfig) -> int:
    """Closed-form parameter count of `Transformer(cfg)`, from the shapes in section 3."""
    D, V = cfg.d_model, cfg.vocab_size
    attn = D * cfg.h * (2 * cfg.d_k + cfg.d_v) + cfg.h * cfg.d_v * D
    ffn = D * cfg.d_ff + cfg.d_ff + cfg.d_ff * D + D
    norm = 2 * D
    enc_layer = attn + ffn + 2 * norm
    dec_layer = 2 * attn + ffn + 3 * norm
    embeddings = V * D if cfg.share_embeddings else 3 * V * D
    positions = cfg.max_positions * D * 2 if cfg.positional == "learned" else 0
    return embeddings + positions + cfg.N * (enc_layer + dec_layer)
