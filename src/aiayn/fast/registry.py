"""What `aiayn.fast` plugs into the paper's code: its implementations, registered with the
seam (`aiayn.speed`) when `aiayn.fast` is imported.

Each entry calls through its module at call time (`native.lse_topk`, not the function
object taken now), so that a test that swaps a kernel out swaps it for the paper's code
too.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from aiayn import speed
from aiayn.decoding import search
from aiayn.fast import decoder_step, flops, machine, native
from aiayn.fast.inference import Int8Linear
from aiayn.fast.layers import FastTransformer, accelerate


def step_topk(
    model: Any, last: Tensor, src_mask: Tensor, states: Any, k: int, exclude: tuple[int, ...]
) -> tuple[Tensor, Tensor] | None:
    """An int8 model's beam step: the output layer (`Int8Linear.lse_topk`) scales the
    logits as it reads them instead of writing them out; where it cannot, its float
    logits go to the search's top-k. None for any other model (nothing computed), and
    for a subclass that overrides `decode_step` (its logits are what it says)."""
    if isinstance(states, decoder_step.NativeStates):  # the whole step in one C call
        return states.topk(last, src_mask, k, exclude)
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


def whole_search(
    states: Any, src_mask: Tensor, caps: list[int], beam: int, alpha: float, min_len: int
) -> list[list[search.Hypothesis]] | None:
    """The compiled step's whole search (`NativeStates.search`); None for other states."""
    if isinstance(states, decoder_step.NativeStates):
        return states.search(src_mask, caps, beam, alpha, min_len)
    return None


def register() -> None:
    """Turn the speed paths on: every implementation above, into `aiayn.speed`."""
    # each through its module at call time (see the module docstring); the signatures are
    # the seam's (`aiayn.speed.Implementations`)
    speed.register(
        {
            "accelerate": lambda model, **kw: accelerate(model, **kw),
            "smoothed_ce": lambda *a: native.smoothed_ce(*a),
            "lse_topk": lambda *a: native.lse_topk(*a),
            "step_topk": step_topk,
            "whole_search": whole_search,
            "bpe_dropout": lambda *a: native.bpe_dropout(*a),
            "machine_choice": lambda: machine.best(),
            "describe_machine": lambda: machine.describe(),
            "slow_bf16_warning": lambda device: machine.slow_bf16_warning(device),
            "training_flops": lambda *a, **kw: flops.training_flops(*a, **kw),
        }
    )
