"""CPU operations of the fast layers: dropout masks drawn fast, and oneDNN's fused bf16
product + bias + ReLU for the FFN."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fast import native


class FastDropout(nn.Dropout):
    """Dropout (section 5.4) on the CPU with masks drawn fast; elsewhere PyTorch's own.

    PyTorch's CPU dropout draws one random number per element through a slow path. Here,
    with `compiled` (the default), the mask comes from a counter-based generator in C
    seeded from PyTorch's generator (`native.dropout_multiplier`: p applied to within
    2^-16); without it, or without the compiled library, each 31-bit integer from
    PyTorch's generator gives two 16-bit (resp. 15-bit) uniform draws (`cpu_keep_mask`).
    Either way `torch.manual_seed` decides the masks. Speeds: docs/performance.md.
    """

    #: draw CPU masks with the compiled generator (`train.cpu_kernels`)
    compiled: bool = True

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
        # 0 or scale, the same values as where(keep, scale, 0), but converting the mask's
        # bytes (a uint8 view) is much cheaper than where()
        return x * keep.view(torch.uint8).to(x.dtype).mul_(scale)


def cpu_keep_mask(shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """Boolean mask of `shape`, True with probability 1 - p (p rounded to 2^-16 / 2^-15)."""
    n = math.prod(shape)
    r = torch.empty((n + 1) // 2, dtype=torch.int32).random_()  # uniform in [0, 2^31)
    keep = torch.empty(2, r.numel(), dtype=torch.bool)
    torch.ge(r & 0xFFFF, round(p * 65536), out=keep[0])  # the low 16 random bits
    torch.ge(r, round(p * 32768) << 16, out=keep[1])  # the high 15: r >> 16 >= t
    return keep.view(-1)[:n].view(shape)


class LinearReLU(torch.autograd.Function):
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
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
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
        x, w, b = (
            torch.randn(*shape, generator=gen).to(torch.bfloat16)
            for shape in ((37, 64), (96, 64), (96,))
        )
        with torch.no_grad():
            fused = torch.ops.mkldnn._linear_pointwise(x, w, b, "relu", [None], "")
            return bool(torch.equal(fused, torch.relu(F.linear(x, w, b))))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
