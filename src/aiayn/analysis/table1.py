"""Table 1 of the paper (section 4), measured: per layer kind, time (forward + backward),
FLOPs and memory as n grows, each fitted to n^p on the large-n half of the grid, beside
the table's formulas; the sequential operations and maximum path lengths measured from
the computation (`aiayn.analysis.paths`).

The paper's table is asymptotic and in multiply-adds; a measurement on one machine says
where the asymptotics start and what the constants are: e.g. where self-attention's cost
overtakes the recurrent layer's (the paper: when n exceeds d).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiayn.analysis import paths
from aiayn.analysis.layers import KINDS, build
from aiayn.analysis.measure import count_flops, machine, peak_memory, time_step
from aiayn.files import atomic_write, write_text_atomic

#: The paper's columns for each kind: complexity per layer, its exponent in n, sequential
#: operations, maximum path length (the separable convolution is from section 4's text).
FORMULAS = {
    "self-attention": ("O(n^2 d)", 2, "O(1)", "O(1)"),
    "recurrent": ("O(n d^2)", 1, "O(n)", "O(n)"),
    "convolutional": ("O(k n d^2)", 1, "O(1)", "O(log_k n)"),
    "separable": ("O(k n d + n d^2)", 1, "O(1)", "O(log_k n)"),
    "restricted": ("O(r n d)", 1, "O(1)", "O(n/r)"),
}
NAMES = {
    "self-attention": "Self-Attention",
    "recurrent": "Recurrent (LSTM)",
    "convolutional": "Convolutional",
    "separable": "Separable convolution",
    "restricted": "Self-Attention (restricted)",
}


@dataclass(frozen=True)
class Settings:
    """What `aiayn table1` measures; n runs over powers of 2 from n_min to n_max."""

    d: int = 64
    h: int = 4
    k: int = 3
    r: int = 9
    batch: int = 1
    n_min: int = 16
    n_max: int = 4096
    repeats: int = 5
    warmup: int = 1
    path_n: int = 64
    device: str = "cpu"
    kinds: tuple[str, ...] = KINDS

    def grid(self) -> list[int]:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        return [self.n_min * 2**i for i in range(int(math.log2(self.n_max / self.n_min)) + 1)]


@dataclass
class Measurement:
    """One layer kind at one n: median seconds of forward + backward (and the spread of
    the repeats), FLOPs counted forward and forward + backward, peak memory in bytes."""

    kind: str
    n: int
    seconds: float
    seconds_min: float
    seconds_max: float
    flops_forward: int
    flops: int
    memory_bytes: int


@dataclass
class Report:
    """Everything `aiayn table1` measured: the rows, each kind's fitted exponents in n
    (`fits`: seconds, flops and memory_bytes_exponent), the dependent ops and path lengths
    (`paths.measure_structure`), and the n from which self-attention's seconds / flops
    exceed the recurrent layer's (`crossover`)."""

    settings: Settings
    machine: str
    memory_kind: str
    rows: list[Measurement] = field(default_factory=list)
    fits: dict[str, dict[str, float]] = field(default_factory=dict)
    sequential: dict[str, dict[str, Any]] = field(default_factory=dict)
    path: dict[str, dict[str, Any]] = field(default_factory=dict)
    crossover: dict[str, float | None] = field(default_factory=dict)

    def series(self, kind: str, key: str) -> tuple[list[int], list[float]]:
        rows = [m for m in self.rows if m.kind == kind]
        return [m.n for m in rows], [float(getattr(m, key)) for m in rows]

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "machine": self.machine,
            "memory_kind": self.memory_kind,
            "rows": [asdict(m) for m in self.rows],
            "fits": self.fits,
            "sequential": self.sequential,
            "path": self.path,
            "crossover": self.crossover,
        }


