"""What a training run carries and returns: its counters (saved in every checkpoint), the
callbacks a caller may hang on it, and its result."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor


class TrainingError(RuntimeError):
    """Training cannot start or continue; the message says why and what to do."""


@dataclass
class TrainState:
    """Counters saved in every checkpoint: where the run is, in steps, epochs and data."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch already consumed
    nonfinite_skipped: int = 0
    oom_skipped: int = 0
    overflow_skipped: int = 0  # fp16 steps skipped by the loss scaler (inf/NaN gradients)
    rollbacks: int = 0
    lr_factor: float = 1.0  # halved (divergence_lr_factor) by each divergence rollback
    best_valid_nll: float = math.inf
    valid_without_improvement: int = 0  # early-stopping patience counter
    # checkpoint_best.pt (train.best_metric): its step, the metric that chose it
    # ("valid_bleu" or "valid_ppl"; "" = none yet) and its value, the one a resume must beat
    best_checkpoint_step: int = 0
    best_checkpoint_metric: str = ""
    best_checkpoint_value: float = 0.0
    world_size: int = 1  # batch_in_epoch counts this many ranks' batches at a time
    # batch_in_epoch counts global batches (train.global_batch_tokens), the same on any
    # number of ranks, rather than each rank's batches
    global_batches: bool = False
    train_seconds: float = 0.0
    tokens_seen: int = 0
    flops: float = 0.0  # counted from the model's shapes (aiayn.fast.flops), padding included

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Hooks:
    """Callbacks for the CLI (progress bars); the library itself only logs."""

    on_step: Callable[[int, dict[str, float]], None] | None = None
    on_valid: Callable[[int, dict[str, float]], None] | None = None
    #: (step, epoch, batch position, example ids) of every batch an update draws
    on_batch: Callable[[int, int, int, Tensor], None] | None = None


@dataclass
class TrainResult:
    state: TrainState
    run_dir: Path
    last_checkpoint: Path | None
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_by: str = "max_steps"


class StepHook:
    """Callbacks inside each optimizer step, for code that must act at exact points of it
    (fault injection for the reliability tests: `aiayn.training.faults.Faults`). The base
    class does nothing; the trainer calls one instance."""

    def install(self, model: Any) -> None:
        """Once, on the model before training."""

    def begin_attempt(self, step: int) -> None:
        """As each attempt at optimizer step `step` starts."""

    def before_forward(self) -> None:
        """Before each batch's forward pass."""

    def on_loss(self, loss: Tensor) -> Tensor:
        """Each batch's loss, before its backward pass: returned as it should count."""
        return loss

    def lr_factor(self, step: int) -> float:
        """A factor on the learning rate of step `step`."""
        return 1.0

    def after_update(self, step: int, model: Any) -> None:
        """After the optimizer updated the weights of step `step`."""

    def on_rollback(self) -> None:
        """After a divergence rollback reloaded an earlier checkpoint."""
