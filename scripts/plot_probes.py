"""Every probe of the En->De recipe at a glance: a picture and a table (docs/results.md).

    python scripts/plot_probes.py                      # docs/m30k-en-de-probes.png
    python scripts/plot_probes.py --markdown           # also print the table

Reads docs/m30k-en-de-probes.csv: one line per run of a probe (a change to the recipe)
with the test_2016_flickr tok-BLEU of that run and of the recipe run it is paired with
(same machine kind, same seed), as the experiment file of docs/experiments/ whose
heading the line's `section` names records them. Seeds of one probe are averaged, and so
are their paired recipe runs.
"""

from __future__ import annotations

import argparse
import csv
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "docs" / "m30k-en-de-probes.csv"
PNG = ROOT / "docs" / "m30k-en-de-probes.png"
EXPERIMENTS = ROOT / "docs" / "experiments"

#: issue 3's target and the published number for the recipe's model (tok-BLEU)
TARGET, PUBLISHED = 42.0, 41.02
#: the recipe's seeds 1-3 on the issue's machine kind (docs/results.md)
RECIPE_SEEDS = (41.11, 39.60, 40.60)


@dataclass
class Probe:
    """One change to the recipe on one machine: its seeds' scores and their paired runs'."""

    probe: str
    knob: str
    machine: str
    steps: str
    section: str
    seeds: list[int] = field(default_factory=list)
    recipe_test: list[float] = field(default_factory=list)
    arm_test: list[float] = field(default_factory=list)
    recipe_val: list[float] = field(default_factory=list)
    arm_val: list[float] = field(default_factory=list)

    def change(self, split: str) -> float | None:
        """The probe's mean minus its paired recipe runs' mean (None: not recorded)."""
        recipe, arm = getattr(self, f"recipe_{split}"), getattr(self, f"arm_{split}")
        return mean(arm) - mean(recipe) if recipe and arm else None


def read_probes(path: Path = CSV) -> list[Probe]:
    """The CSV's lines grouped by (probe, machine), in the file's order."""
    probes: dict[tuple[str, str], Probe] = {}
    with path.open(encoding="utf-8", newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            p = probes.setdefault(
                (row["probe"], row["machine"]),
                Probe(row["probe"], row["knob"], row["machine"], row["steps"], row["section"]),
            )
            try:
                p.seeds.append(int(row["seed"]))
                for col in ("recipe_test", "arm_test", "recipe_val", "arm_val"):
                    if row[col]:
                        getattr(p, col).append(float(row[col]))
            except ValueError as e:
                raise SystemExit(f"{path}:{line}: {e}") from None
    return list(probes.values())


def record(section: str, experiments: Path = EXPERIMENTS) -> str:
    """The section as a link to the file of docs/experiments/ whose `# ` heading starts
    with it (relative to docs/), or the section's name alone where no file has it."""
    for path in sorted(experiments.glob("*.md")):
        with path.open(encoding="utf-8") as f:
            if f.readline().startswith(f"# {section}"):
                return f"[{section}](experiments/{path.name})"
    return section


def markdown(probes: list[Probe]) -> str:
    """The table of docs/results.md's "Every probe at a glance", one row per probe."""
    lines = [
        "| probe | knob | machine | seeds | steps | test tok-BLEU (recipe -> probe) "
        "| change, test | change, val | record |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in probes:
        dv = p.change("val")
        lines.append(
            f"| {p.probe} | {p.knob} | {p.machine} | "
            f"{', '.join(map(str, p.seeds))} | {p.steps} | "
            f"{mean(p.recipe_test):.2f} -> {mean(p.arm_test):.2f} | "
            f"**{p.change('test'):+.2f}** | {'' if dv is None else f'{dv:+.2f}'} | "
            f"{record(p.section)} |"
        )
    return "\n".join(lines)


def plot(probes: list[Probe], out: Path = PNG) -> Path:
    """One row per probe: an arrow from its paired recipe score to its own, beside the
    seed band, the published score and the target, so the distances read at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"Sapphire Rapids": "tab:blue", "AMD EPYC": "tab:orange", "H200": "tab:green"}
    fig, ax = plt.subplots(figsize=(11, 0.36 * len(probes) + 2.6))
    ax.axvspan(
        min(RECIPE_SEEDS),
        max(RECIPE_SEEDS),
        color="0.92",
        zorder=0,
        label="the recipe's seeds 1-3 (Sapphire Rapids)",
    )
    ax.axvline(TARGET, color="tab:red", lw=1.5, label=f"issue 3's target ({TARGET})")
    ax.axvline(
        PUBLISHED, color="0.4", ls="--", lw=1, label=f"Wu et al. 2021, the same model ({PUBLISHED})"
    )
    seen: set[str] = set()
    for y, p in enumerate(reversed(probes)):
        rt, at = mean(p.recipe_test), mean(p.arm_test)
        c = colors.get(p.machine, "k")
        ax.annotate(
            "", xy=(at, y), xytext=(rt, y), arrowprops={"arrowstyle": "->", "color": c, "lw": 1.2}
        )
        ax.plot([rt], [y], "o", mfc="white", mec=c, ms=6)
        label = None if p.machine in seen else p.machine
        seen.add(p.machine)
        ax.plot([at], [y], "o", color=c, ms=6, label=label)
        if len(p.arm_test) > 1:  # each seed
            ax.plot(p.arm_test, [y] * len(p.arm_test), "|", color=c, ms=9)
        ax.text(TARGET + 0.15, y, f"{at - rt:+.2f}", va="center", fontsize=8, color=c)
    ax.plot([], [], "o", mfc="white", mec="0.3", label="(open circle: the paired recipe run)")
    ax.set_yticks(range(len(probes)))
    ax.set_yticklabels(
        [
            textwrap.shorten(p.probe, 60, placeholder=" ...")
            + (f" ({len(p.seeds)} seeds)" if len(p.seeds) > 1 else "")
            for p in reversed(probes)
        ],
        fontsize=8,
    )
    ax.set_xlim(right=TARGET + 0.55)
    ax.text(TARGET + 0.15, len(probes) - 0.4, "change", fontsize=8)
    ax.set_xlabel("test_2016_flickr tok-BLEU (lowercased, Moses-tokenized)")
    ax.set_title(
        "Multi30k En->De: changes to the recipe, each against its paired recipe run", fontsize=10
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=CSV)
    ap.add_argument("--out", type=Path, default=PNG)
    ap.add_argument("--markdown", action="store_true", help="print the table too")
    args = ap.parse_args()
    probes = read_probes(args.csv)
    print(f"wrote {plot(probes, args.out)}")
    if args.markdown:
        print(markdown(probes))


if __name__ == "__main__":
    main()
