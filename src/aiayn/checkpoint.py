"""Checkpoints (section 6.1): self-describing files, run directories, and averaging.

The paper writes a checkpoint every 10 minutes and translates with the average of the last
5 (base) or 20 (big) of them. What a checkpoint must survive is listed in
RELIABILITY.md, rows A9-A11, B1-B5, C3 and I1-I5:

- A checkpoint is a plain dict ("format", "config", "vocab_sha256", "model", "step", and
  whatever else the trainer adds) of tensors and plain values, so that
  `torch.load(weights_only=True)` reads it (B5); `save_checkpoint_file` refuses anything
  else, and refuses a model with NaN or inf in it (C3).
- It is streamed through a hash into a temp file, fsynced and renamed over its name
  (files.atomic_write), so a crash leaves the old file or the new one (B1, B4). A write
  error such as ENOSPC or EFBIG becomes a CheckpointError saying so, with the old file
  intact (B2). Then a manifest `<name>.sha256` (sha256sum format) is written: the only way
  to catch a flipped byte inside tensor data, which torch loads without complaint (B3).
- A run directory holds `checkpoint_<step>.pt`, the newest also as `checkpoint_last.pt`
  (a hard link), and `trainer.lock`, flock-ed by the one trainer allowed to write there.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import torch
from torch import Tensor

from aiayn.files import atomic_write, fsync_dir, remove_stale_tmp, sha256_file, write_text_atomic

if TYPE_CHECKING:
    from aiayn.config import Config
    from aiayn.model import Transformer
    from aiayn.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FORMAT = "aiayn-checkpoint-1"
REQUIRED_KEYS = ("format", "config", "vocab_sha256", "model", "step")
LAST_NAME = "checkpoint_last.pt"
LOCK_NAME = "trainer.lock"
_NUMBERED = re.compile(r"checkpoint_(\d+)\.pt")
_WRITE_REASONS = {errno.ENOSPC: "no space left on device",
                  errno.EFBIG: "file too large (file size limit reached)",
                  errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system"}
# What weights_only=True unpickles; anything else would save fine and fail to load (B5).
_PLAIN_SCALARS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple, torch.Size)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or averaged; the message names the file."""


def sidecar_path(path: str | Path) -> Path:
    """The sha256 manifest of a checkpoint: `<name>.sha256` beside it."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


# --------------------------------------------------------------------------- one file
class _HashingWriter:
    """What torch.save writes into: hashes the bytes on their way to the file.

    torch turns an error raised by `write` into "[enforce fail at inline_container.cc...]
    unexpected pos", or misses it; the first OSError is kept here for the caller to re-raise.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        if self.error is not None:
            return 0
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        return n

    def flush(self) -> None:
        if self.error is None:
            self.f.flush()


def _check_plain(obj: Any, where: str) -> None:
    if isinstance(obj, Tensor) or type(obj) in _PLAIN_SCALARS:
        return
    if type(obj) not in _PLAIN_CONTAINERS:
        raise CheckpointError(f"{where} is of type {type(obj).__module__}."
                              f"{type(obj).__qualname__}; "
                              "checkpoints hold only tensors and plain values (weights_only)")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise CheckpointError(f"{where} has a key of type {type(key).__name__}")
            _check_plain(value, f"{where}[{key!r}]")
    else:
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")


def _check_structure(ckpt: Any, path: Path) -> None:
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: a checkpoint is a dict, got {type(ckpt).__name__}")
    if ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an aiayn checkpoint (format {ckpt.get('format')!r}, "
                              f"expected {FORMAT!r})")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: malformed checkpoint, no {', '.join(missing)}")
    if not isinstance(ckpt["model"], dict) or type(ckpt["step"]) is not int:
        raise CheckpointError(f"{path}: malformed checkpoint ('model' must be a dict and "
                              "'step' an int)")


def _write_failed(path: Path, e: OSError) -> CheckpointError:
    reason = _WRITE_REASONS.get(e.errno or 0) or (os.strerror(e.errno) if e.errno else str(e))
    return CheckpointError(f"checkpoint write failed: {path}: {reason}")


