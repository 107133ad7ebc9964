"""Table 1 as text: the paper's columns with the measurement beside each formula, then
the settings, the machine and where self-attention overtakes the recurrent layer."""

from __future__ import annotations

from typing import Any

from aiayn.analysis.table1 import FORMULAS, NAMES, Report, large_half

#: How far a fitted exponent may be from the formula's before the table marks it.
TOLERANCE = 0.15


def _measured_complexity(kind: str, fit: dict[str, float]) -> str:
    if "seconds_exponent" not in fit:
        return "-"
    cells = []
    for key, what in (("seconds", "time"), ("flops", "FLOPs")):
        p = fit[f"{key}_exponent"]
        off = abs(p - FORMULAS[kind][1]) > TOLERANCE
        cells.append(f"{what} n^{p:.2f}{' *' if off else ''}")
    return ", ".join(cells)


def _measured_sequential(q: dict[str, Any]) -> str:
    if q["per_position"] == 0:
        return f"{q['ops'][-1]} at every n ({q['n'][0]}..{q['n'][-1]})"
    return f"{q['per_position']:.3g} per position ({q['ops'][0]} at n={q['n'][0]}, " + (
        f"{q['ops'][-1]} at n={q['n'][-1]})"
    )


def _measured_path(kind: str, p: dict[str, Any]) -> str:
    if kind == "recurrent":
        return f"{p['steps']} steps within {p['layers']} layer"
    if "dilated_layers" in p:
        return f"{p['dilated_layers']} layers dilated, {p['layers']} contiguous"
    return f"{p['layers']} layer{'s' if p['layers'] != 1 else ''}"


def _crossover_line(report: Report) -> str:
    d = report.settings.d
    out = []
    for key, what in (("flops", "FLOPs"), ("seconds", "time")):
        if key not in report.crossover:
            continue
        n = report.crossover[key]
        out.append(
            f"{what}: never in n <= {report.settings.n_max}"
            if n is None
            else f"{what}: from n ~ {n:.0f} = {n / d:.2g} d"
        )
    return (
        "self-attention costs more than the recurrent layer (the paper: when n > d; the "
        f"multiply-adds cross at n = 2d = {2 * d}): " + "; ".join(out)
        if out
        else ""
    )


def format_table(report: Report) -> str:
    """The paper's Table 1 as a markdown table, a measured column beside each formula,
    then the settings, the machine and the crossover."""
    s = report.settings
    ns = s.grid()
    big = ns[large_half(ns)]
    header = [
        "Layer Type",
        "Complexity per Layer",
        f"measured (n={big[0]}..{big[-1]})",
        "Sequential Operations",
        "measured (dependent ops)",
        "Maximum Path Length",
        f"measured (n={s.path_n})",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind in s.kinds:
        complexity, _, sequential, path = FORMULAS[kind]
        cells = [
            NAMES[kind],
            complexity,
            _measured_complexity(kind, report.fits.get(kind, {})),
            sequential,
            _measured_sequential(report.sequential[kind]),
            path,
            _measured_path(kind, report.path[kind]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"d={s.d}, h={s.h}, k={s.k}, r={s.r}, batch {s.batch}, n={ns[0]}..{ns[-1]}; "
        f"{s.device}: {report.machine}",
        f"time: median of {s.repeats} forward + backward passes after {s.warmup} warm-up; "
        f"FLOPs: PyTorch's count, forward + backward; memory: {report.memory_kind}",
        f"*: more than {TOLERANCE} from the formula's exponent in n (1, or 2 for "
        "self-attention) on the large-n half of the grid",
    ]
    crossing = _crossover_line(report)
    return "\n".join([*lines, crossing] if crossing else lines)
