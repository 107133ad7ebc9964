"""Fault injection for the reliability tests (RELIABILITY.md section 2); inert unless the
environment variable AIAYN_FAULTS is set.

The faults must reach a trainer running in another process (a `kill -9` at step N, a rank
of a torchrun job that hangs), so they are read from the environment rather than passed in.
AIAYN_FAULTS is a comma-separated list of key=value:

    kill_at_step=N      SIGKILL this process as step N starts
    term_at_step=N      SIGTERM this process as step N starts (the step finishes, is saved,
                        and the run stops, as on an operator's SIGTERM)
    raise_at_step=N     raise RuntimeError("injected fault ...") as step N starts
    hang_at_step=N      sleep for ever as step N starts (a hung rank)
    oom_at_step=N       raise torch.OutOfMemoryError in the forward pass of step N ...
    oom_times=M         ... and of the M-1 attempts after it (default 1)
    nan_at_step=N       make the loss of step N NaN ...
    nan_times=M         ... and of the M-1 attempts after it (default 1)
    nan_module=NAME     make this module's output NaN instead of the loss
                        (a name from model.named_modules(), e.g. encoder.layers.0.ffn)
    lr_mult=X           multiply the learning rate by X from step lr_mult_at_step=N
    lr_mult_steps=M     for M steps (default 10)
    perturb_at_step=N   after step N's update, add 1e-3 to one weight outside DDP
                        (a rank silently out of step, RELIABILITY D5)
    rank=R              only on rank R (default: every rank)
    once=PATH           fire the kill/raise/hang fault only if PATH does not exist, and
                        create it first: a restarted job (torchrun --max-restarts) then runs on

"Step N" is the optimizer step being computed (the checkpoint's step + 1). A skipped step
is attempted again with the next batch under the same number, so the NaN and OOM faults
count attempts. Each fault fires only the first time this process reaches its step: a
rollback that replays steps does not trigger it again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.training.state import StepHook

ENV = "AIAYN_FAULTS"
_INT_KEYS = {
    "kill_at_step",
    "term_at_step",
    "raise_at_step",
    "hang_at_step",
    "oom_at_step",
    "oom_times",
    "nan_at_step",
    "nan_times",
    "lr_mult_at_step",
    "lr_mult_steps",
    "perturb_at_step",
    "rank",
}
_KEYS = _INT_KEYS | {"nan_module", "lr_mult", "once"}


@dataclass
class Faults(StepHook):
    """The faults requested for this process (all off by default), fired from the trainer's
    step callbacks (`aiayn.training.state.StepHook`)."""

    spec: dict[str, Any]
    rank: int = 0

    @classmethod
    def from_env(cls, rank: int = 0) -> Faults:
        text = os.environ.get(ENV, "").strip()
        spec: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in _KEYS:
                raise ValueError(f"{ENV}: cannot parse {item!r}; keys: {', '.join(sorted(_KEYS))}")
            spec[key] = (
                int(value) if key in _INT_KEYS else (float(value) if key == "lr_mult" else value)
            )
        return cls(spec, rank)

    def __post_init__(self) -> None:
        self._fired: set[str] = set()
        self._counts = {"oom": self.spec.get("oom_times", 1), "nan": self.spec.get("nan_times", 1)}
        self._oom_now = self._nan_now = False
        self._step = 0

    @property
    def active(self) -> bool:
        return bool(self.spec) and self.spec.get("rank", self.rank) == self.rank

    def _due(self, name: str, step: int) -> bool:
        at = self.spec.get(f"{name}_at_step")
        if not self.active or at is None or step != at or name in self._fired:
            return False
        self._fired.add(name)
        return True

    def _attempt(self, name: str, step: int) -> bool:
        at = self.spec.get(f"{name}_at_step")
        if not self.active or at is None or step < at or self._counts[name] <= 0:
            return False
        self._counts[name] -= 1
        return True

    def _once(self) -> bool:
        marker = self.spec.get("once")
        if marker is None:
            return True
        try:
            Path(marker).touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    def begin_attempt(self, step: int) -> None:
        """Called as each attempt at step `step` starts: kill / raise / hang now, and decide
        whether this attempt runs out of memory or turns NaN."""
        if self._due("kill", step) and self._once():
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("term", step) and self._once():
            os.kill(os.getpid(), signal.SIGTERM)
        if self._due("raise", step) and self._once():
            raise RuntimeError(f"injected fault at step {step} on rank {self.rank}")
        if self._due("hang", step) and self._once():
            while True:
                time.sleep(3600)
        self._oom_now = self._attempt("oom", step)
        self._nan_now = self._attempt("nan", step)
        self._step = step

    def before_forward(self) -> None:
        """Raise an out-of-memory error, as a real one would arrive from the allocator."""
        if self._oom_now:
            self._oom_now = False
            raise torch.OutOfMemoryError(f"injected: out of memory at step {self._step}")

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._nan_now and "nan_module" not in self.spec:
            return loss * float("nan")
        return loss

    def lr_factor(self, step: int) -> float:
        at = self.spec.get("lr_mult_at_step")
        if not self.active or at is None or "lr_mult" in self._fired:
            return 1.0
        if at <= step < at + self.spec.get("lr_mult_steps", 10):
            return float(self.spec.get("lr_mult", 1.0))
        return 1.0

    def on_rollback(self) -> None:
        """After a rollback the replayed steps run at the normal learning rate."""
        self._fired.add("lr_mult")

    @torch.no_grad()
    def after_update(self, step: int, model: nn.Module) -> None:
        if self._due("perturb", step):
            next(model.parameters()).view(-1)[0] += 1e-3

    def install(self, model: nn.Module) -> None:
        """Make `nan_module`'s output NaN during the faulted attempts (and when the NaN
        detector re-runs the last one)."""
        name = self.spec.get("nan_module")
        if not self.active or name is None:
            return
        module = model.get_submodule(name)  # an unknown name fails here, at start-up

        def hook(_m: nn.Module, _inp: Any, out: Any) -> Any:
            if self._nan_now and isinstance(out, torch.Tensor):
                return out * float("nan")
            return out

        module.register_forward_hook(hook)
