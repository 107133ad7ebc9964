"""Training curves: training loss and validation perplexity against wall-clock time.

Reads the `train_log.jsonl` every run writes; plots with matplotlib (the `plot` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiayn.files import InputError


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
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
