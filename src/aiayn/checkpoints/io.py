"""The checkpoint file (section 6.1): self-describing, verified, written atomically.

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
import hashlib
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
from torch import Tensor

from aiayn import speed
from aiayn.files import atomic_write, output_kind, sha256_file, write_text_atomic

if TYPE_CHECKING:
    from aiayn.config import Config
    from aiayn.data.tokenizer import Vocabulary
    from aiayn.model import Transformer

logger = logging.getLogger(__name__)

FORMAT = "aiayn-checkpoint-1"
REQUIRED_KEYS = ("format", "config", "vocab_sha256", "model", "step")
LAST_NAME = "checkpoint_last.pt"
#: The best validation's weights (train.best_metric): not numbered, so never pruned
BEST_NAME = "checkpoint_best.pt"
LOCK_NAME = "trainer.lock"
_NUMBERED = re.compile(r"checkpoint_(\d+)\.pt")
_WRITE_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EFBIG: "file too large (file size limit reached)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}
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
        raise CheckpointError(
            f"{where} is of type {type(obj).__module__}."
            f"{type(obj).__qualname__}; "
            "checkpoints hold only tensors and plain values (weights_only)"
        )
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
        raise CheckpointError(
            f"{path}: not an aiayn checkpoint (format {ckpt.get('format')!r}, expected {FORMAT!r})"
        )
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: malformed checkpoint, no {', '.join(missing)}")
    if not isinstance(ckpt["model"], dict) or type(ckpt["step"]) is not int:
        raise CheckpointError(
            f"{path}: malformed checkpoint ('model' must be a dict and 'step' an int)"
        )


#: The digest of a checkpoint's content that the file carries inside itself (B3 without the
#: manifest beside it: a checkpoint copied alone to another machine still verifies).
INTEGRITY_KEY = "integrity"
INTEGRITY_ALGORITHM = "sha256 of each top-level value, tensors by dtype, shape and bytes"


def content_digests(ckpt: dict[str, Any]) -> dict[str, str]:
    """The sha256 of each top-level value of a checkpoint, as `_hash_value` walks it: the
    same before `torch.save` and after `torch.load` (dict keys sorted, lists and tuples
    alike, tensors as dtype, shape and raw bytes)."""
    out = {}
    for key in sorted(ckpt, key=str):
        if key != INTEGRITY_KEY:
            h = hashlib.sha256()
            _hash_value(ckpt[key], h)
            out[str(key)] = h.hexdigest()
    return out


def _hash_value(value: Any, h: Any) -> None:
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for k in sorted(value, key=str):
            h.update(f"K{k!r}".encode())
            _hash_value(value[k], h)
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _hash_value(v, h)
    else:
        h.update(f"V{value!r}".encode())


def _check_integrity(ckpt: dict[str, Any], path: Path, keys: Sequence[str] | None) -> None:
    """Compare the content with the digests stored inside the file (`keys`: only these
    values, e.g. the model when averaging maps a checkpoint's tensors lazily)."""
    stored = ckpt.get(INTEGRITY_KEY)
    if stored is None:
        return  # written before checkpoints carried one; the manifest is the only check
    digests = stored.get("sha256") if isinstance(stored, dict) else None
    if not isinstance(digests, dict):
        raise CheckpointError(f"{path}: malformed {INTEGRITY_KEY!r} entry: the file is corrupt")
    names = [k for k in ckpt if k != INTEGRITY_KEY]
    if sorted(map(str, names)) != sorted(digests):
        raise CheckpointError(
            f"{path}: its keys differ from those its digest was computed over: the file is "
            "corrupt or was edited"
        )
    for key in names if keys is None else [k for k in keys if k in names]:
        h = hashlib.sha256()
        _hash_value(ckpt[key], h)
        if h.hexdigest() != digests[str(key)]:
            raise CheckpointError(
                f"{path}: {key!r} does not match the sha256 stored inside the file: the "
                "file is corrupt (a flipped bit, a partial copy)"
            )


def _check_finite(ckpt: dict[str, Any], path: Path) -> None:
    for key, value in ckpt["model"].items():
        if (
            isinstance(value, Tensor)
            and value.is_floating_point()
            and not bool(torch.isfinite(value).all())
        ):
            raise CheckpointError(
                f"{path}: model tensor {key!r} holds NaN or inf: refusing a model that "
                "can only translate to garbage"
            )


def _write_failed(path: Path, e: OSError) -> CheckpointError:
    reason = _WRITE_REASONS.get(e.errno or 0) or (os.strerror(e.errno) if e.errno else str(e))
    return CheckpointError(f"checkpoint write failed: {path}: {reason}")


def _save_file(path: Path, ckpt: dict[str, Any]) -> str:
    """save_checkpoint_file, returning the sha256 of the bytes written."""
    _check_structure(ckpt, path)
    _check_plain(ckpt, "checkpoint")
    bad = [
        k
        for k, t in ckpt["model"].items()
        if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:  # C3: keep the last good checkpoint rather than overwrite it with NaN
        raise CheckpointError(
            f"refusing to save {path}: non-finite values in model tensor(s) "
            f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        )
    ckpt = {
        **{k: v for k, v in ckpt.items() if k != INTEGRITY_KEY},
        INTEGRITY_KEY: {"algorithm": INTEGRITY_ALGORITHM, "sha256": content_digests(ckpt)},
    }
    kind = output_kind(path)
    # a device or FIFO (`average --out /dev/null`) is written in place, with no manifest
    # beside it (it carries its digest inside); a symlink is written through to its target
    in_place = kind in ("stdout", "stream")
    if kind == "symlink":
        path = Path(os.path.realpath(path))
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
            if in_place:
                return writer.sha.hexdigest()
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


def _verify(path: Path) -> bool:
    """Check `path` against its manifest; False when it has none."""
    sidecar = sidecar_path(path)
    if not sidecar.exists():
        return False
    try:
        words = sidecar.read_bytes().decode("utf-8", errors="replace").split()
        actual = sha256_file(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it or its manifest {sidecar.name}: {e}") from e
    expected = words[0].lower() if words else ""
    if not re.fullmatch(r"[0-9a-f]{64}", expected):
        # something else was written over the manifest (an output path that named it):
        # the checkpoint may be intact, and it carries its own digest, checked at every load
        seen = " ".join(words)[:40] if words else "empty"
        raise CheckpointError(
            f"{sidecar}: the manifest of {path.name} is damaged (not a sha256 line: "
            f"{seen!r}); the checkpoint carries its own digest: remove {sidecar.name} to load it "
            f"checked by that alone, or restore the manifest (`sha256sum {path.name} > "
            f"{sidecar.name}` if you trust the file)"
        )
    if actual != expected:
        raise CheckpointError(
            f"{path}: sha256 mismatch (file {actual[:16]}..., manifest "
            f"{expected[:16]}...): the file is corrupt"
        )
    return True


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`, after checking it against its manifest.

    The file is checked twice: against its manifest `<name>.sha256` when there is one,
    and always against the digest it carries inside itself (`content_digests`); its model
    must be finite.

    Args:
        mmap: map tensor data instead of reading it (averaging uses this to read only the
            model of a checkpoint that also holds optimizer state: then only the model and
            the small values are checked against the inner digest).
    Raises:
        CheckpointError naming `path`: missing, empty, truncated or corrupt file, sha256
            mismatch (manifest or inner digest), non-finite model weights, or not an aiayn
            checkpoint. A missing manifest is only a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes)")
    manifest = _verify(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path}: unreadable, truncated or corrupt checkpoint ({type(e).__name__}: {why})"
        ) from e
    _check_structure(ckpt, path)
    if not manifest and INTEGRITY_KEY not in ckpt:
        logger.warning(
            "%s: no %s manifest and no digest inside (an older checkpoint): loading it unverified",
            path,
            sidecar_path(path).name,
        )
    light = None if not mmap else [k for k in ckpt if k not in ("optimizer",)]
    _check_integrity(ckpt, path, light)
    _check_finite(ckpt, path)
    ckpt.pop(INTEGRITY_KEY, None)  # a detail of the file: the caller gets what was saved
    return ckpt


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    fast: bool = True,
) -> tuple[Transformer, Vocabulary, Config]:
    """The model, its vocabulary and config from one checkpoint, ready to translate.

    `fast`: with the speed paths where they are on (`aiayn.speed.accelerate`: the ones
    `aiayn.fast` registers), as decoding wants it; False gives the paper's model alone.

    Returns:
        (Transformer in eval mode on `device`, Tokenizer, Config).
    Raises:
        CheckpointError naming `path`: see load_checkpoint; also a config, vocabulary or
            state dict that does not fit.
    """
    from aiayn.config import Config, ConfigError
    from aiayn.data.tokenizer import vocabulary_from_bytes
    from aiayn.files import InputError
    from aiayn.model import Transformer

    path = Path(path)
    ckpt = load_checkpoint(path)
    try:
        cfg = Config.from_dict(ckpt["config"])
        tok = ckpt.get("tokenizer")
        if not isinstance(tok, Tensor):
            raise CheckpointError("it holds no vocabulary ('tokenizer')")
        # one shared vocabulary, or a source and a target one (prepare --vocab separate)
        tokenizer = vocabulary_from_bytes(tok.numpy().tobytes(), origin=f"{path}: 'tokenizer'")
        if tokenizer.sha256 != ckpt["vocab_sha256"]:
            raise CheckpointError("its vocabulary does not match its vocab_sha256")
        model = Transformer(cfg.model)
        model.load_state_dict(ckpt["model"])
        if fast:
            model = speed.accelerate(model, pack_padding=True, cpu_kernels=True)
    except (CheckpointError, ConfigError, InputError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot build the model: {e}") from e
    return model.to(device).eval(), tokenizer, cfg


def load_ensemble(
    paths: Sequence[str | Path],
    device: str | torch.device = "cpu",
) -> tuple[list[Transformer], Vocabulary, Config]:
    """The models of several checkpoints that can decode as one (`aiayn.decoding.ensemble`), their
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
            raise CheckpointError(
                f"{path}: its vocabulary (sha256 {tok.sha256[:12]}...) "
                f"differs from {paths[0]}'s ({tokenizer.sha256[:12]}...): "
                "an ensemble's members must share one vocabulary"
            )
        models.append(model)
    assert tokenizer is not None and cfg is not None
    return models, tokenizer, cfg
