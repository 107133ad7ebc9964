"""Eq. 1 for short sequences on CUDA GPUs: one Triton program per (sentence, head).

Why: translation's sentences are short (Multi30k: ~13 subwords; WMT: tens). In a base
bf16 training step at the paper's batch size, PyTorch's fused attention (cuDNN's kernels
there) was the largest single share of the GPU's time, many times what reading and
writing its tensors costs at the GPU's memory bandwidth; its other backends and the
written-out formula were no faster. Their tiles of 64-128 query rows are mostly padding
at these lengths (our reading; not profiled inside them). Here each program holds one
(sentence, head)'s whole Q, K and V (at most MAX_LEN positions) in registers: one read of
the inputs, one write of the output, no padding beyond the next power of two, which
shortens that step's GPU time (measured: docs/performance.md, "Triton attention on GPU").

The math is the flash-attention recipe without the loop over key blocks (one block holds
all keys): S = Q K^T / sqrt(d_k), masked entries -inf, P = softmax(S) with its log-sum-exp
kept for the backward, O = P V; backward dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
dQ = dS K / sqrt(d_k), dK = dS^T Q / sqrt(d_k). Products take bf16 operands with float32
accumulation (P is rounded to the operands' dtype before P V, as in flash attention), or
IEEE float32 for float32 inputs. Tested against a float64 transcription of Eq. 1.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
from torch import Tensor

#: longest query or key length handled here; longer ones go to PyTorch's kernels, which
#: are efficient once their tiles fill
MAX_LEN = 64
_HEAD_DIMS = (16, 32, 64, 128)


@functools.cache
def available() -> bool:
    """Whether Triton is installed (PyTorch's CUDA builds for Linux ship it); it is only
    imported when a kernel first runs."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


def applies(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout_p: float
) -> bool:
    """Whether `attention` handles this call: CUDA, no attention dropout, a key-padding mask
    (B or 1, 1, 1, Tk) or none, causal only with as many queries as keys, d_k = d_v a power
    of two from 16 to 128, both lengths <= MAX_LEN. Not while torch.compile traces (its
    own kernels for the formula are fused there)."""
    if not (q.is_cuda and dropout_p == 0.0 and available()):
        return False
    if torch.compiler.is_compiling():
        return False
    b, h, tq, d = q.shape
    tk = k.size(2)
    if not (d in _HEAD_DIMS and v.size(-1) == d and tq <= MAX_LEN and tk <= MAX_LEN):
        return False
    if not (
        q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    ):
        return False
    if k.shape[:2] != (b, h) or v.shape[:3] != k.shape[:3]:
        return False
    if causal and tq != tk:
        return False
    return mask is None or (
        mask.dim() == 4
        and mask.shape[1:3] == (1, 1)
        and mask.size(3) == tk
        and mask.size(0) in (1, b)
        and mask.dtype == torch.bool
    )


#: below this many query elements (B * H * Tq * d_k) PyTorch's kernels trained as fast or
#: faster: the step is bound by launching kernels, and a Triton launch costs more CPU time
#: than an ATen one. The threshold lies between the benchmark's base batch (291 sentences,
#: 2.5M elements: the kernel slower) and the paper's (1,700 sentences, 14.8M elements: the
#: kernel faster); measured: docs/performance.md
MIN_ELEMENTS = 2**23


def preferred(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout_p: float
) -> bool:
    """Whether the model should take `attention` rather than PyTorch's kernels: it
    `applies`, in training (gradients wanted), in 16-bit precision (float32 and decoding
    measured as fast or faster with PyTorch's), on at least MIN_ELEMENTS query elements."""
    return (
        q.requires_grad
        and torch.is_grad_enabled()
        and q.dtype != torch.float32
        and q.numel() >= MIN_ELEMENTS
        and applies(q, k, v, mask, causal, dropout_p)
        and works_on(q.device)
    )


@functools.cache
def works_on(device: torch.device) -> bool:
    """Whether the kernel compiles and runs on `device` and gives Eq. 1 (forward and
    backward, on a small masked and a small causal case), checked once per device before
    training relies on it. A Triton that does not match the GPU or PyTorch fails here,
    with a warning, and attention stays with PyTorch's kernels instead of the run
    crashing at its first step."""
    import warnings

    try:
        with torch.autocast(device.type, enabled=False), torch.enable_grad():
            _probe(device)
    except Exception as e:  # any failure means: do not use it
        warnings.warn(
            f"aiayn's Triton attention kernel is not used on {device}: {type(e).__name__}: {e}",
            stacklevel=2,
        )
        return False
    return True


def _probe(device: torch.device) -> None:
    """Raises unless the kernel gives Eq. 1 on a small masked and a small causal case."""
    from aiayn.model import scaled_dot_product_attention  # the written-out formula

    gen = torch.Generator().manual_seed(0)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    for mask, causal in ((keep[:, None, None, :].to(device), False), (None, True)):
        q, k, v = (
            torch.randn(2, 2, 5, 16, generator=gen).to(device).requires_grad_() for _ in range(3)
        )
        rq, rk, rv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, mask, causal)
        ref = scaled_dot_product_attention(rq, rk, rv, mask, causal=causal)
        (out.sum() + ref.sum()).backward()
        pairs = [(out, ref), (q.grad, rq.grad), (k.grad, rk.grad), (v.grad, rv.grad)]
        # loose enough for TF32 products in the reference (if the user turned them on),
        # tight enough for a wrong mask, scale or gradient (errors of 0.1 and more)
        if not all(
            a is not None and b is not None and torch.allclose(a, b, rtol=1e-2, atol=1e-2)
            for a, b in pairs
        ):
            raise RuntimeError("its results differ from Eq. 1")


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False
) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V for q (B, H, Tq, D), k and v (B, H, Tk, D); mask
    (B, 1, 1, Tk) True = may attend; causal: query i sees keys <= i. Returns (B, H, Tq, D)
    as a view of a (B, Tq, H, D) tensor, so that concatenating the heads costs nothing.
    Check `applies` first."""
    keep = None
    if mask is not None:
        keep = mask.reshape(mask.size(0), mask.size(3)).to(torch.int8).contiguous()
    return _ShortAttention.apply(q, k, v, keep, causal)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _blocks(tq: int, tk: int) -> tuple[int, int, int]:
    bq, bk = max(16, 1 << (tq - 1).bit_length()), max(16, 1 << (tk - 1).bit_length())
    return bq, bk, 4 if max(bq, bk) >= 64 else 2


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, causal: bool
    ) -> Tensor:
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        b, h, tq, d = q.shape
        tk = k.size(2)
        o = torch.empty(b, tq, h, d, device=q.device, dtype=q.dtype)
        lse = torch.empty(b * h, tq, device=q.device, dtype=torch.float32)
        bq, bk, warps = _blocks(tq, tk)
        _triton().attn_fwd[(b * h,)](
            q,
            k,
            v,
            o,
            lse,
            keep if keep is not None else q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            o.stride(0),
            o.stride(2),
            o.stride(1),
            keep.stride(0) if keep is not None and keep.size(0) > 1 else 0,
            h,
            tq,
            tk,
            d**-0.5,
            CAUSAL=causal,
            HAS_MASK=keep is not None,
            PREC=_precision(q),
            BQ=bq,
            BK=bk,
            D=d,
            num_warps=warps,
        )
        ctx.save_for_backward(q, k, v, o, lse, keep)
        ctx.causal = causal
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse, keep = ctx.saved_tensors
        do = _last_dim_contiguous(do)
        b, tq, h, d = o.shape
        tk = k.size(2)
        dq = torch.empty(b, tq, h, d, device=q.device, dtype=q.dtype)
        dk = torch.empty(b, tk, h, d, device=q.device, dtype=k.dtype)
        dv = torch.empty(b, tk, h, d, device=q.device, dtype=v.dtype)
        bq, bk, warps = _blocks(tq, tk)
        _triton().attn_bwd[(b * h,)](
            q,
            k,
            v,
            o,
            do,
            lse,
            keep if keep is not None else q,
            dq,
            dk,
            dv,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            o.stride(0),
            o.stride(2),
            o.stride(1),
            do.stride(0),
            do.stride(1),
            do.stride(2),
            keep.stride(0) if keep is not None and keep.size(0) > 1 else 0,
            dq.stride(0),
            dq.stride(2),
            dq.stride(1),
            dk.stride(0),
            dk.stride(2),
            dk.stride(1),
            h,
            tq,
            tk,
            d**-0.5,
            CAUSAL=ctx.causal,
            HAS_MASK=keep is not None,
            PREC=_precision(q),
            BQ=bq,
            BK=bk,
            D=d,
            num_warps=warps,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None


def _triton() -> Any:
    from aiayn.fast import _triton_attention

    return _triton_attention


def _precision(x: Tensor) -> str:
    # float32 stays float32 (TF32 would round the operands to 10 bits)
    return "ieee" if x.dtype == torch.float32 else "tf32"
