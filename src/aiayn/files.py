"""Reading text and writing files safely: the two places where data is silently lost elsewhere.

- Lines are split on b"\\n" only, so counts agree with `wc -l` (a stray \\r, U+2028 or NUL
  inside a line stays inside it); invalid UTF-8 is an error naming the file, line and byte.
- Every output is written to a temporary file in the same directory, flushed, fsynced and
  renamed over the final name, then the directory is fsynced: a crash leaves either the
  old file or the new one, never half of one.
- An output path that is not a regular file is never replaced by one (`output_kind`):
  `-` is standard output, as for Unix tools; a character device or FIFO (`/dev/null`,
  `/dev/stdout`, a named pipe) is written in place; a symlink is written through, to its
  target, atomically; a file that is a mount point of its own (a bind-mounted file) is
  rewritten in place when the rename is refused; a directory or block device is refused.
- Files that belong to a training run (its checkpoints, their manifests, config.json,
  train_log.jsonl, the lock) are never the output of another command (`run_file`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import gzip
import hashlib
import io
import logging
import os
import re
import shutil
import stat
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast


class InputError(ValueError):
    """Bad input data; the message names the file and line."""


class UsageError(ValueError):
    """A command that cannot be meant as given, refused before any work: an output path
    that is one of the inputs, a directory, or a file this command did not make. The CLI
    exits with 2, as for a bad flag."""


log = logging.getLogger(__name__)

#: The name that means standard output, as for Unix tools.
STDOUT = "-"
#: Paths that name one of this process's own descriptors: written through that descriptor.
_FD_ALIASES = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_PATH = re.compile(r"/(?:dev/fd|proc/self/fd|proc/(\d+)/fd)/(\d+)")
#: The files of a training run (aiayn.checkpoints.io's names; this module is below it).
_RUN_FILE = re.compile(
    r"(checkpoint_(\d+|last|best)\.pt(\.sha256)?|config\.json|train_log\.jsonl|trainer\.lock)"
)
_RUN_MARKERS = ("trainer.lock", "train_log.jsonl", "checkpoint_last.pt")

#: The first bytes of a zip archive: every checkpoint torch.save writes starts with them.
ZIP_MAGIC = b"PK\x03\x04"


def read_bytes(path: str | Path) -> bytes:
    """The whole content of a plain or gzip file; a truncated or corrupt gzip stream is an
    InputError naming the file (Python raises a bare EOFError or zlib.error)."""
    try:
        with open_bytes(path) as f:
            return f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: truncated or corrupt gzip file ({e})") from None


def looks_binary(path: str | Path) -> bool:
    """Whether an existing file is a checkpoint (a zip archive) or a gzip file: never the
    text a command writes."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == ZIP_MAGIC or head[:2] == b"\x1f\x8b"


def output_kind(path: str | Path) -> str:
    """What writing `path` means: "stdout" (`-`, /dev/stdout), "stream" (a character
    device or FIFO, also through a symlink: written in place, never renamed over),
    "symlink" (to a regular file, or dangling: written through to the target), "directory",
    "block" (a block device), "socket", "file" (an existing regular file) or "new"."""
    fd = _own_fd(path)
    if str(path) == STDOUT or fd == 1:
        return "stdout"
    if fd is not None:
        return "stream"
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        return "symlink" if os.path.islink(path) else "new"
    except OSError:
        return "new"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or _through_fd(path):
        return "stream"
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if stat.S_ISBLK(st.st_mode):
        return "block"
    if stat.S_ISSOCK(st.st_mode):
        return "socket"
    return "symlink" if os.path.islink(path) else "file"


def _own_fd(path: str | Path) -> int | None:
    """The descriptor of this process that `path` names (/dev/stderr, /dev/fd/2,
    /proc/self/fd/2), or None."""
    if str(path) == STDOUT:
        return None
    text = os.path.abspath(path)
    if text in _FD_ALIASES:
        return _FD_ALIASES[text]
    m = _FD_PATH.fullmatch(text)
    if m and (m.group(1) is None or int(m.group(1)) == os.getpid()):
        return int(m.group(2))
    return None


def _through_fd(path: str | Path) -> bool:
    """Whether `path` is, or links through, an open descriptor (/dev/stderr, /dev/fd/N,
    /proc/PID/fd/N): whatever it points at is written in place, as `cmd 2>log` expects."""
    text = os.path.abspath(path)
    for _ in range(40):
        if text.startswith(("/proc/", "/dev/fd/")):
            return True
        if not os.path.islink(text):
            return False
        text = os.path.join(os.path.dirname(text), os.readlink(text))
    return False


