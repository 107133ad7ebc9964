"""Run directories: one trainer at a time (`RunLock`), numbered checkpoints with the newest
also as `checkpoint_last.pt` (a hard link), pruning, and finding the newest valid one to
resume from (RELIABILITY.md rows A9-A11, B1-B5)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from aiayn.checkpoints.io import (
    _NUMBERED,
    BEST_NAME,
    LAST_NAME,
    LOCK_NAME,
    CheckpointError,
    _check_structure,
    _save_file,
    _write_failed,
    load_checkpoint,
    sidecar_path,
)
from aiayn.files import fsync_dir, remove_stale_tmp, write_text_atomic

logger = logging.getLogger(__name__)

#: What a checkpoint needs to resume training from (an average has only the model).
TRAINING_KEYS = ("optimizer", "train_state")


def check_run_dir(run_dir: str | Path) -> Path:
    """Create `run_dir` if missing and prove it writable, before any training (A9).

    Raises:
        CheckpointError naming the directory.
    """
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create run directory {run_dir}: {e.strerror or e}") from e
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir} is not a directory")
    # os.access is not enough: root passes it on a read-only mount. Write for real.
    probe = run_dir / f".write_probe.{os.getpid()}.tmp"
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"run directory {run_dir} is not writable: {e.strerror or e}") from e
    return run_dir


class RunLock:
    """Context manager: the one trainer allowed to write into a run directory (A11).

    `trainer.lock` holds the owner's pid and is flock-ed while the trainer runs. The kernel
    drops the lock when the process dies, even by SIGKILL, so a stale file blocks nobody.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot create lock file {self.path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"run directory {self.run_dir} is in use by another trainer "
                f"(pid {holder}, lock file {self.path})"
            ) from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fd is not None:
            # The file stays: unlinking it would let a waiter lock an orphaned inode.
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The numbered checkpoints `checkpoint_<step>.pt` of a run, by increasing step."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in run_dir.iterdir()
        if (m := _NUMBERED.fullmatch(p.name)) and p.is_file()
    ]
    return [p for _, p in sorted(found)]


def _link_last(path: Path, digest: str) -> None:
    """Make `checkpoint_last.pt` the file at `path`: hard link to a temp name, rename over."""
    last = path.with_name(LAST_NAME)
    tmp = path.with_name(f".{LAST_NAME}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:  # a file system without hard links: copy instead
            shutil.copyfile(path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        sidecar_path(last).unlink(missing_ok=True)  # as in _save_file: never a stale manifest
        os.replace(tmp, last)
        fsync_dir(path.parent)
        write_text_atomic(sidecar_path(last), f"{digest}  {LAST_NAME}\n")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _write_failed(last, e) from e


def _prune(run_dir: Path, keep_last: int, newest: Path) -> None:
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old.name == newest.name:
            continue
        try:
            old.unlink()
            sidecar_path(old).unlink(missing_ok=True)
            logger.info("deleted %s (train.keep_last = %d)", old, keep_last)
        except OSError as e:  # A10: a file we cannot delete costs disk, not the run
            logger.warning(
                "could not delete old checkpoint %s (%s); continuing", old, e.strerror or e
            )


def save_checkpoint(run_dir: str | Path, ckpt: dict[str, Any], keep_last: int) -> Path:
    """Save `checkpoint_<step>.pt`, point `checkpoint_last.pt` at it, keep the last few.

    Args:
        keep_last: numbered checkpoints kept (the one just written is never deleted); older
            ones are deleted, and a failed delete is logged and ignored (A10).
    Returns:
        The path written.
    Raises:
        CheckpointError: see save_checkpoint_file. The trainer should stop on it.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    run_dir = Path(run_dir)
    _check_structure(ckpt, run_dir)
    path = run_dir / f"checkpoint_{ckpt['step']}.pt"
    digest = _save_file(path, ckpt)
    _link_last(path, digest)
    _prune(run_dir, keep_last, path)
    return path


def save_best_checkpoint(run_dir: str | Path, ckpt: dict[str, Any]) -> Path:
    """Write `checkpoint_best.pt` atomically, with its manifest, over the previous best.

    Not a numbered checkpoint: keep_last never deletes it, averaging (`list_last`) and
    resuming (`latest_valid_checkpoint`) never pick it up.
    Raises:
        CheckpointError: as save_checkpoint_file; the previous best is then intact.
    """
    path = Path(run_dir) / BEST_NAME
    _save_file(path, ckpt)
    return path


def latest_valid_checkpoint(
    run_dir: str | Path,
    map_location: str | torch.device = "cpu",
    *,
    clean: bool = True,
    require: tuple[str, ...] = (),
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run that loads and verifies (auto-resume, B1 and B3).

    With `clean`, removes temp files left by a killed writer (and orphaned manifests)
    first, so call it holding the RunLock; readers that do not own the directory (other
    ranks) pass clean=False.
    Numbered checkpoints are tried by decreasing step, `checkpoint_last.pt` after the newest
    of them; each one skipped is logged with its reason. `require`: keys a checkpoint must
    hold to count (resuming training needs TRAINING_KEYS: an average written over a
    checkpoint's name is skipped, and the next one down is used).

    Returns:
        (path, checkpoint), or None when the run has no checkpoint at all.
    Raises:
        CheckpointError: there are checkpoints but none is valid (starting afresh would
            silently throw the run away; the caller decides).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for tmp in remove_stale_tmp(run_dir) if clean else []:
        logger.info("removed stale temp file %s", tmp)
    for sidecar in run_dir.glob("checkpoint_*.pt.sha256") if clean else []:
        if not sidecar.with_suffix("").exists():  # left by a prune cut short
            sidecar.unlink(missing_ok=True)
    candidates = list_checkpoints(run_dir)[::-1]
    if (run_dir / LAST_NAME).is_file():
        # right after the newest numbered one: normally the same file (a hard link), it is
        # the newest state when that name was overwritten (say, by an average)
        candidates.insert(min(1, len(candidates)), run_dir / LAST_NAME)
    skipped: list[str] = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, map_location)
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint: %s", e)
            skipped.append(path.name)
            continue
        missing = [k for k in require if k not in ckpt]
        if missing:  # e.g. an average written over a training checkpoint's name
            logger.warning(
                "skipping %s: not a training checkpoint (no %s; an average or an export?)",
                path,
                " or ".join(missing),
            )
            skipped.append(path.name)
            continue
        if skipped:
            logger.warning("resuming from %s instead of newer invalid %s", path, ", ".join(skipped))
        return path, ckpt
    if skipped:
        raise CheckpointError(f"{run_dir}: no valid checkpoint among {', '.join(skipped)}")
    return None
