"""Checkpoint averaging (section 6.1): the paper translates with the average of the last 5
(base) or 20 (big) checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.checkpoints.io import FORMAT, CheckpointError, load_checkpoint
from aiayn.checkpoints.run_dir import list_checkpoints

logger = logging.getLogger(__name__)


def list_last(run_dir: str | Path, k: int, *, strict: bool = True) -> list[Path]:
    """The last `k` numbered checkpoints of a run (the paper averages 5 for base, 20 for big).

    Args:
        strict: if False, a run with fewer than `k` (but at least one) gives all it has,
            with a warning: a short run still averages what it wrote.

    Raises:
        CheckpointError: fewer than `k` exist and `strict` (keep_last must be at least k),
            or none at all.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    found = list_checkpoints(run_dir)
    if len(found) < k and (strict or not found):
        raise CheckpointError(f"{run_dir}: asked for the last {k} checkpoints, found {len(found)}")
    if len(found) < k:
        logger.warning(
            "%s: averaging the %d checkpoints there are, not the last %d asked for",
            run_dir,
            len(found),
            k,
        )
    return found[-k:]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 is averaged in float64; fp32, bf16 and fp16 in float32 (I4)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tied(model: dict[str, Any]) -> dict[str, str]:
    """Each key -> the first key that holds the same tensor (shared embeddings, section 3.4)."""
    first: dict[tuple[Any, ...], str] = {}
    out = {}
    for key, t in model.items():
        if isinstance(t, Tensor) and t.numel() > 0:
            ident = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
            )
            out[key] = first.setdefault(ident, key)
        else:
            out[key] = key
    return out


def _model_config(ckpt: dict[str, Any]) -> Any:
    cfg = ckpt["config"]
    return cfg.get("model", cfg) if isinstance(cfg, dict) else cfg


def _run_identity(ckpt: dict[str, Any]) -> dict[str, Any]:
    """What makes checkpoints steps of one run: its seed (initial weights, batch order) and
    its training data. Absent from checkpoints that do not record them (averages keep
    them, written by hand they may not)."""
    out: dict[str, Any] = {}
    config = ckpt.get("config")
    train = config.get("train") if isinstance(config, dict) else None
    if isinstance(train, dict) and "seed" in train:
        out["seed"] = train["seed"]
    if ckpt.get("data_sha256") is not None:
        out["data_sha256"] = ckpt["data_sha256"]
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and bool(a == b)


class _Average:
    """Running element-wise mean of the models of several checkpoints, one file at a time.

    After k files, mean_k = mean_{k-1} + (x_k - mean_{k-1}) / k, computed in the
    accumulator dtype. Where x_k equals the mean the mean is left alone, so N copies of one
    checkpoint average to it bit for bit (I1), signed zeros included; summing and dividing
    would not: fl(fl(x + x) + x) / 3 can be 1 ulp off x. Integer and bool tensors are not
    averaged: they must be equal in all files and are kept (force=True keeps the last
    file's). Tied keys are averaged once and share the result.
    """

    def __init__(self, path: Path, ckpt: dict[str, Any]) -> None:
        model = ckpt["model"]
        self.path, self.count = path, 1
        self.tied = _tied(model)
        self.tensors = {
            k: (tuple(t.shape), t.dtype) for k, t in model.items() if isinstance(t, Tensor)
        }
        self.vocab, self.model_cfg = ckpt["vocab_sha256"], _model_config(ckpt)
        self.run = _run_identity(ckpt)
        self.values: dict[str, Any] = {}
        for key in dict.fromkeys(self.tied.values()):
            v = model[key]
            if isinstance(v, Tensor):
                v = v.to(
                    accumulator_dtype(v.dtype) if v.is_floating_point() else v.dtype, copy=True
                )
            self.values[key] = v

    def check(self, path: Path, ckpt: dict[str, Any], force: bool) -> None:
        """Refuse what cannot be averaged; refuse a mix of runs unless `force` (I3)."""
        model, ref = ckpt["model"], self.path.name
        for key in [*self.tied, *model]:
            if (key in self.tied) != (key in model):
                where = f"missing (present in {ref})" if key in self.tied else f"not in {ref}"
                raise CheckpointError(f"{path}: key {key!r} {where}")
        mixed = []
        for key, (shape, dtype) in self.tensors.items():
            t = model[key]
            if (
                not isinstance(t, Tensor)
                or tuple(t.shape) != shape
                or (t.is_floating_point() != dtype.is_floating_point)
            ):
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: key {key!r} is {got}, {shape} {dtype} in {ref}")
            if t.dtype != dtype:
                mixed.append(f"key {key!r} is {t.dtype}, {dtype} in {ref}")
        mixed += [
            f"key {k!r} is tied to {v!r}, to {self.tied[k]!r} in {ref}"
            for k, v in _tied(model).items()
            if v != self.tied[k]
        ]
        if ckpt["vocab_sha256"] != self.vocab:
            mixed.append(
                f"vocab_sha256 {ckpt['vocab_sha256']!r} differs from {ref}'s {self.vocab!r}"
            )
        cfg = _model_config(ckpt)
        if cfg != self.model_cfg:
            a, b = (c if isinstance(c, dict) else {"model": c} for c in (cfg, self.model_cfg))
            diff = sorted(str(k) for k in {*a, *b} if a.get(k) != b.get(k))
            mixed.append(f"config['model'] differs from {ref}'s in {', '.join(diff)}")
        run = _run_identity(ckpt)
        for key in ("seed", "data_sha256"):
            if key in run and key in self.run and run[key] != self.run[key]:
                mixed.append(
                    f"its {key} {run[key]!r} differs from {ref}'s {self.run[key]!r}: "
                    "independently trained models, whose average is no model at all"
                )
        if mixed and not force:
            raise CheckpointError(
                f"{path}: {mixed[0]}; averaging checkpoints of different runs "
                "needs force=True (--force)"
            )
        for what in mixed:
            logger.warning("%s: %s; averaged anyway (force)", path, what)

    def add(self, path: Path, ckpt: dict[str, Any], force: bool) -> None:
        self.check(path, ckpt, force)
        self.count += 1
        model = ckpt["model"]
        for key, mean in self.values.items():
            x = model[key]
            if isinstance(mean, Tensor) and mean.is_floating_point():
                x = x.to(mean.dtype)
                torch.where(x == mean, mean, mean + (x - mean) / self.count, out=mean)
            elif not _equal(x, mean):
                if not force:
                    raise CheckpointError(
                        f"{path}: key {key!r} differs from {self.path.name}; integer and bool "
                        "entries are not averaged, only kept when equal in all files"
                    )
                logger.warning("%s: key %r differs; keeping this file's (force)", path, key)
                self.values[key] = x.clone() if isinstance(x, Tensor) else x

    def model(self) -> dict[str, Any]:
        final = {
            k: v.to(self.tensors[k][1]) if isinstance(v, Tensor) else v
            for k, v in self.values.items()
        }
        return {key: final[rep] for key, rep in self.tied.items()}


