"""The stages every recipe shares, translation's and parsing's: train, average, plot, and
the matmul ceiling for the FLOPs estimate."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config, TrainConfig
from aiayn.experiments.members import member_dirs, train_members, train_summary
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.training.trainer import Hooks

log = logging.getLogger(__name__)


class RecipeStoppedError(Exception):
    """Training stopped on a signal (SIGTERM, or Ctrl-C): the recipe stops with it, having
    saved; the same command resumes. `signal_name` is "SIGTERM" or "SIGINT"."""

    def __init__(self, signal_name: str, step: int, out: Path) -> None:
        super().__init__(
            f"training stopped by {signal_name} at step {step}, saved; the recipe stops here "
            f"(no averaging or decoding of an unfinished model): rerun the same command to "
            f"resume {out}"
        )
        self.signal_name = signal_name
        self.step = step
        self.out = out

    def __reduce__(self) -> tuple[Any, ...]:
        # raised in a worker process (`aiayn table3 --jobs`), it crosses to the parent by
        # pickle; the default rebuilds it from the message alone, which this __init__
        # refuses, and a result that cannot be read breaks the whole process pool
        return (type(self), (self.signal_name, self.step, self.out), self.__dict__)


def matmul_peak_for(cfg: Config, device: str) -> tuple[float, torch.dtype]:
    """The matmul ceiling for Table 2's FLOPs estimate, measured before training (measured
    after it in the same process, it came out lower on the CPU)."""
    from aiayn.fast import machine
    from aiayn.fast.flops import matmul_peak
    from aiayn.fast.machine import slow_bf16_warning
    from aiayn.training.precision import resolve_dtype

    dtype = resolve_dtype(cfg.train.dtype, device)
    peak_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if dtype == "bf16" and slow_bf16_warning(device):
        # emulated bf16 (the trainer says so next): the 2048^3 products would take minutes
        return machine.probe().train_bf16 * 1e9, peak_dtype
    return matmul_peak(peak_dtype, device=device), peak_dtype


def train_stage(
    recipe: RecipeConfig,
    cfg: Config,
    prepared: Path,
    out: Path,
    device: str,
    hooks: Hooks | None,
) -> tuple[list[Path], list[dict[str, Any]]]:
    """Train the model (or the ensemble's members): their run directories and summaries."""
    from aiayn.training.trainer import train

    if recipe.ensemble == 1:
        return [out], [train_summary(train(cfg, prepared, out, device=device, hooks=hooks))]
    runs = member_dirs(out, recipe.ensemble)
    return runs, train_members(cfg, prepared, out, recipe.ensemble, device=device, hooks=hooks)


def average_window(paths: list[Path], train: TrainConfig | None, k: int) -> list[Path]:
    """The checkpoints of `paths` (a run's last ones, by step) that a run stopped short of
    max_steps still averages: those in the same share of its steps as the recipe's window
    is of a whole run (k = average_last x save_interval_steps of max_steps; the En->De
    recipe's 10 x 200 of 13,000 is its last 15%), the newest always. A 10-minute run that
    stops at step 1,056 then averages its checkpoints from step 894 on (1,000 and 1,056)
    rather than the 200-1,056 of ten 200-step checkpoints, most of them from before the
    model could translate (test tok-BLEU 12.2 with those; measured: docs/results.md, "The
    quickstart"). A whole run, or one saved by minutes, keeps `paths` as they are."""
    if train is None or not paths or train.save_interval_steps <= 0 or train.max_steps <= 0:
        return paths
    steps = [int(p.stem.rsplit("_", 1)[1]) for p in paths]
    last = steps[-1]
    if last >= train.max_steps:
        return paths
    share = min(1.0, k * train.save_interval_steps / train.max_steps)
    start = last * (1 - share)
    kept = [p for p, s in zip(paths, steps, strict=True) if s >= start] or paths[-1:]
    if len(kept) < len(paths):
        log.info(
            "averaging the %d checkpoints from step %d on (of the last %d): the run stopped at "
            "step %d of %d, so its last %.0f%% of steps, the share the whole run's window is",
            len(kept),
            int(kept[0].stem.rsplit("_", 1)[1]),
            len(paths),
            last,
            train.max_steps,
            100 * share,
        )
    return kept


def average_stage(
    recipe: RecipeConfig, runs: list[Path], train: TrainConfig | None = None
) -> list[list[str]]:
    """Average each run's last checkpoints into its checkpoint_avg.pt (`recipe.average_last`,
    within `average_window` where `train` is given): the names averaged."""
    from aiayn.checkpoints import average_checkpoints, list_last, save_checkpoint_file

    averaged = []
    for run in runs:
        last = list_last(run, recipe.average_last, strict=False)
        paths = average_window(last, train, recipe.average_last)
        save_checkpoint_file(run / "checkpoint_avg.pt", average_checkpoints(paths))
        averaged.append([p.name for p in paths])
    return averaged


def plot_runs(
    out: Path, runs: list[Path], trained: list[dict[str, Any]], pair: str, title: str
) -> None:
    from aiayn.experiments.curves import plot_curves

    try:
        labels: dict[str, str | Path] = (
            {pair: out}
            if len(runs) == 1
            else {
                f"{pair} {run.name} (seed {t['seed']})": run
                for run, t in zip(runs, trained, strict=True)
            }
        )
        plot_curves(labels, out / "curve.png", title=title)
    except ImportError:
        log.info("matplotlib is not installed (pip install 'aiayn[plot]'): no curve.png")


def check_stopped(trained: list[dict[str, Any]], out: Path) -> None:
    """Raise RecipeStoppedError if a signal stopped training: the later stages need a
    finished model."""
    for t in trained:
        if t["stopped_by"] in ("SIGTERM", "SIGINT"):
            raise RecipeStoppedError(t["stopped_by"], t["steps"], out)


@dataclass
class Trained:
    """What `train_and_average` leaves for decoding: the run directories, their training
    summaries and averaged checkpoint names, the averaged models (as one decoder), their
    vocabulary and config, and the matmul ceiling measured before training."""

    runs: list[Path]
    trained: list[dict[str, Any]]
    averaged: list[list[str]]
    models: list[Any]
    model: Any
    tokenizer: Any
    cfg: Config
    peak: float
    peak_dtype: torch.dtype


def train_and_average(
    recipe: RecipeConfig,
    cfg: Config,
    prepared: Path,
    out: Path,
    device: str,
    hooks: Hooks | None,
    wall: dict[str, float],
) -> Trained:
    """Every recipe's middle: measure the matmul peak, train (or resume), stop on a signal,
    average each run's last checkpoints and load them as one decoder; the stages' wall
    times go into `wall` (train_s, average_s)."""
    from aiayn.checkpoints import load_ensemble
    from aiayn.decoding.ensemble import as_decoder

    peak, peak_dtype = matmul_peak_for(cfg, device)
    t0 = time.perf_counter()
    runs, trained = train_stage(recipe, cfg, prepared, out, device, hooks)
    wall["train_s"] = time.perf_counter() - t0
    check_stopped(trained, out)
    t0 = time.perf_counter()
    averaged = average_stage(recipe, runs, cfg.train)
    models, tokenizer, avg_cfg = load_ensemble(
        [run / "checkpoint_avg.pt" for run in runs], device=device
    )
    wall["average_s"] = time.perf_counter() - t0
    return Trained(
        runs, trained, averaged, models, as_decoder(models), tokenizer, avg_cfg, peak, peak_dtype
    )
