"""int8 matrix products for int8 decoding (`aiayn.fast.inference.Int8Linear`) and for
measuring the int8 product rate (`aiayn.fast.flops`)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def quantize_per_row(t: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row of a 2-D float32 tensor, with PyTorch ops: (int8 q, float32
    scale), q = round(t * 127 / max|t|) (ties to even), scale = max|t| / 127; an all-zero
    row gives zeros and scale 0. `native.quantize_rows` computes the same in C."""
    amax = t.abs().amax(dim=1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(t * inv[:, None]).to(torch.int8), amax / 127.0


def int8_matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b.T for int8 (M, K) and (N, K): (M, N) int32, exact, into `out` (contiguous)
    if given. `torch._int_mm` where this build has it for the CPU; else float32 products
    of the integers (exact while K * 127 * 127 < 2^24, i.e. K <= 1,040, and within float32
    rounding beyond)."""
    if _has_int_mm():
        return torch._int_mm(a, b.t()) if out is None else torch._int_mm(a, b.t(), out=out)
    y = torch.round(a.float() @ b.float().t()).to(torch.int32)
    return y if out is None else out.copy_(y)


@functools.cache
def _has_int_mm() -> bool:
    try:
        a = torch.tensor([[1, -2, 3]], dtype=torch.int8)
        b = torch.tensor([[4, 5, -6], [127, -128, 1]], dtype=torch.int8)
        return bool(
            torch.equal(torch._int_mm(a, b.t()), torch.tensor([[-24, 386]], dtype=torch.int32))
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
