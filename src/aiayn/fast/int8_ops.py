"""int8 matrix products and the int8 linear layer of int8 decoding (`Int8Linear`, which
`aiayn.fast.inference.cast` swaps in), and the int8 product rate (`aiayn.fast.flops`),
exact on every CPU.

`torch._int_mm` (oneDNN's s8s8s32 GEMM) is exact and fast where the CPU has VNNI (AVX-512
VNNI, AVX-VNNI, AMX); without it oneDNN's kernel saturates int16 sums of pairs and most
results come out wrong (csrc/int8_gemm.c has the measurement), or (this CPU build on
AVX2, "switching to BLAS gemm") it falls back to an exact generic loop 50-200x slower
than aiayn's kernel (measured on an AMD EPYC Zen 3: 23 ms against 0.12 ms for a 20 x 128
by 128 x 8,000 product). `backend()` checks which holds here, once, and the products go to
`torch._int_mm` where it is exact and the CPU has VNNI, else to aiayn's own kernel
(`native.int8_gemm`: VNNI, AVX2 or plain C, on weights packed once), else to float32
products of the integers.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor, nn

from aiayn import cpu_isa
from aiayn.fast import native


def quantize_per_row(t: Tensor, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a 2-D float32 tensor, with PyTorch ops: (int8 q, float32
    scale), q = round(t * 127 / max|t|) (ties to even), scale = max|t| / 127; an all-zero
    row gives zeros and scale 0 (`bits=7`: 63 for 127). `native.quantize_rows` computes the
    same in C (for 7 bits it stores q + 64)."""
    top = float((1 << (bits - 1)) - 1)
    amax = t.abs().amax(dim=1)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return torch.round(t * inv[:, None]).to(torch.int8), amax / top


#: What computes int8 products here (`backend`): PyTorch's torch._int_mm, aiayn's kernel,
#: or float32 products of the integers.
BACKENDS = ("torch", "aiayn", "float")


@functools.cache
def backend() -> str:
    """ "torch" where the CPU (as capped by `AIAYN_CPU_ISA`) has VNNI and torch._int_mm is
    exact on operands of the whole range [-127, 127] (checked on a random 64 x 256 x 96
    product, which oneDNN's saturating kernel gets ~99% wrong), else "aiayn" where the
    compiled library is there, else "float". Without VNNI an exact torch._int_mm is
    PyTorch's generic loop, far slower than aiayn's kernel (module doc)."""
    if cpu_isa.cpu().has_vnni() and _int_mm_exact():
        return "torch"
    return "aiayn" if native.library() is not None else "float"


