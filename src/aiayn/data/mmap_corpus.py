"""A prepared split kept on disk: numpy .npy arrays that training maps, never loads whole.

`aiayn prepare --streaming` (data.stream_prepare) writes, per split, five arrays:
SPLIT.src_ids.npy and SPLIT.tgt_ids.npy (int32, every pair's subword ids end to end),
SPLIT.src_offsets.npy and SPLIT.tgt_offsets.npy (int64, n + 1: pair i is
ids[offsets[i]:offsets[i + 1]]) and SPLIT.line_numbers.npy (int64, n). These are the
tensors of a `train.pt`, one file each, so that `MmapCorpus` can hand the ordinary Corpus
code torch views of the mapped files: reading pair i touches the pages of pair i only,
and the operating system's page cache, shared by every process and rank, holds the rest.

What is in memory: the lengths (int32, 4 bytes per pair and side), which the length
bucketing of every epoch needs; nothing else grows with the corpus.

Files are written streaming (`NpyWriter`): a fixed-size header is reserved, the data
appended chunk by chunk, and the header filled in at the end with the final shape.
"""

from __future__ import annotations

import ast
import logging
import os
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from aiayn.data.pairs import Corpus
from aiayn.files import InputError

logger = logging.getLogger(__name__)

ARRAYS = ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets", "line_numbers")
DTYPES = {
    "src_ids": np.int32,
    "tgt_ids": np.int32,
    "src_offsets": np.int64,
    "tgt_offsets": np.int64,
    "line_numbers": np.int64,
}
_HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + the dict, padded: 64-aligned
_CHUNK = 1 << 22  # elements per pass when checking offsets


def array_file(split: str, name: str) -> str:
    return f"{split}.{name}.npy"


class NpyWriter:
    """Append 1-D arrays of one dtype to a .npy file whose length is known only at the end.

    A 128-byte header (npy format 1.0) is reserved, then rewritten by `close` with the
    final shape: no second copy of the data is ever made.
    """

    def __init__(self, f: IO[bytes], dtype: Any) -> None:
        self.f, self.dtype, self.n = f, np.dtype(dtype), 0
        f.write(b"\0" * _HEADER_BYTES)

    def append(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        self.f.write(a.data)
        self.n += a.size

    def close(self) -> None:
        """Write the header for the `n` elements appended (the file stays open)."""
        self.f.flush()
        self.f.seek(0)
        self.f.write(npy_header(self.dtype, self.n))
        self.f.seek(0, os.SEEK_END)


def npy_header(dtype: Any, n: int) -> bytes:
    """A .npy 1.0 header of exactly 128 bytes for a 1-D array of `n` elements."""
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False}
    text = repr(dict(d, shape=(n,))).encode("latin1")
    pad = _HEADER_BYTES - 10 - len(text) - 1
    if pad < 0:  # pragma: no cover - needs a shape of ~90 digits
        raise ValueError(f"npy header too long for shape ({n},)")
    body = text + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


def open_array(path: Path, dtype: Any, what: str) -> np.memmap:
    """Map a .npy file read-only after checking its header and size.

    A truncated or overwritten file is refused with its path and the sizes, before numpy
    would fail with a bare "mmap length is greater than file size".
    """
    if not path.is_file():
        raise InputError(f"{path}: missing; re-run `aiayn prepare --streaming`")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        raise InputError(f"{path}: not a .npy file ({what}); re-run `aiayn prepare --streaming`")
    hlen = int.from_bytes(head[8:10], "little")
    try:
        header = ast.literal_eval(head[10 : 10 + hlen].decode("latin1"))
        shape, descr = header["shape"], header["descr"]
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError):
        raise InputError(f"{path}: corrupt .npy header ({what})") from None
    if np.dtype(descr) != np.dtype(dtype) or len(shape) != 1:
        raise InputError(f"{path}: {what} is {descr} {shape}, expected 1-D {np.dtype(dtype)}")
    expected = 10 + hlen + shape[0] * np.dtype(dtype).itemsize
    if size != expected:
        raise InputError(
            f"{path}: {size} bytes, but its header promises {expected} ({shape[0]} "
            f"{np.dtype(dtype)} values): truncated or corrupt; re-run `aiayn prepare --streaming`"
        )
    arr = np.load(path, mmap_mode="r")
    assert isinstance(arr, np.memmap)
    return arr


