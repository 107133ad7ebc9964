"""int8 matrix products for int8 decoding (`aiayn.fast.inference.Int8Linear`) and for
measuring the int8 product rate (`aiayn.fast.flops`), exact on every CPU.

`torch._int_mm` (oneDNN's s8s8s32 GEMM) is exact and fast where the CPU has VNNI (AVX-512
VNNI, AVX-VNNI, AMX); without it oneDNN's kernel saturates int16 sums of pairs and most
results come out wrong (csrc/int8_gemm.c has the measurement), and some builds fall back
to a slow generic loop. `backend()` checks which holds here, once, and the products go to
`torch._int_mm` where it is exact, else to aiayn's own kernel (`native.int8_gemm`: AVX2
or plain C, on weights packed once), else to float32 products of the integers.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from aiayn.fast import native


def quantize_per_row(t: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a 2-D float32 tensor, with PyTorch ops: (int8 q, float32
    scale), q = round(t * 127 / max|t|) (ties to even), scale = max|t| / 127; an all-zero
    row gives zeros and scale 0. `native.quantize_rows` computes the same in C."""
    amax = t.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(t * inv[:, None]).to(torch.int8), amax / 127.0


#: What computes int8 products here (`backend`): PyTorch's torch._int_mm, aiayn's kernel,
#: or float32 products of the integers.
BACKENDS = ("torch", "aiayn", "float")


@functools.cache
def backend() -> str:
    """ "torch" where torch._int_mm is exact on operands of the whole range [-127, 127]
    (checked on a random 64 x 256 x 96 product, which oneDNN's saturating kernel gets
    ~99% wrong), else "aiayn" where the compiled library is there, else "float"."""
    if _int_mm_exact():
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
        self, a: Tensor, c0: int = 0, c1: int | None = None, out: Tensor | None = None
    ) -> Tensor:
        n = self.weight.size(0)
        c1 = n if c1 is None else c1
        if self.packed is not None:
            return native.int8_gemm(a, self.packed, n, c0, c1, out)
        w = self.weight if (c0, c1) == (0, n) else self.weight[c0:c1]
        return int8_matmul(a, w, out=out)