def _int_mm_exact() -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=gen)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "failed, switching to BLAS gemm": still exact
            got = torch._int_mm(a, b.t())
        return bool(torch.equal(got.long(), a.long() @ b.long().t()))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def int8_matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b.T for int8 (M, K) and (N, K): (M, N) int32, exact, into `out` (contiguous) if
    given, by `backend()` (aiayn's kernel packs b on every call here: a layer used many
    times keeps its packed weight, `Int8Weight`). The float fallback is exact while
    K * 127 * 127 < 2^24, i.e. K <= 1,040, and within float32 rounding beyond."""
    how = backend()
    if how == "torch":
        return torch._int_mm(a, b.t()) if out is None else torch._int_mm(a, b.t(), out=out)
    if how == "aiayn":
        packed = native.int8_pack(b.contiguous())
        assert packed is not None
        return native.int8_gemm(a.contiguous(), packed, b.size(0), out=out)
    y = torch.round(a.float() @ b.float().t()).to(torch.int32)
    return y if out is None else out.copy_(y)


class Int8Weight:
    """An (N, K) int8 weight ready for `int8_matmul`'s backend: packed once for aiayn's
    kernel (`native.int8_pack`) where that is the backend. `matmul(a, c0, c1, out)` gives
    a @ W[c0:c1].T (c0 a multiple of `native.INT8_PANEL` for aiayn's kernel)."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight
        self.packed = native.int8_pack(weight.contiguous()) if backend() == "aiayn" else None

    def matmul(
        self,
        a: Tensor,
        c0: int = 0,
        c1: int | None = None,
        out: Tensor | None = None,
        nonneg: bool = False,
        r7: bool = False,
    ) -> Tensor:
        """`nonneg`: every element of `a` is >= 0 (aiayn's kernel then moves no signs);
        `r7`: `a` holds 7-bit values plus 64 (`native.quantize_rows(x, bits=7)`), the
        product is that of the values."""
        n = self.weight.size(0)
        c1 = n if c1 is None else c1
        if self.packed is not None:
            return native.int8_gemm(a, self.packed, n, c0, c1, out, nonneg=nonneg, r7=r7)
        if r7:
            a = (a.to(torch.int16) - 64).to(torch.int8)
        w = self.weight if (c0, c1) == (0, n) else self.weight[c0:c1]
        return int8_matmul(a, w, out=out)


#: int32 products per block of `Int8Linear.lse_topk` (a block of columns for all the rows):
#: about a core's L2 cache, so that the beam step reads each block from cache; smaller
#: blocks pay more per-product call costs, larger ones spill (block sizes measured:
#: docs/performance.md, "int8 layers").
LSE_TOPK_BLOCK_BYTES = 1024 * 1024


class Int8Linear(nn.Module):
    """An `nn.Linear` for CPU inference with int8 weights and int8 activations (dynamic
    quantization): y ~ s_x s_w (q_x q_W^T) + b.

    The weight is quantized once, symmetrically, with one scale per output column
    (s_w = max|W_j| / 127); each input row gets its own scale at run time (s_x =
    max|x_i| / 127). The integer product is exact (int8 x int8 -> int32): `torch._int_mm`
    (oneDNN's s8 GEMM) where the CPU has VNNI, aiayn's kernel where oneDNN's would
    saturate (`int8_ops.backend`); the passes before and after it are
    `native.quantize_rows` / `native.dequantize_rows` (PyTorch ops without the compiled
    library). This replaces `torch.ao.quantization.quantize_dynamic`, which PyTorch has
    deprecated (it printed a warning on every run) and whose activations share one scale
    per call. float32 in and out; no gradient.
    """

    weight_int8: Tensor  # (out, in) int8
    weight_scale: Tensor  # (out,) float32
    bias: Tensor | None
    nonneg_input = False  # class defaults too: a layer pickled before these existed
    act_bits = 8

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_int8, weight_scale = quantize_per_row(linear.weight.detach().float())
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self._weight = Int8Weight(self.weight_int8)
        # Its input is a ReLU's output (the FFN's second layer: `quantize_linears` says so):
        # quantized into [0, 127], multiplied without moving signs (csrc/int8_gemm.c).
        self.nonneg_input = False
        # Bits of the quantized inputs: 8, or 7 (`quantize_linears`, AIAYN_INT8_ACTIVATIONS:
        # on AVX2 without VNNI aiayn's kernel then multiplies ~1.4x faster, exactly, the
        # activations one bit coarser). A non-negative input keeps 8: it is already fast.
        self.act_bits = 8

    # The product's copy of the weight (packed for aiayn's kernel) follows the buffer:
    # `.to()` and friends replace it, load_state_dict writes into it.
    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        self._weight = Int8Weight(self.weight_int8)
        return out

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._weight = Int8Weight(self.weight_int8)

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, relu=False)

    def forward_relu(self, x: Tensor) -> Tensor:
        """max(0, forward(x)), the ReLU applied in the dequantizing pass (the FFN's first
        layer, `model.PositionwiseFeedForward`): the same values as torch.relu after it."""
        return self._forward(x, relu=True)

    @property
    def _r7(self) -> bool:
        return self.act_bits == 7 and not self.nonneg_input

    def _quantized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized: (rows, in) int8 and each row's
        scale (with 7 bits, for `_weight.matmul(..., r7=True)`: the values plus 64)."""
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.dtype != torch.float32:
            x2 = x2.float().contiguous()
        if self._r7:
            got = native.quantize_rows(x2, bits=7)
            if got is not None:
                return got
            q, scale = quantize_per_row(x2, bits=7)
            return (q.to(torch.int16) + 64).to(torch.int8), scale
        return native.quantize_rows(x2) or quantize_per_row(x2)

    def _products(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized and multiplied: the (rows, out)
        int32 products and each row's scale."""
        x_int8, x_scale = self._quantized(x)
        acc = self._weight.matmul(x_int8, nonneg=self.nonneg_input, r7=self._r7)
        return acc, x_scale

    def _forward(self, x: Tensor, relu: bool) -> Tensor:
        lead = x.shape[:-1]
        acc, x_scale = self._products(x)
        y = native.dequantize_rows(acc, x_scale, self.weight_scale, self.bias, relu)
        if y is None:
            y = acc.float().mul_(x_scale[:, None]).mul_(self.weight_scale)
            if self.bias is not None:
                y.add_(self.bias)
            if relu:
                y.relu_()
        return y.view(*lead, self.out_features)

    def lse_topk(self, x: Tensor, k: int, exclude: tuple[int, ...]) -> tuple[Tensor, Tensor] | None:
        """As the output layer of a beam search: `native.lse_topk` of this layer's outputs
        for the rows x (R, in_features), the logits scaled from the int32 products as they
        are read, without writing them out (`native.lse_topk_int8_blocked`). The products
        are made `LSE_TOPK_BLOCK_BYTES` of int32 at a time (a block of the vocabulary's
        columns for all the rows) and consumed while in cache, instead of a (R, V) table
        written to memory and read back. The k logits and columns are those of the
        layer's float outputs; the normaliser may differ in its last bits (the sum of
        exponentials runs block by block). None where that does not apply (no compiled
        library): the caller then calls the layer."""
        if native.library() is None or x.dim() != 2:
            return None
        x_int8, x_scale = self._quantized(x)
        rows, v = x_int8.size(0), self.out_features
        block = min(v, max(64, LSE_TOPK_BLOCK_BYTES // (4 * max(rows, 1)) // 64 * 64))
        # one buffer for every block: each is consumed before the next is made, and its
        # pages stay in cache
        flat = torch.empty(rows * block, dtype=torch.int32)

        def products(c0: int, c1: int) -> Tensor:
            out = flat[: rows * (c1 - c0)].view(rows, -1)
            return self._weight.matmul(x_int8, c0, c1, out=out, r7=self._r7)

        return native.lse_topk_int8_blocked(
            products, rows, v, x_scale, self.weight_scale, self.bias, k, exclude, block
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8" + (", 7-bit activations" if self._r7 else "")
        )