def _view(a: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing the mapped pages (no copy). The mapping is read-only and
    nothing writes through the view; torch warns about that for any read-only array."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _lengths(off: np.ndarray, n_ids: int, name: str, side: str) -> torch.Tensor:
    """int32 lengths from the offsets, checked chunk by chunk (0 first, never decreasing,
    ending at the number of ids) without a whole int64 temporary."""
    n = off.shape[0] - 1
    if n < 0 or int(off[0]) != 0 or int(off[-1]) != n_ids:
        raise InputError(f"{name}: inconsistent {side} ids/offsets; re-run prepare")
    lens = np.empty(n, dtype=np.int32)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        d = np.diff(off[a : b + 1])
        if d.size and (d.min() < 0 or d.max() > np.iinfo(np.int32).max):
            raise InputError(f"{name}: inconsistent {side} ids/offsets; re-run prepare")
        lens[a:b] = d
    return torch.from_numpy(lens)


class MmapCorpus(Corpus):
    """A Corpus whose ids, offsets and line numbers are memory-mapped .npy files.

    The interface is Corpus's (src(i), tgt(i), src_lens, tgt_lens, line_numbers, len,
    both_directions), so batching and training take either. `arrays` holds the np.memmap
    objects themselves.
    """

    def __init__(self, data_dir: str | Path, split: str) -> None:  # noqa: D107
        data_dir = Path(data_dir)
        self.name = str(data_dir / f"{split}.*.npy")
        self.arrays: dict[str, np.memmap] = {
            key: open_array(data_dir / array_file(split, key), DTYPES[key], key) for key in ARRAYS
        }
        a = self.arrays
        n = a["line_numbers"].shape[0]
        for side in ("src", "tgt"):
            if a[f"{side}_offsets"].shape[0] != n + 1:
                raise InputError(f"{self.name}: {side} offsets do not match the pairs")
        self.src_lens = _lengths(a["src_offsets"], a["src_ids"].shape[0], self.name, "src")
        self.tgt_lens = _lengths(a["tgt_offsets"], a["tgt_ids"].shape[0], self.name, "tgt")
        self._src_ids, self._src_off = _view(a["src_ids"]), _view(a["src_offsets"])
        self._tgt_ids, self._tgt_off = _view(a["tgt_ids"]), _view(a["tgt_offsets"])
        self.line_numbers = _view(a["line_numbers"])
        # Plain ndarray views of the maps: slicing them skips np.memmap's per-slice
        # bookkeeping, the hot path of collate.
        self._np = {key: a[key].view(np.ndarray) for key in ARRAYS}

    def __len__(self) -> int:
        return int(self.src_lens.numel())

    def src(self, i: int) -> list[int]:
        off = self._np["src_offsets"]
        return self._np["src_ids"][off[i] : off[i + 1]].tolist()  # type: ignore[no-any-return]

    def tgt(self, i: int) -> list[int]:
        off = self._np["tgt_offsets"]
        return self._np["tgt_ids"][off[i] : off[i + 1]].tolist()  # type: ignore[no-any-return]

    def both_directions(self) -> Corpus:
        """Every pair as (src, tgt), then as (tgt, src), read through this one's maps:
        nothing is copied but the lengths and line numbers."""
        return BothDirections(self)


class BothDirections(Corpus):
    """Pair i < n is base pair i; pair n + i is base pair i reversed (its line number too).

    Built lazily over the base corpus's src()/tgt(), so a mapped corpus stays mapped.
    """

    def __init__(self, base: Corpus) -> None:  # noqa: D107
        self.base, self.n = base, len(base)
        self.src_lens = torch.cat([base.src_lens, base.tgt_lens])
        self.tgt_lens = torch.cat([base.tgt_lens, base.src_lens])
        self.line_numbers = torch.cat([base.line_numbers, base.line_numbers])

    def __len__(self) -> int:
        return 2 * self.n

    def src(self, i: int) -> list[int]:
        return self.base.src(i) if i < self.n else self.base.tgt(i - self.n)

    def tgt(self, i: int) -> list[int]:
        return self.base.tgt(i) if i < self.n else self.base.src(i - self.n)

    def both_directions(self) -> Corpus:
        raise ValueError("already both directions")