def run_file(path: str | Path) -> str | None:
    """The reason `path` belongs to a training run (and must not be written by another
    command), or None: a checkpoint's manifest (`<name>.pt.sha256` beside `<name>.pt`),
    or a run file's name (checkpoint_N.pt, checkpoint_last.pt, checkpoint_best.pt, their
    manifests, config.json, train_log.jsonl, trainer.lock) in a run directory."""
    path = Path(os.path.realpath(path))
    if path.name.endswith(".pt.sha256") and path.with_name(path.name[: -len(".sha256")]).exists():
        return f"the sha256 manifest of the checkpoint {path.name[: -len('.sha256')]}"
    if _RUN_FILE.fullmatch(path.name) and any((path.parent / m).exists() for m in _RUN_MARKERS):
        return f"a file of the training run in {path.parent}"
    return None


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a training run's directory (a lock, a log or checkpoint_last.pt)."""
    return Path(path).is_dir() and any((Path(path) / m).exists() for m in _RUN_MARKERS)


def check_output_dir(path: str | Path, *, what: str = "--out", run_ok: bool = False) -> Path:
    """Refuse, before any work, a directory output that is not one: `-`, an existing file,
    device, FIFO or socket; and, unless `run_ok`, a training run's directory (its
    config.json and checkpoints are not another command's to replace). Returns the path."""
    kind = output_kind(path)
    if kind == "stdout":
        raise UsageError(f"{what} {path}: this command writes a directory, not to standard output")
    if kind not in ("new", "directory", "symlink"):
        raise UsageError(
            f"{what} {path} exists and is {_KIND_NAMES.get(kind, 'a file')}; give a directory"
        )
    if kind == "symlink":
        raise UsageError(f"{what} {path} is a symlink to nothing or to a file; give a directory")
    if not run_ok and kind == "directory" and is_run_dir(path):
        raise UsageError(
            f"{what} {path} is a training run's directory (its checkpoints and config.json "
            "are not this command's to replace): give another directory"
        )
    return Path(path)


_KIND_NAMES = {
    "file": "a file",
    "stream": "a device or pipe",
    "block": "a block device",
    "socket": "a socket",
    "directory": "a directory",
}


def check_output_file(
    path: str | Path,
    *,
    inputs: tuple[str | Path | None, ...] = (),
    force: bool = False,
    overwrite_ok: bool = True,
    what: str = "output",
    stdout_ok: bool = True,
) -> Path:
    """Refuse, before any work, an output path that would lose data or cannot be written.

    Refused (UsageError): a directory, block device or socket; `-` unless `stdout_ok`; a
    path whose directory does not exist; the same file as one of `inputs`; a file of a
    training run (`run_file`), even with `force`; without `force`, an existing checkpoint
    or gzip file, or (with `overwrite_ok` False) any existing file. A device or FIFO is
    accepted (written in place); a symlink is followed, and said so. A directory that
    refuses new files is an OSError naming it. Returns the path.
    """
    kind = output_kind(path)
    if kind == "stdout":
        if not stdout_ok:
            raise UsageError(
                f"{what} {path}: this command writes a file with a manifest beside it, not to "
                "standard output; give a file name"
            )
        return Path(path)
    path = Path(path)
    if kind in ("directory", "block", "socket"):
        raise UsageError(f"{what} {path} is {_KIND_NAMES[kind]}; give a file name")
    for other in inputs:
        if other is not None and _same_file(path, Path(other)):
            raise UsageError(f"{what} {path} is also an input ({other}): it would be replaced")
    if kind == "stream":
        return path  # written in place: nothing replaced, nothing to probe
    reason = run_file(path)
    if reason is not None:
        raise UsageError(f"{what} {path} is {reason}: never the output of another command")
    if kind == "symlink":
        target = Path(os.path.realpath(path))
        log.info("%s %s is a symlink: writing through to %s", what, path, target)
        path = target
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: the directory {parent} does not exist")
    for other in inputs:
        if other is not None and _same_file(path, Path(other)):
            raise UsageError(f"{what} {path} is also an input ({other}): it would be replaced")
    if path.is_file() and not force:
        if looks_binary(path):
            raise UsageError(
                f"{what} {path} exists and is a checkpoint or gzip file, not one this command "
                "writes; pass --force to replace it"
            )
        if not overwrite_ok:
            raise UsageError(f"{what} {path} exists; pass --force to replace it")
    probe = parent / f".{path.name}.{os.getpid()}.probe.tmp"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"cannot write in {parent}: {e.strerror}") from None
    return path


