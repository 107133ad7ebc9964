"""What `aiayn.fast` plugs into the paper's code: its implementations, registered with the
seam (`aiayn.speed`) when `aiayn.fast` is imported.

Each entry calls through its module at call time (`native.lse_topk`, not the function
object taken now), so that a test that swaps a kernel out swaps it for the paper's code
too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aiayn import speed
from aiayn.config import ModelConfig
from aiayn.decoding import search
from aiayn.fast import flops, machine, native
from aiayn.fast.inference import Int8Linear
from aiayn.fast.layers import FastTransformer, accelerate
from aiayn.model import Transformer


def step_topk(
    model: Any, last: Tensor, src_mask: Tensor, states: Any, k: int, exclude: tuple[int, ...]
) -> tuple[Tensor, Tensor] | None:
    """An int8 model's beam step: the output layer (`Int8Linear.lse_topk`) scales the
    logits as it reads them instead of writing them out; where it cannot, its float
    logits go to the search's top-k. None for any other model (nothing computed), and
    for a subclass that overrides `decode_step` (its logits are what it says)."""
    if not (
        isinstance(model, FastTransformer)
        and isinstance(model.generator, Int8Linear)
        and type(model).decode_step is FastTransformer.decode_step
    ):
        return None
    hidden = model.decode_hidden(last, src_mask, states)
    fused = model.generator.lse_topk(hidden, k, exclude)
    if fused is not None:
        return fused
    return search.logits_topk(model.generator(hidden), k, exclude)


def smoothed_ce(
    logits: Tensor, target: Tensor, eps: float, write_grad: bool
) -> tuple[Tensor, Tensor, Tensor] | None:
    return native.smoothed_ce(logits, target, eps, write_grad)


def lse_topk(logits: Tensor, k: int, exclude: tuple[int, ...]) -> tuple[Tensor, Tensor] | None:
    return native.lse_topk(logits, k, exclude)


def bpe_dropout(
    sym: Tensor,
    off: Tensor,
    keys: Tensor,
    merged: Tensor,
    score: Tensor,
    v: int,
    seed: int,
    threshold: int,
) -> tuple[Tensor, Tensor] | None:
    return native.bpe_dropout(sym, off, keys, merged, score, v, seed, threshold)


def training_flops(
    cfg: ModelConfig,
    batch: int,
    S: int,
    T: int,
    *,
    src_tokens: int | None = None,
    tgt_tokens: int | None = None,
) -> float:
    return flops.training_flops(cfg, batch, S, T, src_tokens=src_tokens, tgt_tokens=tgt_tokens)


def _accelerate(
    model: Transformer, *, pack_padding: bool = True, cpu_kernels: bool = True
) -> Transformer:
    return accelerate(model, pack_padding=pack_padding, cpu_kernels=cpu_kernels)


def slow_bf16_warning(device: torch.device) -> str | None:
    return machine.slow_bf16_warning(device)


def register() -> None:
    """Turn the speed paths on: every implementation above, into `aiayn.speed`."""
    speed.register(
        {
            "accelerate": _accelerate,
            "smoothed_ce": smoothed_ce,
            "lse_topk": lse_topk,
            "step_topk": step_topk,
            "bpe_dropout": bpe_dropout,
            "machine_choice": lambda: machine.best(),
            "describe_machine": lambda: machine.describe(),
            "slow_bf16_warning": slow_bf16_warning,
            "training_flops": training_flops,
        }
    )
