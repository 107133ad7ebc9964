"""Compiled code for the CPU: the beam step's normaliser and top-k (csrc/beam_step.c), the
decoding step's attention (csrc/decode_attention.c), int8 decoding's quantizing and
dequantizing passes (csrc/int8_linear.c), and, for training, dropout masks
(csrc/dropout.c), the label-smoothed loss over the logits (csrc/smoothed_ce.c) and
BPE-dropout's segmentations (csrc/bpe_dropout.c).

Why the beam step: each beam-search step turns the model's (rows, V) next-token logits into every
row's k best log-probabilities: log P = logit - logsumexp(logits). With PyTorch ops that is
a bf16 -> float32 copy of the table, `logsumexp` (a max pass, a subtract, exp, a sum) and
`search.row_topk` (a block-max pass, a gather, two top-ks): five or more passes over a
table of 10 MB (256 rows x 10,000 tokens), each from memory, a large part of a small
model's search. The C code reads each row once into a buffer that stays in cache and does
all of it there (measured: docs/performance.md, "C beam step"). For an int8 output layer,
`lse_topk_int8` takes the layer's int32 products and scales them as it reads them, so the
float table is never written.

Why the attention: a decoding step attends from one new query per row, and written with
PyTorch ops that is a few batched products of thousands of (1 x d_k) x (d_k x t)
matrices (each oneDNN or MKL call's fixed cost outweighs its arithmetic at these sizes), a
softmax, and, with a key/value cache, a copy of the whole cache into a buffer one position
longer every step (gathered by the beam's reordering). `cached_attention` leaves each
step's keys and values where the projection wrote them and follows a per-row table of
which row held the hypothesis at each position, so a reordering permutes that small table
only; `memory_attention` attends to the encoder's keys and values, stored once per
sentence (measured: docs/performance.md, "C decoding attention").

Why the dropout masks: PyTorch draws CPU random numbers one at a time from a Mersenne
Twister on one thread, for each of a base training step's 32 masks; `dropout_multiplier`
draws them from a counter-based generator in vectorised C, seeded from PyTorch's generator
(measured: docs/performance.md, "Compiled dropout").

Why the int8 passes: `inference.Int8Linear` quantizes each input row with its own scale
before `torch._int_mm` and scales the int32 products back after it; with PyTorch ops that
is four or five passes each side (~10 operator calls) per layer and decoding step,
`quantize_rows` and `dequantize_rows` read each row once.

Why the loss: `loss._smoothed_ce_rows` works through the (tokens, V) logits table in
64-row blocks with 14 PyTorch operator calls and six passes each; `smoothed_ce` reads a
row once into a buffer in cache and makes three passes there.

Why BPE-dropout's segmentations: every epoch re-merges each of the 667,000 words of
Multi30k's training pairs from their characters, a loop of small lookups, which C runs
far faster than Python (`data._bpe_dropout_words`, the fallback; measured:
docs/performance.md).

Built on first use with the system's C compiler (`$CC`, else `cc`) for this CPU's class
(`isa_flags`: AVX-512, AVX2 or portable C; `AIAYN_CPU_ISA` caps it), cached under
`$AIAYN_CACHE_DIR` (default `~/.cache/aiayn`) by a key of the source, the flags, the
compiler and the CPU's feature flags, and loaded with ctypes.
Without a compiler, if the build fails, or with `AIAYN_NO_NATIVE=1`, `library()` is None
and the callers use PyTorch ops: the same results up to float rounding
(tests/fast/test_native.py compares them).

Long because it is the one binding to the compiled library: the build and its cache key,
then one thin ctypes wrapper per kernel, each checking its tensors' shapes and dtypes
before handing C a pointer; one loader for all keeps them built and versioned together.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Compiled together into one library; the headers are part of its cache key.
SOURCES = (
    CSRC / "beam_step.c",
    CSRC / "decode_attention.c",
    CSRC / "dropout.c",
    CSRC / "smoothed_ce.c",
    CSRC / "int8_linear.c",
    CSRC / "int8_gemm.c",
    CSRC / "bpe_dropout.c",
    CSRC / "decoder_step.c",
    CSRC / "beam_search.c",
)
HEADERS = (
    CSRC / "simd_math.h",
    CSRC / "decode_attention_kernels.h",
    CSRC / "decoder_step.h",
)
FLAGS = (
    "-O3",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fPIC",
    "-shared",
)
#: Below this many rows a second thread costs more than it saves.
MIN_ROWS_PER_THREAD = 32

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_U64, _U32, _U16 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint16
_SIGNATURES: dict[str, list[Any]] = {
    "aiayn_dropout": [_U64, _I64, _I64, _U32, None, _P],  # scale: float or bf16 bits
    "aiayn_smoothed_ce": [_P, _I64, _I64, _I64, _I64, _P, _F, _INT, _P, _P, _P, _P],
    "aiayn_lse_topk": [_P, _I64, _I64, _I64, _I64, _INT, _P, _INT, _P, _P, _P],
    "aiayn_cached_attention": [
        _P,
        _I64,
        _P,
        _I64,
        _I64,
        _I64,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _INT,
        _INT,
        _INT,
        _F,
        _P,
        _P,
        _I64,
    ],
    "aiayn_memory_attention": [
        _P,
        _I64,
        _P,
        _P,
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _INT,
        _INT,
        _INT,
        _F,
        _P,
        _P,
        _I64,
    ],
}
#: Functions of one type only (no _bf16 / _f32 pair).
_PLAIN_SIGNATURES: dict[str, list[Any]] = {
    "aiayn_quantize_rows": [_P, _I64, _I64, _I64, _I64, _P, _P],
    "aiayn_quantize_rows_r7": [_P, _I64, _I64, _I64, _I64, _P, _P],
    "aiayn_dequantize_rows": [_P, _I64, _I64, _I64, _P, _P, _P, _INT],
    "aiayn_lse_topk_i32_block": [
        _P,
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _P,
        _P,
        _P,
        _INT,
        _P,
        _INT,
        _INT,
        _P,
        _P,
        _P,
        _P,
        _P,
    ],
    "aiayn_bpe_dropout": [_P, _P, _I64, _P, _P, _P, _I64, _I64, _U64, _U64, _P, _P],
    "aiayn_int8_pack": [_P, _I64, _I64, _I64, _P],
    "aiayn_int8_gemm": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64],
    "aiayn_int8_gemm_plain": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64],
    "aiayn_int8_gemm_nonneg": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64],
    "aiayn_int8_gemm_r7": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64],
}
#: Sizes the attention kernels take at most (MAX_D, MAX_ROW, MAX_HEADS in the C code):
#: d_k and d_v; h*d_k, h*d_v and (rows per sentence)*d_v; h and rows per sentence.
MAX_HEAD_DIM, MAX_ROW, MAX_HEADS = 1024, 8192, 256


def cache_dir() -> Path:
    return Path(os.environ.get("AIAYN_CACHE_DIR") or Path.home() / ".cache" / "aiayn")


def isa_flags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler's target flags for the kernels' instruction set (`machine.kernel_isa`
    of this CPU's class, capped by AIAYN_CPU_ISA): avx512 builds for this CPU
    (-march=native, the AVX-512 paths), avx2 for AVX2 and FMA only (-march=x86-64-v3: the
    8-lane paths, also when held to AVX2 on a bigger CPU), portable for this CPU where it
    is not x86 (e.g. aarch64's NEON through the plain loops), else for x86-64-v2."""
    from aiayn.cpu_isa import cpu, kernel_isa

    isa = isa or kernel_isa(cpu().cls)
    if isa == "avx512":
        return ("-march=native",)
    if isa == "avx2":
        return ("-march=x86-64-v3", "-mtune=native")
    if platform.machine() in ("x86_64", "AMD64"):
        return ("-march=x86-64-v2", "-mtune=native")
    return ("-mcpu=native",) if platform.machine() in ("aarch64", "arm64") else ()


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


