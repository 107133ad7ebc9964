"""What runs best on this CPU: the one place that answers it for training, decoding and the
compiled kernels.

Why a seam of its own: the same code is fast on one CPU and ten times slower on another.
bf16 autocast is ~6x float32 on AMX (Sapphire Rapids) and ~2x with AVX-512 BF16 (Zen 4),
but emulated, 10-70x slower than float32, on AVX2-only CPUs (Zen 2/3, Intel client
chips), the commonest x86 machines; PyTorch's int8 products are exact and fast only with
VNNI (elsewhere aiayn's own kernel computes them: `int8_ops`). So the defaults ("auto")
are decided here, for the machine a command runs on, from two things:

- the CPU's class (`aiayn.cpu_isa.CPU_CLASSES`), read from its feature flags
  (/proc/cpuinfo), capped by `AIAYN_CPU_ISA` or oneDNN's own `ONEDNN_MAX_CPU_ISA` where set
  (the way to run, and test, one class's choices on a bigger CPU: `isa_environment`);
- a short probe of what each precision really gets here (`probe`: 512^3 products in
  fp32 and bf16 as training runs them, and a small beam search in fp32, bf16 and int8 as
  decoding runs it; 0.1-2 s), cached on disk per CPU, class cap and torch version.

`choose(cpu_class, rates)` turns them into a `Choice` and is a pure function, so the tests
check every class's choices on any one machine by injecting flags and probe results.
`best()` is this machine's choice, `describe()` the line the commands print, and
`cast_for_inference` makes a model the precision asked for ("auto" included).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiayn.cpu_isa import (
    CPU_CLASSES,
    ISA_VARIABLE,
    NATIVE_BF16,
    Cpu,
    capped,
    classify,
    cpu,
    isa_cap,
    isa_environment,
    kernel_isa,
)
from aiayn.model import Transformer

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_CLASSES",
    "ISA_VARIABLE",
    "NATIVE_BF16",
    "capped",
    "isa_cap",
    "kernel_isa",
    "Choice",
    "Cpu",
    "Rates",
    "best",
    "cast_for_inference",
    "int8_bits",
    "choose",
    "classify",
    "cpu",
    "describe",
    "isa_environment",
    "probe",
    "resolve_decode_dtype",
    "slow_bf16_warning",
]


# ---------------------------------------------------------------------------------- probe

#: The probe's training shape: an n^3 product (512: under a second where bf16 is emulated).
TRAIN_N = 512
#: The probe's decoding model and search: a small random Transformer whose step has every
#: part of a real one (products, cached and encoder attention, output layer, beam step).
PROBE_MODEL = {"N": 2, "d_model": 256, "d_ff": 1024, "h": 4, "d_k": 64, "d_v": 64}
PROBE_VOCAB, PROBE_SENTENCES, PROBE_BEAM, PROBE_STEPS = 8000, 32, 4, 8
#: Bump when the probe's method changes: cached results of an older probe are not reused.
PROBE_VERSION = 4  # 4: the one-call decoder step; int8 products by aiayn without VNNI


@dataclass(frozen=True)
class Rates:
    """What the probe measured on this machine's threads.

    train_fp32, train_bf16: GFLOP/s of n^3 products (`TRAIN_N`), as training's autocast
    runs them. decode_fp32, decode_bf16, decode_int8: sentences/s of a small decoding
    search (`PROBE_MODEL`: encoder, then `PROBE_STEPS` incremental steps of
    `PROBE_SENTENCES` x `PROBE_BEAM` rows with the beam step's normaliser and top-k) in
    each inference precision, as `cast_for_inference` makes the model, on one thread
    (`threads` is the training products' thread count). Where the
    product probe shows bf16 emulated (under a fifth of float32's rate), the bf16 search is
    not run (it takes seconds there) and its rate is float32's scaled by that ratio.
    int8_fallback: PyTorch warned that its int8 product fell back to a generic loop.
    int8_backend: what computed the int8 products (`int8_ops.backend`): "torch"
    (torch._int_mm, exact here: VNNI or AMX), "aiayn" (aiayn's exact kernel, where
    oneDNN's would saturate) or "float".
    """

    train_fp32: float
    train_bf16: float
    decode_fp32: float
    decode_bf16: float
    decode_int8: float
    threads: int
    seconds: float = 0.0
    int8_fallback: bool = False
    int8_backend: str = "torch"

    def decode(self, dtype: str) -> float:
        return {"fp32": self.decode_fp32, "bf16": self.decode_bf16, "int8": self.decode_int8}[dtype]


def _median_time(fn: Callable[[], Any], *, budget_s: float, warmup: int = 1) -> float:
    """The median of fn's times: at least 3 runs, more while under budget_s (at most 9)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < 9 and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _probe_search(dtype: str) -> Callable[[], None]:
    """One decoding search of the probe's random model in `dtype`, ready to time."""
    from aiayn.config import ModelConfig
    from aiayn.fast import native
    from aiayn.fast.inference import Int8Linear, cast
    from aiayn.fast.layers import FastTransformer
    from aiayn.model import Transformer

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**PROBE_MODEL, vocab_size=PROBE_VOCAB)).eval()  # type: ignore[arg-type]
    model = cast(model, dtype, 8 if dtype == "int8" else None)  # not the environment's
    assert isinstance(model, FastTransformer)  # `cast` plugs the speed paths in
    src = torch.randint(4, PROBE_VOCAB, (PROBE_SENTENCES, 14), generator=gen)
    rows = PROBE_SENTENCES * PROBE_BEAM

    def search() -> None:
        with torch.inference_mode():
            memory, mask = model.encode(src)
            memory = memory.repeat_interleave(PROBE_BEAM, 0)
            mask = mask.repeat_interleave(PROBE_BEAM, 0)
            states = model.init_state(memory, PROBE_STEPS + 1)
            last = torch.full((rows, 1), 2, dtype=torch.long)  # BOS
            for _ in range(PROBE_STEPS):
                hidden = model.decode_hidden(last, mask, states)
                out_layer = model.generator
                head = out_layer.lse_topk if isinstance(out_layer, Int8Linear) else None
                best = head(hidden, PROBE_BEAM, ()) if head is not None else None
                if best is None:
                    logits = model.generator(hidden)
                    best = native.lse_topk(logits, PROBE_BEAM, ()) or logits.float().topk(
                        PROBE_BEAM
                    )
                last = best[1][:, :1]

    return search


def measure_rates() -> Rates:
    """Measure `Rates` now (well under a second where bf16 is native, ~1 s where not)."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    n = TRAIN_N
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    train: dict[str, float] = {}
    for name, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x, y = a.to(torch_dtype), b.to(torch_dtype)

        def product(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return x @ y

        train[name] = 2 * n**3 / _median_time(product, budget_s=0.15) / 1e9
    emulated = train["bf16"] < train["fp32"] / 5
    decode: dict[str, float] = {}
    threads = torch.get_num_threads()
    # on one thread, as decoding workers run (the search's small products gain little
    # from a second thread; at two threads bf16 and int8 measured within 7% of each other)
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for dtype in ("fp32", "int8") if emulated else ("fp32", "bf16", "int8"):
                seconds = _median_time(_probe_search(dtype), budget_s=0.2)
                decode[dtype] = PROBE_SENTENCES / seconds
    finally:
        torch.set_num_threads(threads)
    if emulated:
        decode["bf16"] = decode["fp32"] * train["bf16"] / train["fp32"]
    fallback = any("switching to BLAS" in str(w.message) for w in caught)
    from aiayn.fast import int8_ops

    return Rates(
        train_fp32=train["fp32"],
        train_bf16=train["bf16"],
        decode_fp32=decode["fp32"],
        decode_bf16=decode["bf16"],
        decode_int8=decode["int8"],
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - t0,
        int8_fallback=fallback,
        int8_backend=int8_ops.backend(),
    )


def _probe_key(c: Cpu) -> str:
    parts = [
        str(PROBE_VERSION),
        c.model,
        " ".join(sorted(c.flags)),
        c.cls,
        torch.__version__,
        *(f"{k}={os.environ.get(k, '')}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cache_path(c: Cpu) -> Path:
    from aiayn.fast.native import cache_dir

    return cache_dir() / f"machine-{_probe_key(c)}.json"


_rates: dict[int, Rates] = {}  # this process's probe, at key 0


def probe(*, refresh: bool = False) -> Rates:
    """This machine's `Rates`, measured once and cached on disk (`AIAYN_CACHE_DIR`, by the
    CPU, its class cap and torch's version, not the thread count: every process on a
    machine, decoding workers of one thread included, makes the same choice); `refresh`
    measures again. A cache that cannot be read or written is measured around, not an
    error."""
    if not refresh and _rates:
        return _rates[0]
    c = cpu()
    path = _cache_path(c)
    if not refresh:
        try:
            data = json.loads(path.read_text())
            rates = Rates(**data["rates"])
            _rates[0] = rates
            return rates
        except (OSError, ValueError, KeyError, TypeError):
            pass
    rates = measure_rates()
    _rates[0] = rates
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"cpu": c.model, "class": c.cls, "rates": asdict(rates)}))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not cache the machine probe at %s: %s", path, e)
    return rates


# --------------------------------------------------------------------------------- choice

#: On a CPU that multiplies bf16 natively, bf16 trains by default unless the probe finds its
#: products slower than float32's (AMX: ~6x, AVX-512 BF16: ~2x; emulated: ~0.01-0.1x, so a
#: noisy probe on a busy machine cannot flip the choice).
BF16_TRAIN_GAIN = 1.0
#: A lower decoding precision is the default only where the probe's search runs at least
#: this much faster in it than in the next higher one: the gain must outweigh its rounding.
DECODE_GAIN = 1.15


@dataclass(frozen=True)
class Choice:
    """What aiayn runs by default on a machine, and why."""

    cpu_class: str
    train_dtype: str
    decode_dtype: str
    kernels: str  # the compiled kernels' instruction set: avx512, avx2 or portable
    reasons: dict[str, str] = field(default_factory=dict)
    rates: Rates | None = None
    #: bits of an auto int8 model's activations (`inference.int8_activation_bits`): 7 where
    #: aiayn's kernel multiplies them (no VNNI), 8 elsewhere
    int8_bits: int = 8

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose(cls: str, rates: Rates) -> Choice:
    """The default training and decoding precisions for a CPU of class `cls` with the
    measured `rates` (pure: the tests give it every class).

    Training: bf16 where the CPU multiplies bf16 natively (`NATIVE_BF16`) and the probe
    confirms it (`BF16_TRAIN_GAIN`), else float32. Decoding: the fastest of the probe's
    three searches, a lower precision only where it gains `DECODE_GAIN` over the higher
    (int8 against the best float, bf16 against float32), and int8 not where PyTorch fell
    back to its generic int8 loop.
    """
    if cls not in CPU_CLASSES:
        raise ValueError(f"unknown CPU class {cls!r}")
    reasons = {}
    bf16_gain = rates.train_bf16 / max(rates.train_fp32, 1e-9)
    if cls in NATIVE_BF16 and bf16_gain >= BF16_TRAIN_GAIN:
        train = "bf16"
        reasons["train"] = f"this CPU multiplies bf16 natively ({bf16_gain:.1f}x float32)"
    else:
        train = "fp32"
        reasons["train"] = (
            f"bf16 would be emulated ({bf16_gain:.2f}x float32)"
            if cls not in NATIVE_BF16
            else f"bf16 measured only {bf16_gain:.2f}x float32 here"
        )
    decode, best = "fp32", rates.decode_fp32
    if rates.decode_bf16 >= DECODE_GAIN * best:
        decode, best = "bf16", rates.decode_bf16
    int8_gain = rates.decode_int8 / max(best, 1e-9)
    if rates.int8_fallback:
        reasons["decode_int8"] = "PyTorch's int8 product fell back to its generic loop here"
    elif int8_gain >= DECODE_GAIN:
        decode = "int8"
    reasons["decode"] = (
        "probe search: "
        + ", ".join(f"{d} {rates.decode(d):.0f}" for d in ("fp32", "bf16", "int8"))
        + " sentences/s"
    )
    kernels, int8_bits = kernel_isa(cls), 8
    if decode == "int8" and rates.int8_backend == "aiayn" and kernels != "portable":
        int8_bits = 7
        reasons["int8_bits"] = (
            "7-bit activations: without VNNI aiayn's SIMD kernel multiplies them without "
            "moving signs, ~1.4x the products a second; their cost in BLEU and F1 was not "
            "measurable (docs/performance.md)"
        )
    return Choice(cls, train, decode, kernels, reasons, rates, int8_bits)


@functools.cache
def best() -> Choice:
    """This machine's `Choice` (probed once per process; cached on disk across them)."""
    return choose(cpu().cls, probe())


def resolve_decode_dtype(dtype: str, device: torch.device | str = "cpu") -> str:
    """An inference precision as given, with "auto" made concrete: on the CPU this
    machine's fastest (`best`), on CUDA bf16 where the GPU has it natively, else fp32."""
    if dtype != "auto":
        return dtype
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    if device.type != "cpu":
        return "fp32"
    return best().decode_dtype


def int8_bits(dtype: str) -> int:
    """The bits of an int8 model's activations for a requested `dtype`:
    AIAYN_INT8_ACTIVATIONS where set, else this machine's choice for "auto"
    (`Choice.int8_bits`) and 8 for an explicit "int8" (exact to the int8 grid, the same
    outputs on every CPU). ValueError on a mistyped variable."""
    from aiayn.fast.inference import int8_activation_bits

    return int8_activation_bits(best().int8_bits if dtype == "auto" else 8)


def describe(choice: Choice | None = None, c: Cpu | None = None) -> str:
    """One line naming the CPU, its class, the defaults chosen and the measured rates:
    the first line of train, translate and serve, and in `aiayn info`."""
    choice = choice or best()
    c = c or cpu()
    r = choice.rates
    rates = (
        f"; products fp32 {r.train_fp32:.0f}, bf16 {r.train_bf16:.0f} GFLOP/s, "
        f"probe search fp32 {r.decode_fp32:.0f} / bf16 {r.decode_bf16:.0f} / int8 "
        f"{r.decode_int8:.0f} sentences/s (int8 products: {r.int8_backend}); "
        f"{r.threads} thread{'s' if r.threads > 1 else ''}"
        if r
        else ""
    )
    held = f" (held to it by {ISA_VARIABLE} or ONEDNN_MAX_CPU_ISA)" if c.cap else ""
    bits = " (7-bit activations)" if choice.decode_dtype == "int8" and choice.int8_bits == 7 else ""
    return (
        f"CPU {c.model}: class {choice.cpu_class}{held}; auto dtype: train "
        f"{choice.train_dtype}, decode {choice.decode_dtype}{bits}; C kernels "
        f"{choice.kernels}{rates}"
    )


def slow_dtype_warning(dtype: str, what: str) -> str | None:
    """A one-line warning when an explicit `dtype` runs far slower here than the default,
    with the measured factor; None where it does not. `what`: "train" or "decode"."""
    choice = best()
    r = choice.rates
    if r is None or dtype not in ("bf16", "int8"):
        return None
    if what == "train":
        if dtype != "bf16" or choice.train_dtype == "bf16":
            return None
        factor = r.train_fp32 / max(r.train_bf16, 1e-9)
        if factor < 1 / BF16_TRAIN_GAIN:
            return None
        return (
            f"dtype bf16 on a CPU of class {choice.cpu_class}: its bf16 products are "
            f"emulated, {factor:.1f}x slower than float32 here (measured); dtype auto "
            "(the default) trains in float32 on this CPU"
        )
    rate, fast = r.decode(dtype), r.decode(choice.decode_dtype)
    if dtype == choice.decode_dtype or rate * 1.5 > fast:
        return None
    return (
        f"dtype {dtype} on a CPU of class {choice.cpu_class}: a decoding layer runs "
        f"{fast / max(rate, 1e-9):.1f}x slower in {dtype} than in {choice.decode_dtype} "
        f"here (measured); --dtype auto (the default) decodes in {choice.decode_dtype}"
    )


#: bf16 counts as slow when its products run below this fraction of float32's (a margin for
#: timing noise: where bf16 is emulated, the gap is far wider than that, see below).
SLOW_BF16_FRACTION = 0.8


def slow_bf16_warning(device: str | torch.device = "cpu") -> str | None:
    """A one-line warning when bf16 matrix products are slower than float32 on this CPU,
    with the measured factor, else None.

    bf16 autocast pays only where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX).
    Elsewhere it is slower than float32: with AVX-512 but no BF16 (Skylake, Cascade Lake)
    oneDNN emulates it, and with AVX2 only PyTorch falls back to its generic kernel, far
    slower still. The rates are the machine probe's (`machine.probe`: 512^3 products,
    measured once and cached), so this also catches a PyTorch build without oneDNN.
    """
    if torch.device(device).type != "cpu":
        return None
    r = probe()
    fp32, bf16 = r.train_fp32, r.train_bf16
    if bf16 >= SLOW_BF16_FRACTION * fp32:
        return None
    return (
        f"bf16 matrix products run at {bf16:.0f} GFLOP/s on this CPU and float32 at "
        f"{fp32:.0f} ({fp32 / max(bf16, 1e-9):.1f}x faster; class "
        f"{cpu().cls}): it has no native bf16 (AVX-512 BF16 or AMX), so dtype "
        "bf16 is slower here; dtype auto (the default) picks float32 on this CPU"
    )


def cast_for_inference(model: Transformer, dtype: str) -> Transformer:
    """The model in an inference precision: "fp32" as trained, "bf16" (weights and
    activations; AMX on recent Intel CPUs, with the weights packed for oneDNN once),
    "int8" (dynamic quantization of every Linear, `Int8Linear`: int8 weights per output
    column, activations quantized per row at run time; CPU only), or "auto": the one this
    machine decodes fastest in (`resolve_decode_dtype`), whatever the checkpoint
    was trained in. The model becomes the fast one (`aiayn.fast.accelerate`) and its
    parameters stop requiring gradients: this is for decoding only. An explicit precision
    that runs far slower here than auto's (bf16 where it is emulated, int8 where PyTorch's
    int8 product is slow) is kept, with a one-line warning and the measured factor."""
    from aiayn.fast.inference import INFERENCE_DTYPES, cast

    if dtype not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(INFERENCE_DTYPES)}, got {dtype!r}")
    device = next(model.parameters()).device
    requested = dtype
    if dtype == "auto":
        dtype = resolve_decode_dtype("auto", device)
        model.float()  # a checkpoint's parameters may be bf16: start from float32
    elif dtype == "int8" and device.type == "cpu":
        warning = slow_dtype_warning("int8", "decode")
        if warning:
            logger.warning(warning)
    if dtype == "bf16":
        warning = slow_bf16_warning(device)
        if warning:
            logger.warning(warning)
    return cast(model, dtype, int8_bits(requested) if dtype == "int8" else None)
