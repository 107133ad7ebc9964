"""The beam step's normaliser and top-k in compiled code on the CPU (csrc/beam_step.c).

Why: each beam-search step turns the model's (rows, V) next-token logits into every
row's k best log-probabilities: log P = logit - logsumexp(logits). With PyTorch ops that is
a bf16 -> float32 copy of the table, `logsumexp` (a max pass, a subtract, exp, a sum) and
`search.row_topk` (a block-max pass, a gather, two top-ks): five or more passes over a
table of 10 MB (256 rows x 10,000 tokens), ~4.6 ms a step on one thread, a large part of
a small model's search. The C code reads each row once into a buffer that stays in
cache and does all of it there (~1.3 ms for that table; docs/performance.md).

Built on first use with the system's C compiler (`$CC`, else `cc`) for this CPU
(`-march=native`), cached under `$AIAYN_CACHE_DIR` (default `~/.cache/aiayn`) by a key of
the source, the flags, the compiler and the CPU's feature flags, and loaded with ctypes.
Without a compiler, if the build fails, or with `AIAYN_NO_NATIVE=1`, `lse_topk` returns
None and the caller uses the PyTorch ops: the same tokens up to float rounding of the
normaliser (tests/test_native.py compares the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "beam_step.c"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-fPIC", "-shared")
#: Below this many rows a second thread costs more than it saves.
MIN_ROWS_PER_THREAD = 32

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_void_p]


def cache_dir() -> Path:
    return Path(os.environ.get("AIAYN_CACHE_DIR") or Path.home() / ".cache" / "aiayn")


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native on one machine must not
    be loaded on another whose CPU lacks its instructions (a home directory shared by a
    cluster)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: concurrent processes (decoding workers,
    # two runs) never load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, built if needed; None where it cannot be had (logged once)."""
    if os.environ.get("AIAYN_NO_NATIVE") == "1":
        return None
    if sys.platform != "linux":  # the flags and the cache key assume gcc/clang on Linux
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler found: beam search normalises with PyTorch ops")
        return None
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(),
                                     compiler.encode(), _cpu_flags().encode()]))
    path = cache_dir() / f"beam_step-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged cached file: built again, once
            path.unlink(missing_ok=True)
            _build(compiler, path)
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        lines = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        logger.warning("building %s failed (%s): beam search normalises with PyTorch ops",
                       SOURCE.name, lines[-1] if lines else type(e).__name__)
        return None
    for name in ("aiayn_lse_topk_bf16", "aiayn_lse_topk_f32"):
        getattr(lib, name).argtypes = _ARGS
        getattr(lib, name).restype = None
    return lib


_helper_of: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    """One helper thread for this process (a forked child gets its own: the parent's
    thread does not exist there)."""
    global _helper_of
    if _helper_of is None or _helper_of[0] != os.getpid():
        _helper_of = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="aiayn-lse-topk"))
    return _helper_of[1]


@functools.cache
def _columns(exclude: tuple[int, ...], v: int) -> Tensor:
    """The excluded columns inside the table, as the C code takes them (made once, not
    every decoding step)."""
    return torch.tensor(sorted({c for c in exclude if 0 <= c < v}), dtype=torch.int64)


def lse_topk(logits: Tensor, k: int, exclude: tuple[int, ...]) -> tuple[Tensor, Tensor] | None:
    """Each row's k largest logits outside the columns `exclude`, minus the row's
    log-sum-exp over all columns, largest first, and their columns: (R, k) float32 and
    (R, k) int64. None where the compiled code does not apply (not a CPU (R, V) bf16 or
    float32 table with unit column stride, fewer than k eligible columns, no library):
    the caller then computes the same with PyTorch ops.

    With more than one intra-op thread (`torch.get_num_threads()`), the rows are split
    between this thread and one helper thread (ctypes releases the GIL while C runs).
    """
    if (logits.device.type != "cpu" or logits.dim() != 2
            or logits.dtype not in (torch.bfloat16, torch.float32) or logits.stride(1) != 1):
        return None
    r, v = logits.shape
    excl = _columns(exclude, v)
    if v - len(excl) < k or k < 1:
        return None
    lib = library()
    if lib is None:
        return None
    fn = lib.aiayn_lse_topk_bf16 if logits.dtype == torch.bfloat16 else lib.aiayn_lse_topk_f32
    val = torch.empty(r, k, dtype=torch.float32)
    idx = torch.empty(r, k, dtype=torch.int64)
    parts = 2 if torch.get_num_threads() > 1 and r >= 2 * MIN_ROWS_PER_THREAD else 1
    bufs = torch.empty(parts, v, dtype=torch.float32)
    bounds = [r * i // parts for i in range(parts + 1)]

    def run(i: int) -> None:
        fn(logits.data_ptr(), bounds[i], bounds[i + 1], v, logits.stride(0), k,
           excl.data_ptr(), len(excl), bufs[i].data_ptr(), val.data_ptr(), idx.data_ptr())

    if parts == 1:
        run(0)
    else:
        other = _helper().submit(run, 1)
        run(0)
        other.result()
    return val, idx
