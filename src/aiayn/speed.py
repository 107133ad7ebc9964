"""The one seam between the paper's code and the speed paths (`aiayn.fast`).

The paper's code (model, data, decoding, training, checkpoints) never imports `aiayn.fast`.
Where a faster implementation of something may exist, it asks `IMPLEMENTATIONS` for it by
name and, when none is registered (or the one registered says "not here" by returning
None), runs its own reference implementation: the model as written in section 3, the
loss with PyTorch ops, the search's top-k with PyTorch ops, BPE-dropout in Python.

`aiayn.fast` registers its implementations here when it is imported (`register`); the
layers that build a run (the CLI, the experiments, analysis, deploy) import it to turn the
speed paths on. Without it (not imported, not installed, or blocked) everything runs the
paper's way, and computes the same up to rounding (tests/test_speed_seam.py).

A plain typed mapping, no discovery: each name below is one hook with its signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypedDict

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.model import Transformer


class Accelerate(Protocol):
    """The model with the speed paths plugged in, in place (same parameters and
    state_dict): `aiayn.fast.accelerate`."""

    def __call__(
        self, model: Transformer, *, pack_padding: bool = ..., cpu_kernels: bool = ...
    ) -> Transformer: ...


class StepTopK(Protocol):
    """A beam step's k best next tokens straight from a model whose output layer computes
    them itself (int8 decoding), or None where the model has no such layer (nothing was
    computed: the caller runs `decode_step`)."""

    def __call__(
        self,
        model: Any,
        last: Tensor,
        src_mask: Tensor,
        states: Any,
        k: int,
        exclude: tuple[int, ...],
    ) -> tuple[Tensor, Tensor] | None: ...


class WholeSearch(Protocol):
    """The whole of `search.beam_search` (beam 1: `greedy_search`) over incremental states
    that run it in compiled code, from the first step: each sentence's `beam` best
    `Hypothesis`es, best first; None where those states do not (nothing was computed: the
    caller searches step by step)."""

    def __call__(
        self,
        states: Any,
        src_mask: Tensor,
        caps: list[int],
        beam: int,
        alpha: float,
        min_len: int,
    ) -> list[list[Any]] | None: ...


class TrainingFlops(Protocol):
    """Forward + backward FLOPs of one training batch (B, S, T), the real tokens given."""

    def __call__(
        self,
        cfg: ModelConfig,
        batch: int,
        S: int,
        T: int,
        *,
        src_tokens: int | None = ...,
        tgt_tokens: int | None = ...,
    ) -> float: ...


class MachineChoice(Protocol):
    """What the speed paths chose for this CPU, and why (`aiayn.fast.machine.Choice`)."""

    @property
    def train_dtype(self) -> str: ...

    @property
    def reasons(self) -> dict[str, str]: ...

    def to_dict(self) -> dict[str, Any]: ...


class BPEDropoutKernel(Protocol):
    """BPE-dropout of every word in compiled code: (pieces, count), or None (no library)."""

    def __call__(
        self,
        sym: Tensor,
        off: Tensor,
        keys: Tensor,
        merged: Tensor,
        score: Tensor,
        v: int,
        seed: int,
        threshold: int,
    ) -> tuple[Tensor, Tensor] | None: ...


class Implementations(TypedDict, total=False):
    """Every hook, by name. Each kernel returns None where it does not apply (the caller
    then runs the reference implementation)."""

    #: the model's speed paths (`aiayn.fast.layers`); absent: the paper's modules
    accelerate: Accelerate
    #: the label-smoothed loss over rows of logits: (lse, picked, total) per row, the
    #: gradient written in place with `write_grad` (`aiayn.fast.native.smoothed_ce`)
    smoothed_ce: Callable[[Tensor, Tensor, float, bool], tuple[Tensor, Tensor, Tensor] | None]
    #: a beam step's log-sum-exp and top k of a logits table (`native.lse_topk`)
    lse_topk: Callable[[Tensor, int, tuple[int, ...]], tuple[Tensor, Tensor] | None]
    #: a beam step through an output layer that computes the top k itself
    step_topk: StepTopK
    #: the whole search in one call where the states can run it (`NativeStates.search`)
    whole_search: WholeSearch
    #: BPE-dropout's merges in compiled code (`native.bpe_dropout`)
    bpe_dropout: BPEDropoutKernel
    #: what the CPU trains fastest in (`aiayn.fast.machine.best`); absent: float32
    machine_choice: Callable[[], MachineChoice]
    #: one line naming the CPU and the choices made on it (`machine.describe`)
    describe_machine: Callable[[], str]
    #: a warning when bf16 products are slower than float32 on this device, else None
    slow_bf16_warning: Callable[[torch.device], str | None]
    #: FLOPs of a training batch, for the logs (`aiayn.fast.flops`); absent: not counted
    training_flops: TrainingFlops


#: The registered implementations: filled by `aiayn.fast` when it is imported.
IMPLEMENTATIONS: Implementations = {}


def register(implementations: Implementations) -> None:
    """Add (or replace) implementations: `aiayn.fast` calls this once, on import."""
    IMPLEMENTATIONS.update(implementations)


def accelerate(model: Transformer, *, pack_padding: bool, cpu_kernels: bool) -> Transformer:
    """`model` with the speed paths plugged in where they are registered, else as it is."""
    fast = IMPLEMENTATIONS.get("accelerate")
    if fast is None:
        return model
    return fast(model, pack_padding=pack_padding, cpu_kernels=cpu_kernels)


def machine_choice() -> MachineChoice | None:
    """This CPU's choices (`aiayn.fast.machine.best`), or None without the speed paths."""
    choose = IMPLEMENTATIONS.get("machine_choice")
    return None if choose is None else choose()


def slow_bf16_warning(device: torch.device) -> str | None:
    """The speed paths' warning that bf16 is slow on `device`, or None."""
    warn = IMPLEMENTATIONS.get("slow_bf16_warning")
    return None if warn is None else warn(device)