def _build(compiler: str, out: Path, isa: str | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: concurrent processes (decoding workers,
    # two runs) never load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *isa_flags(isa), *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library for this CPU's class (`isa_flags`), built if needed; None where
    it cannot be had (logged once)."""
    if os.environ.get("AIAYN_NO_NATIVE") == "1":
        return None
    return library_for(None)


def clear_cache() -> None:
    """Forget the loaded libraries (tests that change the cache directory or compiler)."""
    library.cache_clear()
    library_for.cache_clear()


@functools.cache
def library_for(isa: str | None) -> ctypes.CDLL | None:
    """The library built for instruction set `isa` ("avx512", "avx2", "portable"; None:
    this CPU's class), e.g. for tests that check every path this CPU can run."""
    if sys.platform != "linux":  # the flags and the cache key assume gcc/clang on Linux
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler found: decoding uses PyTorch ops only")
        return None
    key = hashlib.sha256(
        b"\0".join(
            [
                *(f.read_bytes() for f in SOURCES + HEADERS),
                " ".join(FLAGS + isa_flags(isa)).encode(),
                compiler.encode(),
                _cpu_flags().encode(),
            ]
        )
    )
    path = cache_dir() / f"native-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path, isa)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged cached file: built again, once
            path.unlink(missing_ok=True)
            _build(compiler, path, isa)
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        lines = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        logger.warning(
            "building %s failed (%s): decoding uses PyTorch ops only",
            " ".join(f.name for f in SOURCES),
            lines[-1] if lines else type(e).__name__,
        )
        return None
    for stem, args in _SIGNATURES.items():
        for suffix in ("bf16", "f32"):
            fn = getattr(lib, f"{stem}_{suffix}")
            scale = _U16 if suffix == "bf16" else _F
            fn.argtypes, fn.restype = [scale if a is None else a for a in args], None
    for name, args in _PLAIN_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


_helper_of: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    """One helper thread for this process (a forked child gets its own: the parent's
    thread does not exist there)."""
    global _helper_of
    if _helper_of is None or _helper_of[0] != os.getpid():
        _helper_of = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="aiayn-native"))
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
    if (
        logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.dtype not in (torch.bfloat16, torch.float32)
        or logits.stride(1) != 1
    ):
        return None
    r, v = logits.shape
    excl = _columns(exclude, v)
    if v - len(excl) < k or k < 1:
        return None
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, f"aiayn_lse_topk_{_suffix(logits.dtype)}")
    val = torch.empty(r, k, dtype=torch.float32)
    idx = torch.empty(r, k, dtype=torch.int64)
    bufs = torch.empty(2, v, dtype=torch.float32)  # one scratch row per thread

    def run(part: int, r0: int, r1: int) -> None:
        fn(
            logits.data_ptr(),
            r0,
            r1,
            v,
            logits.stride(0),
            k,
            excl.data_ptr(),
            len(excl),
            bufs[part].data_ptr(),
            val.data_ptr(),
            idx.data_ptr(),
        )

    _in_two_parts(r, MIN_ROWS_PER_THREAD, run)
    return val, idx


