"""Floating-point work of the Transformer, counted from its shapes (for Table 2 style costs).

Table 2 of the paper estimates training cost as time x GPUs x sustained FLOP/s; this module
gives the other estimate, counted from the model: every matrix product of section 3 at
2 FLOPs per multiply-add, with the backward pass counted as twice the forward (the usual
convention of Kaplan et al. 2020). Element-wise work (softmax, LayerNorm, dropout) is
left out, as it is in those conventions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from aiayn.config import ModelConfig


def forward_flops(
    cfg: ModelConfig,
    batch: int,
    S: int,
    T: int,
    *,
    src_tokens: int | None = None,
    tgt_tokens: int | None = None,
) -> float:
    """FLOPs of one forward pass over a padded batch: B sources of S and B targets of T.

    Args:
        cfg: the architecture (vocab_size must be set for the output projection).
        batch, S, T: batch size, source and target lengths (padding included).
        src_tokens, tgt_tokens: the positions whose position-wise products (projections,
            FFN, output layer) are counted: the real (non-pad) tokens, the model's work
            (issue 5's convention; what the CPU computes when it trains with padding left
            out, `aiayn.fast.packing.Packing`), or by default every padded position, B*S and B*T.
            The attention products Q K^T and weights x V are counted over the padded
            lengths, as they are computed.
    """
    D, F, h, d_k, d_v, V = cfg.d_model, cfg.d_ff, cfg.h, cfg.d_k, cfg.d_v, cfg.vocab_size
    src_rows = batch * S if src_tokens is None else src_tokens
    tgt_rows = batch * T if tgt_tokens is None else tgt_tokens
    qkv = 2 * D * h * (2 * d_k + d_v)  # per token: Q, K, V projections
    out = 2 * h * d_v * D  # W^O
    ffn = 2 * 2 * D * F
    memory_kv = 2 * D * h * (d_k + d_v)  # per source token and decoder layer
    enc_token = qkv + out + ffn
    dec_token = (
        qkv
        + out  # masked self-attention projections
        + 2 * D * h * d_k
        + out  # encoder-decoder attention: Q and W^O
        + ffn
    )
    products = batch * (
        S * 2 * S * h * (d_k + d_v)  # encoder: Q K^T and weights x V
        + T * 2 * T * h * (d_k + d_v)  # decoder self-attention (all T x T)
        + T * 2 * S * h * (d_k + d_v)
    )  # decoder: the encoder's K and V
    per_layer = src_rows * (enc_token + memory_kv) + tgt_rows * dec_token + products
    return float(cfg.N * per_layer + tgt_rows * 2 * D * V)


def training_flops(
    cfg: ModelConfig,
    batch: int,
    S: int,
    T: int,
    *,
    src_tokens: int | None = None,
    tgt_tokens: int | None = None,
) -> float:
    """Forward + backward (twice the forward) FLOPs of one training batch."""
    return 3.0 * forward_flops(cfg, batch, S, T, src_tokens=src_tokens, tgt_tokens=tgt_tokens)


def peak_size(device: str | torch.device = "cpu") -> int:
    """The product size that measures a device's ceiling: 2048 on a CPU, 8192 on a GPU
    (a 2048 product is too small to keep a large GPU busy)."""
    return 8192 if torch.device(device).type == "cuda" else 2048


def matmul_peak(
    dtype: torch.dtype = torch.float32,
    n: int | None = None,
    repeats: int = 10,
    device: str | torch.device = "cpu",
) -> float:
    """Measured matrix-product rate (FLOP/s) of an n x n x n product: the machine's ceiling.

    The median of `repeats` timed products after two warm-up ones; n defaults to
    `peak_size(device)`. dtype torch.int8: int8 x int8 -> int32 products by
    `int8_ops.int8_matmul`, the one int8 decoding runs (`inference.Int8Linear`), in
    operations/s.
    """
    n = n or peak_size(device)
    if dtype == torch.int8:
        from aiayn.fast.int8_ops import int8_matmul

        a = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
        product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = int8_matmul
    else:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        product = torch.mm
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 2):
        sync()
        t0 = time.perf_counter()
        product(a, b)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * n**3 / times[len(times) // 2]
