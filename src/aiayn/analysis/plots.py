"""The pictures of `aiayn table1` and `aiayn attention`: Table 1's measurements on log-log
axes, and attention weights in the styles of the paper's Figures 3-5 (heat maps with the
subword tokens on the axes; lines from a word to the words it attends to, a colour per
head). Matplotlib is imported inside each function (the `plot` extra), with the Agg
backend: files only, no display needed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from aiayn.files import atomic_write


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path) -> Path:
    plt = _pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(out) as f:  # an interrupted draw leaves no half of a PNG
            fig.savefig(f, dpi=100, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    return out


def plot_loglog(
    panels: Sequence[tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]],
    title: str,
    out: Path,
    marks: Mapping[str, float] | None = None,
) -> Path:
    """Panels side by side on log-log axes (Table 1's measurements against n): each panel
    is (y-axis label, {line label: (n values, y values)}); `marks` are labelled vertical
    lines at those n (e.g. n = d)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.3 * len(panels), 4.8), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels, strict=True):
        for label, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        for label, n in (marks or {}).items():
            ax.axvline(n, color="grey", linestyle="--", linewidth=1)
            ax.annotate(
                label,
                (n, 1),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                fontsize=8,
                color="grey",
            )
        ax.set(yscale="log", xlabel="sequence length n", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, out)


def plot_heads(
    weights: Tensor,
    rows: Sequence[str],
    cols: Sequence[str],
    heads: Sequence[int],
    title: str,
    out: Path,
) -> Path:
    """Heat maps of the heads `heads` (0-based) of weights (H, Tq, Tk): queries down,
    keys across, 0 (white) to 1 (dark) on one scale for every head."""
    plt = _pyplot()
    ncols = min(4, len(heads))
    nrows = math.ceil(len(heads) / ncols)
    width, height = max(2.5, 0.28 * len(cols)), max(2.5, 0.28 * len(rows)) + 0.5
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(width * ncols + 1.2, height * nrows + 0.4),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, head in zip(axes.flat, heads, strict=False):
        image = ax.imshow(weights[head].float().cpu().numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_title(f"head {head + 1}", fontsize=9)
        ax.set_xticks(range(len(cols)), list(cols), rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)), list(rows), fontsize=7)
    for ax in list(axes.flat)[len(heads) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, fraction=0.02, pad=0.01, label="attention weight")
    return _save(fig, out)


def _lines(
    ax: Any,
    weights: Tensor,
    tokens: Sequence[str],
    rows: Sequence[int],
    color: Any,
    shift: float = 0.0,
) -> None:
    """Figure 3-5 style on one axis: tokens in two columns, a line from query row i (left)
    to key j (right) as opaque as its weight (one LineCollection: thousands of lines);
    `shift` moves the lines' right ends up or down a little, to tell heads apart."""
    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_rgba

    w = weights.float().cpu()
    segments, colors = [], []
    r, g, b, _ = to_rgba(color)
    for i in rows:
        for j in range(len(tokens)):
            if w[i, j] > 0.01:
                segments.append([(0.0, -i), (1.0, -j + shift)])
                colors.append((r, g, b, float(w[i, j])))
    ax.add_collection(LineCollection(segments, colors=colors, linewidths=2.5))
    for i, token in enumerate(tokens):
        ax.text(-0.05, -i, token, ha="right", va="center", fontsize=8)
        ax.text(1.05, -i, token, ha="left", va="center", fontsize=8)
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(-len(tokens) + 0.5, 0.5)
    ax.axis("off")


def plot_word(
    weights: Tensor, tokens: Sequence[str], word: int, heads: Sequence[int], title: str, out: Path
) -> Path:
    """Figure 3's picture: the attention of one word (query `word`, 0-based) in each head
    of weights (H, S, S), a colour per head (as the paper's), overlaid."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(5, max(3.0, 0.3 * len(tokens))))
    for n, head in enumerate(heads):
        shift = 0.6 * (n - (len(heads) - 1) / 2) / max(1, len(heads))  # heads side by side
        _lines(ax, weights[head], tokens, [word], cmap(n % 10), shift)
        ax.plot([], [], color=cmap(n % 10), linewidth=2.5, label=f"head {head + 1}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=9)
    return _save(fig, out)


def plot_head_lines(
    weights: Tensor, tokens: Sequence[str], heads: Sequence[int], title: str, out: Path
) -> Path:
    """Figures 4-5's picture: each head's full attention as lines from every word, a
    panel per head."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    ncols = min(4, len(heads))
    nrows = math.ceil(len(heads) / ncols)
    height = max(3.0, 0.3 * len(tokens))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, height * nrows), squeeze=False)
    for n, (ax, head) in enumerate(zip(axes.flat, heads, strict=False)):
        _lines(ax, weights[head], tokens, range(len(tokens)), cmap(n % 10))
        ax.set_title(f"head {head + 1}", fontsize=9)
    for ax in list(axes.flat)[len(heads) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, out)