def _same_file(a: Path, b: Path) -> bool:
    if str(a) == STDOUT or str(b) == STDOUT:
        return False
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def open_bytes(path: str | Path) -> IO[bytes]:
    """Open a plain or gzip file for binary reading (gzip by magic number, not suffix)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file")
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        # A pipe (bash's `--ref <(zcat ref.gz)`, a FIFO) cannot seek back over the magic
        # number: read it whole; it can be read only once anyway.
        with open(path, "rb") as pipe:
            data = pipe.read()
        if data[:2] == b"\x1f\x8b":
            return cast(IO[bytes], gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb"))
        return io.BytesIO(data)
    f = open(path, "rb")  # noqa: SIM115 - returned to the caller
    magic = f.read(2)
    f.seek(0)
    if magic == b"\x1f\x8b":
        f.close()
        return cast(IO[bytes], gzip.open(path, "rb"))
    return f


def read_lines(path: str | Path, *, on_bad_utf8: str = "error") -> Iterator[str]:
    """Yield the lines of a text file (plain or .gz) without their b"\\n".

    Args:
        on_bad_utf8: "error" raises InputError naming file, line and byte offset;
            "replace" substitutes U+FFFD.
    """
    data = read_bytes(path)
    if not data:
        return
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line, it does not start another
    for lineno, raw in enumerate(lines, start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark is not text
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if on_bad_utf8 == "replace":
                yield raw.decode("utf-8", errors="replace")
            else:
                raise InputError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line "
                    f"({raw[e.start : e.start + 4]!r})"
                ) from None


def count_lines(path: str | Path) -> int:
    """Number of lines as `wc -l` counts them, plus one for a last line without newline;
    read 1 MiB at a time, so that a corpus of gigabytes is counted in constant memory."""
    n, last = 0, b"\n"
    try:
        with open_bytes(path) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                n += chunk.count(b"\n")
                last = chunk[-1:]
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise InputError(f"{path}: truncated or corrupt gzip file ({e})") from None
    return n + (last != b"\n")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _write_in_place(path: str | Path, mode: str) -> Iterator[IO]:
    """Standard output, a device or a FIFO: written as it is, never renamed over."""
    text: dict[str, Any] = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
    if output_kind(path) == "stdout":
        stream: IO = sys.stdout.buffer if "b" in mode else sys.stdout
        yield stream
        stream.flush()
        return
    fd = _own_fd(path)
    if fd is not None:  # /dev/stderr: through the descriptor itself, sharing its offset
        sys.stderr.flush()
        with open(os.dup(fd), mode, **text) as f:
            yield f
        return
    if stat.S_ISREG(os.stat(path).st_mode):  # another's /proc/PID/fd/N on a file: add to it
        mode = mode.replace("w", "a")
    try:
        with open(path, mode, **text) as f:
            yield f
    except OSError as e:
        raise OSError(e.errno, f"write failed: {path}: {e.strerror or e}") from e


def _copy_in_place(tmp: Path, path: Path) -> None:
    """The rename was refused (a bind-mounted file is a mount point): rewrite the file's
    content in place from the finished temporary file."""
    with open(tmp, "rb") as src, open(path, "r+b") as dst:
        shutil.copyfileobj(src, dst)
        dst.truncate()
        dst.flush()
        os.fsync(dst.fileno())
    tmp.unlink()


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Write `path` atomically: yield a temp file; on success fsync and rename it into place.

    On any exception the temp file is removed and the previous file at `path` is untouched.
    Write errors are re-raised as OSError naming the final path. `-`, a device or a FIFO
    is written in place (`output_kind`); a symlink is written through to its target.
    """
    kind = output_kind(path)
    if kind in ("stdout", "stream"):
        with _write_in_place(path, mode) as f:
            yield f
        return
    path = Path(os.path.realpath(path)) if kind == "symlink" else Path(path)
    remove_orphaned_tmp(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        text: dict[str, Any] = {} if "b" in mode else {"encoding": "utf-8", "newline": "\n"}
        with open(tmp, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        # RELIABILITY B4: the temp file's data and its directory entry are on disk
        # before the rename, and the rename is on disk before we report success.
        fsync_dir(path.parent)
        try:
            os.replace(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            _copy_in_place(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            raise OSError(e.errno, f"write failed: {path}: {e.strerror or e}") from e
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_orphaned_tmp(path: str | Path) -> list[Path]:
    """Delete the temporary files of earlier writes of `path` whose writer is dead (killed
    with SIGKILL, which no handler sees): `.<name>.<pid>.tmp` with no process `pid`."""
    path = Path(path)
    removed = []
    for p in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = p.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
                log.info("removed %s, left by a writer that was killed", p)
    return removed


def remove_stale_tmp(directory: str | Path) -> list[Path]:
    """Delete temp files left by a killed writer (they never hold a final name)."""
    removed = []
    for p in Path(directory).glob(".*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()
            removed.append(p)
    return removed