def lse_topk_int8(
    acc: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    bias: Tensor | None,
    k: int,
    exclude: tuple[int, ...],
) -> tuple[Tensor, Tensor] | None:
    """`lse_topk` of the logits of an int8 output layer (`inference.Int8Linear`), given
    as its (R, V) int32 products: logits = acc * row_scale[:, None] * col_scale (+ bias),
    scaled as each row is read, with `dequantize_rows`'s arithmetic, so the results are
    those of `dequantize_rows` then `lse_topk`, bit for bit, without writing and reading
    back the float table. None where `lse_topk` would be (fewer than k eligible columns,
    no library)."""
    if acc.device.type != "cpu" or acc.dim() != 2 or acc.dtype != torch.int32 or acc.stride(1) != 1:
        return None
    return lse_topk_int8_blocked(
        lambda c0, c1: acc[:, c0:c1],
        acc.size(0),
        acc.size(1),
        row_scale,
        col_scale,
        bias,
        k,
        exclude,
        block=acc.size(1),
    )


def lse_topk_int8_blocked(
    products: Callable[[int, int], Tensor],
    rows: int,
    v: int,
    row_scale: Tensor,
    col_scale: Tensor,
    bias: Tensor | None,
    k: int,
    exclude: tuple[int, ...],
    block: int,
) -> tuple[Tensor, Tensor] | None:
    """`lse_topk_int8` over the columns in blocks: `products(c0, c1)` gives the int32
    products of columns [c0, c1), (rows, c1 - c0) with unit column stride, each consumed
    (a running maximum, sum of exponentials and top-k per row) before the next is asked
    for, so that a block (about a core's L2 cache: `inference.LSE_TOPK_BLOCK_BYTES`) is
    read back from cache rather than the whole table from memory. With one block (block
    >= v) the results are `lse_topk_int8`'s; over several only the order of the sum of
    exponentials differs (the normaliser may differ in its last bits; the k logits and
    columns do not)."""
    excl = _columns(exclude, v)
    if v - len(excl) < k or k < 1 or block < 1:
        return None
    lib = library()
    if lib is None:
        return None
    assert row_scale.dtype == col_scale.dtype == torch.float32
    assert row_scale.is_contiguous() and col_scale.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    fn = lib.aiayn_lse_topk_i32_block
    val = torch.full((rows, k), float("-inf"), dtype=torch.float32)
    idx = torch.zeros(rows, k, dtype=torch.int64)
    m = torch.full((rows,), float("-inf"), dtype=torch.float32)
    s = torch.zeros(rows, dtype=torch.float32)
    bufs = torch.empty(2, min(block, v), dtype=torch.float32)
    for c0 in range(0, v, block):
        c1 = min(c0 + block, v)
        acc = products(c0, c1)
        if acc.shape != (rows, c1 - c0) or acc.dtype != torch.int32 or acc.stride(1) != 1:
            raise ValueError(f"products({c0}, {c1}) gave {acc.dtype} {tuple(acc.shape)}")
        b = None if bias is None else bias.data_ptr() + 4 * c0

        def run(
            part: int,
            r0: int,
            r1: int,
            acc: Tensor = acc,
            c0: int = c0,
            c1: int = c1,
            b: int | None = b,
        ) -> None:
            fn(
                acc.data_ptr(),
                r0,
                r1,
                c1 - c0,
                acc.stride(0),
                c0,
                row_scale.data_ptr(),
                col_scale.data_ptr() + 4 * c0,
                b,
                k,
                excl.data_ptr(),
                len(excl),
                int(c1 == v),
                bufs[part].data_ptr(),
                m.data_ptr(),
                s.data_ptr(),
                val.data_ptr(),
                idx.data_ptr(),
            )

        _in_two_parts(rows, MIN_ROWS_PER_THREAD, run)
    return val, idx


