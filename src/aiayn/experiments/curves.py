"""Training curves: training loss and validation perplexity against wall-clock time
(`plot_curves`, the recipes' curve.png), and any of the log's numbers against steps for
one run or several overlaid (`plot_runs`, `aiayn plot`).

Reads the `train_log.jsonl` every run writes; plots with matplotlib (the `plot` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiayn.files import InputError, atomic_write


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's train_log.jsonl, in order, as the run finally went (an empty
    list if there is none).

    The log is appended to, never rewritten: after a crash the run resumes from its last
    checkpoint and logs a `"event": "resumed"` record; the steps after that checkpoint were
    then done twice, and only their second pass is kept. A last line cut short by a kill
    is left out; any other line that is not JSON is an error naming the line.
    """
    path = Path(run_dir) / "train_log.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                continue  # written when the process was killed
            raise InputError(f"{path}:{lineno}: not a JSON record") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}:{lineno}: not a JSON record (an object), got {line[:40]!r}")
        if record.get("event") == "resumed":
            records = [r for r in records if r.get("step", 0) <= record["step"]]
        records.append(record)
    return records


def plot_curves(
    runs: dict[str, str | Path],
    out: str | Path,
    title: str = "",
    ppl_range: tuple[float, float] | None = None,
) -> Path:
    """One PNG, two panels: training loss and validation perplexity, minutes on the x axis.

    Args:
        runs: label -> run directory; several runs share the axes (e.g. fp32 vs bf16).
        out: the PNG to write.
        ppl_range: perplexity axis limits, to compare the ends of runs (default: all).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run_dir in runs.items():
        records = read_log(run_dir)
        train = [r for r in records if "loss" in r]
        valid = [r for r in records if "valid_ppl" in r]
        ax_loss.plot([r["time"] / 60 for r in train], [r["loss"] for r in train], label=label)
        ax_ppl.plot(
            [r["time"] / 60 for r in valid],
            [r["valid_ppl"] for r in valid],
            marker="o",
            label=label,
        )
    ax_loss.set(
        xlabel="training time (minutes)",
        ylabel="label-smoothed loss (per token)",
        title="training loss",
    )
    ax_ppl.set(
        xlabel="training time (minutes)",
        ylabel="perplexity",
        yscale="log",
        title="validation perplexity",
    )
    if ppl_range is not None:
        ax_ppl.set_ylim(*ppl_range)
    for ax in (ax_loss, ax_ppl):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return _save(fig, out, dpi=110)


#: What `plot_runs` can draw: a train_log.jsonl key -> (panel title, y label, log scale).
PLOT_METRICS: dict[str, tuple[str, str, bool]] = {
    "loss": ("training loss", "label-smoothed loss (per token)", False),
    "nll": ("training NLL", "NLL (nats per token)", False),
    "valid_ppl": ("validation perplexity", "perplexity (log scale)", True),
    "valid_nll": ("validation NLL", "NLL (nats per token)", False),
    "valid_bleu": ("validation BLEU", "sacreBLEU (validation subset)", False),
    "lr": ("learning rate", "learning rate (Eq. 3)", False),
    "gnorm": ("gradient norm", "global L2 norm (before clipping)", True),
    "tokens_per_s": ("throughput", "tokens per second", False),
}
DEFAULT_PLOT_METRICS = ("loss", "valid_ppl", "valid_bleu", "lr")


def read_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """`read_log`, for a run that must have one: an error naming the directory or file when
    the run, its log or the log's records are missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    path = run_dir / "train_log.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: missing; is {run_dir} a training run's directory?")
    records = read_log(run_dir)
    if not any(isinstance(r.get("step"), int) and "event" not in r for r in records):
        raise InputError(f"{path}: no training or validation records yet")
    return records


def run_labels(runs: list[str | Path]) -> dict[str, Path]:
    """Label -> run directory: each run's directory name, or the path as given where two
    names are the same (runs/a/seed1 and runs/b/seed1)."""
    names = [Path(r).name or str(r) for r in runs]
    labels = {}
    for run, name in zip(runs, names, strict=True):
        label = name if names.count(name) == 1 else str(run)
        if label in labels:
            raise InputError(f"{run}: given twice")
        labels[label] = Path(run)
    return labels


def plot_runs(
    runs: dict[str, Path],
    out: str | Path,
    metrics: tuple[str, ...] = DEFAULT_PLOT_METRICS,
) -> dict[str, dict[str, int]]:
    """One PNG, one panel per metric against training steps, the runs overlaid and named.

    Args:
        runs: label -> run directory (each with a train_log.jsonl).
        out: the PNG to write (its directory is made).
        metrics: keys of PLOT_METRICS; valid_ppl (and gnorm) on a log scale.
    Returns:
        metric -> label -> points drawn (0 where a run's log has none of that metric: its
        panel says so).
    Raises:
        InputError: a missing run or log, an empty one, or a line that is not a JSON record
            (naming the file and line); ImportError: matplotlib is not installed.
    """
    unknown = [m for m in metrics if m not in PLOT_METRICS]
    if unknown or not metrics:
        raise ValueError(
            f"unknown metric(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(PLOT_METRICS)}"
        )
    logs = {label: read_run(run_dir) for label, run_dir in runs.items()}  # errors first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(metrics) > 1 else 1
    rows = (len(metrics) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    drawn: dict[str, dict[str, int]] = {}
    for ax, metric in zip(axes.flat, metrics, strict=False):
        title, ylabel, log_scale = PLOT_METRICS[metric]
        drawn[metric] = {}
        for label, records in logs.items():
            points = [
                (r["step"], float(r[metric]))
                for r in records
                if isinstance(r.get(metric), int | float) and isinstance(r.get("step"), int)
            ]
            drawn[metric][label] = len(points)
            if points:
                xs, ys = zip(*points, strict=True)
                marker = "o" if metric.startswith("valid") else None
                ax.plot(xs, ys, label=label, marker=marker, markersize=3)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        if log_scale and any(drawn[metric].values()):
            ax.set_yscale("log")
        missing = [label for label, n in drawn[metric].items() if not n]
        if missing:
            ax.text(
                0.5,
                0.5,
                f"no {metric} in the log of " + ", ".join(missing),
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=8,
                color="gray",
                wrap=True,
            )
        ax.grid(alpha=0.3)
        if any(drawn[metric].values()):
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    fig.suptitle(", ".join(runs))
    _save(fig, out, dpi=100)
    return drawn


def _save(fig: Any, out: str | Path, dpi: int) -> Path:
    """Lay the figure out, write it to `out` (its folder made if missing) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(out) as f:  # `--out /dev/null`, a symlink: see files.output_kind
            fig.savefig(f, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return out
