"""Training the members of an ensemble recipe side by side, each in a process of its own
with its share of the threads; a signal to the recipe reaches each member once."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aiayn.config import (
    Config,
    apply_overrides,
)
from aiayn.files import write_text_atomic
from aiayn.training.trainer import Hooks

if TYPE_CHECKING:
    from aiayn.training.trainer import TrainResult

log = logging.getLogger(__name__)


def train_summary(result: TrainResult) -> dict[str, Any]:
    """What the manifest keeps of one training run."""
    from aiayn.experiments.curves import read_log

    state = result.state
    return {
        "steps": state.step,
        "epochs": state.epoch,
        "tokens": state.tokens_seen,
        "train_seconds": state.train_seconds,
        "stopped_by": result.stopped_by,
        "best_valid_nll": state.best_valid_nll,
        "flops": state.flops,
        "last_valid": next(
            (h for h in reversed(read_log(result.run_dir)) if "valid_nll" in h), None
        ),
    }


#: What a member process leaves in its run directory for the recipe.
MEMBER_RESULT = "member_result.json"


def _train_member(
    cfg: Config, data_dir: Path, run_dir: Path, device: str, threads: int, log_level: int
) -> None:
    """One ensemble member, in a process of its own (the entry point of `train_members`)."""
    from aiayn.training.trainer import train

    os.setpgrp()  # a terminal's Ctrl-C reaches the recipe only, which passes it on once
    torch.set_num_threads(threads)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s {run_dir.name} %(name)s: %(message)s"
    )
    result = train(cfg, data_dir, run_dir, device=device)
    summary = {**train_summary(result), "seed": cfg.train.seed}
    write_text_atomic(run_dir / MEMBER_RESULT, json.dumps(summary) + "\n")


class _LogFollower:
    """Feeds the new records of a run's train_log.jsonl to the CLI's progress hooks."""

    def __init__(self, run_dir: Path, hooks: Hooks | None) -> None:
        self.path, self.hooks, self.offset = run_dir / "train_log.jsonl", hooks, 0

    def poll(self) -> None:
        if self.hooks is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self.offset += done
        for line in data[:done].decode("utf-8").splitlines():
            record = json.loads(line) if line.strip() else {}
            if "loss" in record and self.hooks.on_step is not None:
                self.hooks.on_step(record["step"], record)
            elif "valid_nll" in record and self.hooks.on_valid is not None:
                self.hooks.on_valid(record["step"], record)


def member_dirs(out: Path, k: int) -> list[Path]:
    """The run directories of an ensemble recipe's k members."""
    return [out / f"member{i + 1}" for i in range(k)]


def train_members(
    cfg: Config,
    data_dir: Path,
    out: Path,
    k: int,
    *,
    device: str = "cpu",
    hooks: Hooks | None = None,
) -> list[dict[str, Any]]:
    """Train k models of `cfg` at once into `member_dirs(out, k)`, with seeds
    train.seed, train.seed + 1, ..., each in a spawned process with 1/k of this process's
    threads (on a 2-core CPU two one-thread runs made more steps in all than one
    two-thread run in the same time; measured: docs/performance.md). Each member is an
    ordinary run directory, so a rerun resumes every member. SIGTERM and SIGINT (Ctrl-C)
    are passed on to the members, which finish their step, save and stop, as `aiayn
    train` does (a second Ctrl-C stops them at once); the recipe then goes on with what
    they saved, as after a single run. The progress hooks follow member 1.

    Returns:
        Each member's `train_summary`, with its "seed".
    Raises:
        TrainingError naming the members whose process failed (their errors are logged).
    """
    from aiayn.training.trainer import TrainingError

    threads = max(1, torch.get_num_threads() // k)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked thread pools
    dirs = member_dirs(out, k)
    procs = []
    for i, run_dir in enumerate(dirs):
        (run_dir / MEMBER_RESULT).unlink(missing_ok=True)
        member_cfg = apply_overrides(cfg, {"train.seed": cfg.train.seed + i})
        proc = ctx.Process(
            target=_train_member,
            name=f"aiayn-{run_dir.name}",
            daemon=True,
            args=(
                member_cfg,
                data_dir,
                run_dir,
                device,
                threads,
                logging.getLogger().getEffectiveLevel(),
            ),
        )
        proc.start()
        procs.append(proc)
        log.info("%s: seed %d, %d thread(s)", run_dir.name, member_cfg.train.seed, threads)

    def forward(signum: int, frame: Any) -> None:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):  # not the main thread: no handler
            old[sig] = signal.signal(sig, forward)
    follow = _LogFollower(dirs[0], hooks)
    try:
        while alive := [proc.sentinel for proc in procs if proc.is_alive()]:
            wait_for(alive, timeout=2)  # back at once when a member ends
            follow.poll()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    follow.poll()
    failed = [
        f"{d} (exit code {p.exitcode})"
        for d, p in zip(dirs, procs, strict=True)
        if p.exitcode != 0 or not (d / MEMBER_RESULT).exists()
    ]
    if failed:
        raise TrainingError(
            f"ensemble member training failed: {', '.join(failed)}; its "
            "error is logged above; rerunning the recipe resumes each member"
        )
    return [json.loads((d / MEMBER_RESULT).read_text(encoding="utf-8")) for d in dirs]
