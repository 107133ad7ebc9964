"""Attention's fast paths: PyTorch's fused kernels and aiayn's Triton kernel on CUDA.

`scaled_dot_product_attention` computes Eq. 1 as `aiayn.model.scaled_dot_product_attention`
does, choosing among exact implementations of the same formula by device and shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn import model
from aiayn.fast import kernels


class NoCudnnAttention:
    """PyTorch's fused attention on CUDA without its cuDNN backend, the others as the user
    left them.

    cuDNN plans each new shape on first use, and translation's batches come in many
    (lengths vary from batch to batch, and from step to step in a search), so planning
    dominates a training run's first minutes and slows later steps too
    (docs/performance.md). Flash and memory-efficient attention compute the same formula.
    A flag flipped and restored, not `sdpa_kernel` (far slower a call, and it would
    re-enable backends the user turned off); left alone while torch.compile traces.
    """

    def __init__(self, q: Tensor) -> None:
        self.active = (
            q.is_cuda
            and torch.backends.cuda.cudnn_sdp_enabled()
            and not torch.compiler.is_compiling()
        )

    def __enter__(self) -> None:
        if self.active:
            torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc: object) -> None:
        if self.active:
            torch.backends.cuda.enable_cudnn_sdp(True)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
    fused: bool | None = None,
) -> Tensor:
    """Eq. 1, softmax(Q K^T / sqrt(d_k)) V, with illegal connections set to -inf first.

    Three exact implementations of the same formula: PyTorch's fused kernels (flash,
    memory-efficient attention; not cuDNN's on CUDA: `NoCudnnAttention`), aiayn's own
    Triton kernel for short sequences on CUDA (`aiayn.fast.kernels`: at translation's sentence
    lengths PyTorch's kernels mostly compute padding of their tiles), and the formula
    written out as two matrix products and a softmax, which on CPU is faster to train
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
            tri = model.causal_mask(q.size(2), k.size(2), q.device)
            mask, causal = (tri if mask is None else mask & tri), False
        with NoCudnnAttention(q):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
            )
    return model.scaled_dot_product_attention(q, k, v, mask, causal=causal, dropout_p=dropout_p)