def _in_two_parts(n: int, min_per_thread: int, run: Callable[[int, int, int], None]) -> None:
    """run(part, start, stop) over [0, n): as two halves, the second on the helper thread,
    when PyTorch has more than one intra-op thread and each half gets `min_per_thread`."""
    if torch.get_num_threads() < 2 or n < 2 * min_per_thread:
        run(0, 0, n)
        return
    other = _helper().submit(run, 1, n // 2, n)
    run(0, 0, n // 2)
    other.result()


def attention_applies(dtype: torch.dtype, h: int, d_k: int, d_v: int) -> bool:
    """Whether `cached_attention` / `memory_attention` take tensors of this type and
    these head sizes (and the library is there)."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and max(d_k, d_v) <= MAX_HEAD_DIM
        and h * max(d_k, d_v) <= MAX_ROW
        and h <= MAX_HEADS
        and library() is not None
    )


def _suffix(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "f32"


def cached_attention(
    q: Tensor,
    positions: Tensor,
    ld: int,
    k_off: int,
    v_off: int,
    path: Tensor,
    h: int,
    d_k: int,
    d_v: int,
) -> Tensor:
    """Eq. 1 for one new query per row over its cached keys and values: (R, h*d_v).

    q: (R, h*d_k), unit column stride. positions: (t,) int64, the address of each
    position's table (rows of one width `ld`, of q's type; head i's key at columns
    k_off + i*d_k, its value at v_off + i*d_v), kept alive by the caller. path: (R, >= t)
    int64, unit column stride: row r's key and value at position i are in row path[r, i]
    of position i's table. Check `attention_applies` first.
    """
    lib = library()
    assert lib is not None and q.stride(1) == 1 and path.stride(1) == 1 and v_off > k_off
    fn = getattr(lib, f"aiayn_cached_attention_{_suffix(q.dtype)}")
    r, t = q.size(0), positions.numel()
    out = q.new_empty(r, h * d_v)
    scratch = torch.empty(2, h * t, dtype=torch.float32)

    def run(part: int, r0: int, r1: int) -> None:
        fn(
            q.data_ptr(),
            q.stride(0),
            positions.data_ptr(),
            ld,
            k_off,
            v_off,
            path.data_ptr(),
            path.stride(0),
            t,
            r0,
            r1,
            h,
            d_k,
            d_v,
            d_k**-0.5,
            scratch[part].data_ptr(),
            out.data_ptr(),
            out.stride(0),
        )

    _in_two_parts(r, MIN_ROWS_PER_THREAD, run)
    return out


def memory_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor | None:
    """Eq. 1 for one new query per row over its sentence's encoder keys and values,
    which are stored once per sentence: (R, h*d_v); None (use PyTorch ops) for more rows
    per sentence than the C code takes (a beam of hundreds).

    q: (R, h*d_k), unit column stride, R = A*g rows, sentence-major. k: (A, h, S, d_k),
    v: (A, h, S, d_v), contiguous. mask: (R, S) bool, unit column stride, True = may attend
    (rows of one sentence share its mask; at least one True each). Check
    `attention_applies` first.
    """
    lib = library()
    a, h, s, d_k = k.shape
    d_v = v.size(-1)
    g = q.size(0) // a
    if g * max(d_k, d_v) > MAX_ROW or g > MAX_HEADS:
        return None
    assert lib is not None and g * a == q.size(0) and q.stride(1) == 1
    assert k.is_contiguous() and v.is_contiguous() and mask.stride(1) == 1
    fn = getattr(lib, f"aiayn_memory_attention_{_suffix(q.dtype)}")
    out = q.new_empty(q.size(0), h * d_v)
    scratch = torch.empty(2, g * s, dtype=torch.float32)

    def run(part: int, a0: int, a1: int) -> None:
        fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            mask.data_ptr(),
            g * mask.stride(0),
            a0,
            a1,
            g,
            s,
            h,
            d_k,
            d_v,
            d_k**-0.5,
            scratch[part].data_ptr(),
            out.data_ptr(),
            out.stride(0),
        )

    _in_two_parts(a, max(1, MIN_ROWS_PER_THREAD // g), run)
    return out


#: Elements per thread below which a dropout mask is drawn on one thread.
MIN_DROPOUT_PER_THREAD = 1 << 16


def dropout_multiplier(like: Tensor, p: float) -> Tensor | None:
    """Dropout's multiplier for a tensor like `like` (its shape and dtype): 1 / (1 - p) where
    an element is kept, with probability 1 - p (p rounded to 2^-16), else 0. None where
    the compiled code does not apply (not a float32 or bf16 CPU tensor, no library).

    The generator is counter-based (csrc/dropout.c), seeded by one draw from PyTorch's
    default generator, so `torch.manual_seed` and a restored generator state decide the
    mask; the same mask whatever the number of threads.
    """
    if like.device.type != "cpu" or like.dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = library()
    if lib is None:
        return None
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    n = like.numel()
    blocks = (n + 3) // 4
    out = torch.empty(4 * blocks, dtype=like.dtype)
    threshold = round(p * 65536)
    if like.dtype == torch.bfloat16:
        fn = lib.aiayn_dropout_bf16
        scale: float | int = (
            int(torch.tensor(1.0 / (1.0 - p), dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF
        )
    else:
        fn, scale = lib.aiayn_dropout_f32, 1.0 / (1.0 - p)

    def run(part: int, b0: int, b1: int) -> None:
        fn(seed, b0, b1, threshold, scale, out.data_ptr())

    _in_two_parts(blocks, MIN_DROPOUT_PER_THREAD // 4, run)
    return out[:n].view(like.shape)


def smoothed_ce(
    logits: Tensor, target: Tensor, eps: float, write_grad: bool
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Per row of the (N, V) logits: log-sum-exp, the target's logit and the row sum,
    (N,) float32 each; with `write_grad` the table (in place) then holds
    d loss / d logits = softmax - q of the label-smoothed loss. None where the compiled
    code does not apply (not a contiguous float32 or bf16 CPU table, no library)."""
    if (
        logits.device.type != "cpu"
        or logits.dim() != 2
        or not logits.is_contiguous()
        or logits.dtype not in (torch.float32, torch.bfloat16)
    ):
        return None
    lib = library()
    if lib is None:
        return None
    n, v = logits.shape
    fn = getattr(lib, f"aiayn_smoothed_ce_{_suffix(logits.dtype)}")
    target = target.to(torch.int64).contiguous()
    lse, picked, total = (torch.empty(n, dtype=torch.float32) for _ in range(3))
    bufs = torch.empty(2, v, dtype=torch.float32)

    def run(part: int, r0: int, r1: int) -> None:
        fn(
            logits.data_ptr(),
            r0,
            r1,
            v,
            logits.stride(0),
            target.data_ptr(),
            eps,
            int(write_grad),
            bufs[part].data_ptr(),
            lse.data_ptr(),
            picked.data_ptr(),
            total.data_ptr(),
        )

    _in_two_parts(n, MIN_ROWS_PER_THREAD, run)
    return lse, picked, total


def quantize_rows(x: Tensor, bits: int = 8) -> tuple[Tensor, Tensor] | None:
    """Each row of the (R, K) float32 CPU matrix `x` (unit column stride) as int8 with
    its own scale: (R, K) int8 q and (R,) float32 s, q = round(x * 127 / max|x|) (ties to
    even), s = max|x| / 127, so x ~ s q. `bits=7`: q = round(x * 63 / max|x|) + 64, in
    [1, 127], s = max|x| / 63, so x ~ s (q - 64), for `int8_gemm(..., r7=True)`. None
    without the library."""
    lib = library()
    if lib is None:
        return None
    if bits not in (7, 8):
        raise ValueError(f"bits must be 7 or 8, got {bits}")
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    r, k = x.shape
    q = torch.empty(r, k, dtype=torch.int8)
    scale = torch.empty(r, dtype=torch.float32)

    # one thread: handing half the rows to the helper thread costs more than these passes
    # take at decoding sizes, and two threads did not speed up even the output layer's
    # dequantizing (measured: docs/performance.md)
    fn = lib.aiayn_quantize_rows if bits == 8 else lib.aiayn_quantize_rows_r7
    fn(x.data_ptr(), x.stride(0), 0, r, k, q.data_ptr(), scale.data_ptr())
    return q, scale


def dequantize_rows(
    acc: Tensor, row_scale: Tensor, col_scale: Tensor, bias: Tensor | None, relu: bool = False
) -> Tensor | None:
    """The (R, N) int32 products `acc` as float32, in place (the result shares acc's
    memory): acc * row_scale[:, None] * col_scale (+ bias), then max(0, .) with `relu`.
    None without the library."""
    lib = library()
    if lib is None:
        return None
    assert acc.dtype == torch.int32 and acc.is_contiguous() and acc.dim() == 2
    assert row_scale.is_contiguous() and col_scale.is_contiguous()
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    r, n = acc.shape
    b = None if bias is None else bias.data_ptr()

    lib.aiayn_dequantize_rows(
        acc.data_ptr(), 0, r, n, row_scale.data_ptr(), col_scale.data_ptr(), b, int(relu)
    )  # one thread, as quantize_rows
    return acc.view(torch.float32)


#: Output columns per panel of a packed int8 weight (PANEL in csrc/int8_gemm.c).
INT8_PANEL = 8


def int8_pack(b: Tensor) -> Tensor | None:
    """The (N, K) int8 weight `b` (unit column stride) packed for `int8_gemm`: panels of 8
    output columns, 4 k at a time, then each column's sum (csrc/int8_gemm.c). None without
    the library."""
    lib = library()
    if lib is None:
        return None
    assert b.dtype == torch.int8 and b.dim() == 2 and b.stride(1) == 1
    n, k = b.shape
    panels = (n + INT8_PANEL - 1) // INT8_PANEL
    size = panels * ((k + 3) // 4) * 32 + panels * INT8_PANEL * 4
    packed = torch.empty(size, dtype=torch.int8)
    lib.aiayn_int8_pack(b.data_ptr(), b.stride(0), n, k, packed.data_ptr())
    return packed


#: Rows below which the two threads split a product's columns instead of its rows.
INT8_MIN_ROWS_PER_THREAD = 8


def int8_gemm(
    a: Tensor,
    packed: Tensor,
    n: int,
    c0: int = 0,
    c1: int | None = None,
    out: Tensor | None = None,
    *,
    plain: bool = False,
    nonneg: bool = False,
    r7: bool = False,
) -> Tensor:
    """a @ B[c0:c1].T exactly, for the (M, K) int8 `a` (unit column stride) and the weight
    B (N = `n` rows) packed by `int8_pack`: (M, c1 - c0) int32, into `out` (contiguous) if
    given. c0 a multiple of 8. `plain`: the C loops even where the AVX2 path was built (for
    the tests). `nonneg`: every element of `a` is >= 0 (a ReLU's output), which the AVX2
    kernel multiplies without moving signs (~1.4x on Zen 3; wrong sums for a negative `a`).
    `r7`: `a` is `quantize_rows(x, bits=7)`'s (a + 64): the product of (a - 64), at the
    speed of `nonneg`. With two intra-op threads the rows (or, for few rows, the columns)
    are split with the helper thread. Check `library()` first."""
    lib = library()
    assert lib is not None and a.dtype == torch.int8 and a.dim() == 2 and a.stride(1) == 1
    c1 = n if c1 is None else c1
    assert 0 <= c0 < c1 <= n and c0 % INT8_PANEL == 0, (c0, c1, n)
    m, k = a.shape
    if out is None:
        out = torch.empty(m, c1 - c0, dtype=torch.int32)
    assert out.shape == (m, c1 - c0) and out.dtype == torch.int32 and out.is_contiguous()
    if r7:
        n_all = n

        def fn(a_, lda, r0, r1, k_, p, lo, hi, c, ldc):  # type: ignore[no-untyped-def]
            lib.aiayn_int8_gemm_r7(a_, lda, r0, r1, k_, p, n_all, lo, hi, c, ldc)
    elif plain:
        fn = lib.aiayn_int8_gemm_plain
    else:
        fn = lib.aiayn_int8_gemm_nonneg if nonneg else lib.aiayn_int8_gemm
    ld = c1 - c0
    if m >= 2 * INT8_MIN_ROWS_PER_THREAD or torch.get_num_threads() < 2:

        def rows(part: int, r0: int, r1: int) -> None:
            fn(a.data_ptr(), a.stride(0), r0, r1, k, packed.data_ptr(), c0, c1,
               out.data_ptr() + 4 * r0 * ld, ld)  # fmt: skip

        _in_two_parts(m, INT8_MIN_ROWS_PER_THREAD, rows)
    else:  # few rows (greedy decoding of a few sentences): the columns in two halves
        half = c0 + (c1 - c0) // 2 // (2 * INT8_PANEL) * (2 * INT8_PANEL)

        def cols(lo: int, hi: int) -> None:
            fn(a.data_ptr(), a.stride(0), 0, m, k, packed.data_ptr(), lo, hi,
               out.data_ptr() + 4 * (lo - c0), ld)  # fmt: skip

        if half <= c0:
            cols(c0, c1)
        else:
            other = _helper().submit(cols, half, c1)
            cols(c0, half)
            other.result()
    return out


def bpe_dropout(
    sym: Tensor,
    off: Tensor,
    keys: Tensor,
    merged: Tensor,
    score: Tensor,
    v: int,
    seed: int,
    threshold: int,
) -> tuple[Tensor, Tensor] | None:
    """BPE-dropout's merges of every word (csrc/bpe_dropout.c): word w starts as
    sym[off[w]:off[w+1]] (int32, int64); returns (pieces, count): word w's pieces are
    pieces[off[w]:off[w] + count[w]]. None without the library (the caller then runs
    data._bpe_dropout_words, the same algorithm in Python)."""
    lib = library()
    if lib is None:
        return None
    n_words = off.numel() - 1
    out = torch.empty_like(sym)
    count = torch.empty(n_words, dtype=torch.int64)
    lib.aiayn_bpe_dropout(
        sym.data_ptr(),
        off.data_ptr(),
        n_words,
        keys.data_ptr(),
        merged.data_ptr(),
        score.data_ptr(),
        keys.numel(),
        v,
        seed % 2**64,
        threshold,
        out.data_ptr(),
        count.data_ptr(),
    )
    return out, count