def _save_file(path: Path, ckpt: dict[str, Any]) -> str:
    """save_checkpoint_file, returning the sha256 of the bytes written."""
    _check_structure(ckpt, path)
    _check_plain(ckpt, "checkpoint")
    bad = [k for k, t in ckpt["model"].items() if isinstance(t, Tensor)
           and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # C3: keep the last good checkpoint rather than overwrite it with NaN
        raise CheckpointError(f"refusing to save {path}: non-finite values in model tensor(s) "
                              f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    try:
        with atomic_write(path) as f:
            writer = _HashingWriter(f)
            try:
                torch.save(ckpt, writer)  # type: ignore[arg-type]
            except Exception as e:
                if writer.error is not None:
                    raise writer.error from e
                raise
            if writer.error is not None:  # torch does not always notice a failed write
                raise writer.error
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, while the old manifest still stands
            # The old manifest must not outlive the old bytes: with none, the new file still
            # loads (unverified) if we crash before the new manifest is written.
            sidecar_path(path).unlink(missing_ok=True)
        digest = writer.sha.hexdigest()
        write_text_atomic(sidecar_path(path), f"{digest}  {path.name}\n")  # B3: after the file
    except OSError as e:
        raise _write_failed(path, e) from e
    return digest


def save_checkpoint_file(path: str | Path, ckpt: dict[str, Any]) -> None:
    """Write `ckpt` to `path` atomically, then its manifest `<name>.sha256`.

    Raises:
        CheckpointError: the model holds NaN/inf (C3), the dict holds something that
            `torch.load(weights_only=True)` would refuse (B5), or the write failed ("no space
            left on device", "file too large", ...); the previous file at `path` is intact
            and no temp file remains (B2).
    """
    _save_file(Path(path), ckpt)


def _verify(path: Path) -> None:
    sidecar = sidecar_path(path)
    if not sidecar.exists():
        logger.warning("%s: no %s manifest, loading it unverified", path, sidecar.name)
        return
    try:
        expected = sidecar.read_text(encoding="utf-8").split()[0].lower()
        actual = sha256_file(path)
    except (OSError, UnicodeDecodeError, IndexError) as e:
        raise CheckpointError(f"{path}: cannot read it or its manifest {sidecar.name}: {e}") from e
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        raise CheckpointError(f"{path}: malformed manifest {sidecar.name}")
    if actual != expected:
        raise CheckpointError(f"{path}: sha256 mismatch (file {actual[:16]}..., manifest "
                              f"{expected[:16]}...): the file is corrupt")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`, after checking it against its manifest.

    Args:
        mmap: map tensor data instead of reading it (averaging uses this to read only the
            model of a checkpoint that also holds optimizer state).
    Raises:
        CheckpointError naming `path`: missing, empty, truncated or corrupt file, sha256
            mismatch, or not an aiayn checkpoint. A missing manifest is only a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes)")
    _verify(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: unreadable, truncated or corrupt checkpoint "
                              f"({type(e).__name__}: {why})") from e
    _check_structure(ckpt, path)
    return ckpt


def load_model(path: str | Path, device: str | torch.device = "cpu",
               ) -> tuple[Transformer, Tokenizer, Config]:
    """The model, its vocabulary and config from one checkpoint, ready to translate.

    Returns:
        (Transformer in eval mode on `device`, Tokenizer, Config).
    Raises:
        CheckpointError naming `path`: see load_checkpoint; also a config, vocabulary or
            state dict that does not fit.
    """
    from aiayn.config import Config, ConfigError
    from aiayn.files import InputError
    from aiayn.model import Transformer
    from aiayn.tokenizer import Tokenizer

    path = Path(path)
    ckpt = load_checkpoint(path)
    try:
        cfg = Config.from_dict(ckpt["config"])
        tok = ckpt.get("tokenizer")
        if not isinstance(tok, Tensor):
            raise CheckpointError("it holds no vocabulary ('tokenizer')")
        tokenizer = Tokenizer(tok.numpy().tobytes(), origin=f"{path}: 'tokenizer'")
        if tokenizer.sha256 != ckpt["vocab_sha256"]:
            raise CheckpointError("its vocabulary does not match its vocab_sha256")
        model = Transformer(cfg.model)
        model.load_state_dict(ckpt["model"])
    except (CheckpointError, ConfigError, InputError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot build the model: {e}") from e
    return model.to(device).eval(), tokenizer, cfg


def load_ensemble(paths: Sequence[str | Path], device: str | torch.device = "cpu",
                  ) -> tuple[list[Transformer], Tokenizer, Config]:
    """The models of several checkpoints that can decode as one (`aiayn.ensemble`), their
    shared vocabulary, and the first one's config (its decoding options).

    Raises:
        CheckpointError naming the files: see load_model; also members whose vocabularies
            differ (their token ids would not mean the same subwords).
    """
    if not paths:
        raise CheckpointError("no checkpoint given")
    models, tokenizer, cfg = [], None, None
    for path in paths:
        model, tok, c = load_model(path, device)
        if tokenizer is None:
            tokenizer, cfg = tok, c
        elif tok.sha256 != tokenizer.sha256:
            raise CheckpointError(f"{path}: its vocabulary (sha256 {tok.sha256[:12]}...) "
                                  f"differs from {paths[0]}'s ({tokenizer.sha256[:12]}...): "
                                  "an ensemble's members must share one vocabulary")
        models.append(model)
    assert tokenizer is not None and cfg is not None
    return models, tokenizer, cfg


# --------------------------------------------------------------------------- run directory
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
            raise CheckpointError(f"run directory {self.run_dir} is in use by another trainer "
                                  f"(pid {holder}, lock file {self.path})") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
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
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if (m := _NUMBERED.fullmatch(p.name)) and p.is_file()]
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
        except OSError as e:  # A10: a file we cannot delete costs disk, not the run
            logger.warning("could not delete old checkpoint %s (%s); continuing", old,
                           e.strerror or e)


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


def latest_valid_checkpoint(run_dir: str | Path, map_location: str | torch.device = "cpu",
                            *, clean: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run that loads and verifies (auto-resume, B1 and B3).

    With `clean`, removes temp files left by a killed writer (and orphaned manifests)
    first, so call it holding the RunLock; readers that do not own the directory (other
    ranks) pass clean=False.
    Numbered checkpoints are tried by decreasing step, then `checkpoint_last.pt`; each one
    skipped is logged with its reason.

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
        candidates.append(run_dir / LAST_NAME)
    skipped: list[str] = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path, map_location)
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint: %s", e)
            skipped.append(path.name)
            continue
        if skipped:
            logger.warning("resuming from %s instead of newer invalid %s", path,
                           ", ".join(skipped))
        return path, ckpt
    if skipped:
        raise CheckpointError(f"{run_dir}: no valid checkpoint among {', '.join(skipped)}")
    return None


# --------------------------------------------------------------------------- averaging (6.1)
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
        logger.warning("%s: averaging the %d checkpoints there are, not the last %d asked for",
                    run_dir, len(found), k)
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
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                     t.stride(), t.dtype)
            out[key] = first.setdefault(ident, key)
        else:
            out[key] = key
    return out


def _model_config(ckpt: dict[str, Any]) -> Any:
    cfg = ckpt["config"]
    return cfg.get("model", cfg) if isinstance(cfg, dict) else cfg


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
        self.tensors = {k: (tuple(t.shape), t.dtype) for k, t in model.items()
                        if isinstance(t, Tensor)}
        self.vocab, self.model_cfg = ckpt["vocab_sha256"], _model_config(ckpt)
        self.values: dict[str, Any] = {}
        for key in dict.fromkeys(self.tied.values()):
            v = model[key]
            if isinstance(v, Tensor):
                v = v.to(accumulator_dtype(v.dtype) if v.is_floating_point() else v.dtype,
                         copy=True)
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
            if not isinstance(t, Tensor) or tuple(t.shape) != shape or (
                    t.is_floating_point() != dtype.is_floating_point):
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: key {key!r} is {got}, {shape} {dtype} in {ref}")
            if t.dtype != dtype:
                mixed.append(f"key {key!r} is {t.dtype}, {dtype} in {ref}")
        mixed += [f"key {k!r} is tied to {v!r}, to {self.tied[k]!r} in {ref}"
                  for k, v in _tied(model).items() if v != self.tied[k]]
        if ckpt["vocab_sha256"] != self.vocab:
            mixed.append(f"vocab_sha256 {ckpt['vocab_sha256']!r} differs from {ref}'s "
                         f"{self.vocab!r}")
        cfg = _model_config(ckpt)
        if cfg != self.model_cfg:
            a, b = (c if isinstance(c, dict) else {"model": c} for c in (cfg, self.model_cfg))
            diff = sorted(str(k) for k in {*a, *b} if a.get(k) != b.get(k))
            mixed.append(f"config['model'] differs from {ref}'s in {', '.join(diff)}")
        if mixed and not force:
            raise CheckpointError(f"{path}: {mixed[0]}; averaging checkpoints of different runs "
                                  "needs force=True (--force)")
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
                        "entries are not averaged, only kept when equal in all files")
                logger.warning("%s: key %r differs; keeping this file's (force)", path, key)
                self.values[key] = x.clone() if isinstance(x, Tensor) else x

    def model(self) -> dict[str, Any]:
        final = {k: v.to(self.tensors[k][1]) if isinstance(v, Tensor) else v
                 for k, v in self.values.items()}
        return {key: final[rep] for key, rep in self.tied.items()}


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
    files = [Path(p) for p in paths]
    if not files:
        raise ValueError("no checkpoints to average")
    first = load_checkpoint(files[0], mmap=True)
    avg = _Average(files[0], first)
    out: dict[str, Any] = {"format": FORMAT, "config": first["config"],
                           "vocab_sha256": first["vocab_sha256"]}
    if isinstance(first.get("tokenizer"), Tensor):  # a copy: `first` is memory-mapped
        out["tokenizer"] = first["tokenizer"].clone()
    step = first["step"]
    del first  # I5: from here on, one loaded checkpoint at a time
    for path in files[1:]:
        ckpt = load_checkpoint(path, mmap=True)
        avg.add(path, ckpt, force)
        step = ckpt["step"]
        del ckpt
    out.update(model=avg.model(), step=step, averaged_from=[p.name for p in files])
    return out