# --------------------------------------------------------------------------- measuring
def measure(
    settings: Settings, progress: Callable[[str, int], None] | None = None
) -> list[Measurement]:
    """Every kind at every n of the grid (n outer, so that a drift in the machine's load
    touches all kinds alike). `progress(kind, n)` after each."""
    device = torch.device(settings.device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = {
            kind: build(kind, settings.d, h=settings.h, k=settings.k, r=settings.r).to(device)
            for kind in settings.kinds
        }
    rows = []
    for n in settings.grid():
        for kind, layer in layers.items():
            x = torch.randn(settings.batch, n, settings.d, device=device, requires_grad=True)
            grad = torch.randn_like(x)
            times = time_step(layer, x, grad, settings.repeats, settings.warmup)
            fwd, total = count_flops(layer, x, grad)
            rows.append(
                Measurement(
                    kind,
                    n,
                    statistics.median(times),
                    min(times),
                    max(times),
                    fwd,
                    total,
                    peak_memory(layer, x, grad),
                )
            )
            if progress is not None:
                progress(kind, n)
    return rows


# --------------------------------------------------------------------------- fitting
def large_half(ns: Sequence[int]) -> slice:
    """The points of the large-n half of a sorted grid (the middle point included)."""
    return slice(len(ns) // 2, len(ns))


def fit_exponent(ns: Sequence[float], values: Sequence[float]) -> float:
    """p of values ~ c n^p: the least-squares slope of log(value) against log(n)."""
    if len(ns) < 2:
        raise ValueError("fitting an exponent needs two points at least")
    xs, ys = [math.log(n) for n in ns], [math.log(v) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def crossover(ns: Sequence[int], a: Sequence[float], b: Sequence[float]) -> float | None:
    """The n from which a exceeds b for good, interpolated on the log-log lines between
    the grid points around it; None if a never ends above b, ns[0] if it always is."""
    above = [x > y for x, y in zip(a, b, strict=True)]
    if not above[-1]:
        return None
    i = len(above) - 1
    while i > 0 and above[i - 1]:
        i -= 1
    if i == 0:
        return float(ns[0])
    # log(a/b) goes from <= 0 at ns[i-1] to > 0 at ns[i]: where it crosses 0
    lo, hi = math.log(a[i - 1] / b[i - 1]), math.log(a[i] / b[i])
    t = lo / (lo - hi)
    return math.exp(math.log(ns[i - 1]) + t * (math.log(ns[i]) - math.log(ns[i - 1])))


def run_table1(settings: Settings, progress: Callable[[str, int], None] | None = None) -> Report:
    """Measure everything `Settings` asks for and fit it (see the module docstring)."""
    device = torch.device(settings.device)
    memory_kind = (
        "peak bytes allocated during forward + backward (torch.cuda.max_memory_allocated)"
        if device.type == "cuda"
        else "bytes of the activations autograd saves for backward (saved_tensors_hooks)"
    )
    report = Report(settings, machine(settings.device), memory_kind, measure(settings, progress))
    for kind in settings.kinds:
        ns, _ = report.series(kind, "n")
        half = large_half(ns)
        report.fits[kind] = {
            f"{key}_exponent": fit_exponent(ns[half], report.series(kind, key)[1][half])
            for key in ("seconds", "flops", "memory_bytes")
            if len(ns[half]) >= 2 and min(report.series(kind, key)[1]) > 0
        }
    report.sequential, report.path = paths.measure_structure(
        settings.kinds, settings.d, h=settings.h, k=settings.k, r=settings.r, n=settings.path_n
    )
    if {"self-attention", "recurrent"} <= set(settings.kinds):
        ns = report.series("recurrent", "n")[0]
        for key in ("seconds", "flops"):
            report.crossover[key] = crossover(
                ns, report.series("self-attention", key)[1], report.series("recurrent", key)[1]
            )
    return report


def plot(report: Report, out: Path) -> Path:
    """Time, FLOPs and memory against n, log-log, a line per kind with its fitted exponent."""
    from aiayn.analysis.plots import plot_loglog

    cuda = torch.device(report.settings.device).type == "cuda"
    memory = "peak bytes allocated" if cuda else "bytes saved for backward"
    panels = []
    for key, label in (
        ("seconds", "seconds (forward + backward)"),
        ("flops", "FLOPs counted (forward + backward)"),
        ("memory_bytes", memory),
    ):
        lines = {}
        for kind in report.settings.kinds:
            p = report.fits.get(kind, {}).get(f"{key}_exponent")
            lines[NAMES[kind] + (f" (n^{p:.2f})" if p is not None else "")] = report.series(
                kind, key
            )
        panels.append((label, lines))
    s = report.settings
    title = f"Table 1 measured: one layer, d={s.d}, batch {s.batch}, {s.device}: {report.machine}"
    return plot_loglog(panels, title, out, marks={"n = d": report.settings.d})


def write_outputs(report: Report, out: Path) -> list[Path]:
    """table1.csv (a row per kind and n), table1.json (everything) and table1.png."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "table1.csv", "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(report.rows[0])))
        writer.writeheader()
        writer.writerows(asdict(m) for m in report.rows)
    write_text_atomic(out / "table1.json", json.dumps(report.to_dict(), indent=1) + "\n")
    return [out / "table1.csv", out / "table1.json", plot(report, out / "table1.png")]