def distinct_files(paths: Sequence[str | Path]) -> list[Path]:
    """`paths` without repeats of one file: the same path twice, or two names of one inode
    (`checkpoint_last.pt` is a hard link of the newest numbered checkpoint, so `run/*.pt`
    names it twice). Each repeat is said in a warning; the first name is kept."""
    seen: dict[tuple[int, int], Path] = {}
    out = []
    for p in (Path(x) for x in paths):
        try:
            st = p.stat()
            key = (st.st_dev, st.st_ino)
        except OSError:
            out.append(p)  # load_checkpoint names a missing file
            continue
        if key in seen:
            logger.warning(
                "%s is the same file as %s: averaged once, not weighted twice", p, seen[key]
            )
            continue
        seen[key] = p
        out.append(p)
    return out


def average_checkpoints(paths: Sequence[str | Path], *, force: bool = False) -> dict[str, Any]:
    """The element-wise mean of the models of `paths` (section 6.1), as a checkpoint dict.

    Streams: holds the running mean plus one loaded (memory-mapped) checkpoint (I5).
    Floating tensors are averaged in float64 if they are float64, else in float32, and cast
    back to their dtype (bf16/fp16 in, fp32 accumulation, bf16/fp16 out: I4).

    Returns:
        "format", "config", "vocab_sha256" (and "tokenizer") of the first file, "model",
        "step" of the last file and "averaged_from" (file names); no optimizer state.
    Raises:
        CheckpointError naming the file and key: different keys, shapes or floating/integer
            kinds (always), unequal integer tensors, or different dtype, tied layout,
            vocab_sha256 or config["model"] (unless `force`).
    """
    files = distinct_files(paths)
    if not files:
        raise ValueError("no checkpoints to average")
    first = load_checkpoint(files[0], mmap=True)
    avg = _Average(files[0], first)
    out: dict[str, Any] = {
        "format": FORMAT,
        "config": first["config"],
        "vocab_sha256": first["vocab_sha256"],
    }
    if first.get("data_sha256") is not None:  # the run's identity, for averaging averages
        out["data_sha256"] = first["data_sha256"]
    if isinstance(first.get("tokenizer"), Tensor):  # a copy: `first` is memory-mapped
        out["tokenizer"] = first["tokenizer"].clone()
    step = first["step"]
    # (step, run) of each file averaged: a copy of one is the same model, counted once
    seen = {(first["step"], repr(sorted(_run_identity(first).items()))): files[0]}
    if "averaged_from" in first or not _run_identity(first):
        seen.clear()
    del first  # I5: from here on, one loaded checkpoint at a time
    kept = [files[0]]
    for path in files[1:]:
        ckpt = load_checkpoint(path, mmap=True)
        key = (ckpt["step"], repr(sorted(_run_identity(ckpt).items())))
        if "averaged_from" not in ckpt and _run_identity(ckpt) and key in seen:
            logger.warning(
                "%s is step %d of the same run as %s (a copy): averaged once, not weighted twice",
                path,
                ckpt["step"],
                seen[key],
            )
            del ckpt
            continue
        if "averaged_from" not in ckpt and _run_identity(ckpt):
            seen[key] = path
        avg.add(path, ckpt, force)
        kept.append(path)
        step = ckpt["step"]
        del ckpt
    out.update(model=avg.model(), step=step, averaged_from=[p.name for p in kept])
    return out
