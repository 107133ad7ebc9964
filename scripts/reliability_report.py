"""Run every test tied to a RELIABILITY.md row and print the matrix's section 4 figures.

    python scripts/reliability_report.py            # default suite's row tests (~4 min)
    python scripts/reliability_report.py --slow     # plus the 20-trial versions (~8 min)
    python scripts/reliability_report.py --json out.json

Each test names its rows with `@pytest.mark.rows("A1", ...)`; tests/conftest.py writes one
JSON line per test (rows, outcome, faults injected, steps lost) when
AIAYN_RELIABILITY_REPORT is set. A row passes when it has tests and all of them pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The matrix's rows and tiers (RELIABILITY.md section 2), with the rows aiayn added after
#: trying its own commands as a careless user would (docs/reliability.md: A12-A16, B7-B9,
#: E9-E13, F15-F19, G7-G8, H7, I7-I8, J5-J12).
ROWS = {
    "A": {f"A{i}": "CPU" for i in range(1, 17)},
    "B": {
        "B1": "CPU",
        "B2": "CPU",
        "B3": "CPU",
        "B4": "R",
        "B5": "CPU",
        "B6": "GPU",
        "B7": "CPU",
        "B8": "CPU",
        "B9": "CPU",
    },
    # C6 and C7: an injected out-of-memory error on the CPU; C7's real one needs a GPU
    # (tests/fast/test_cuda.py), as C6's would.
    "C": {
        "C1": "CPU",
        "C2": "CPU",
        "C3": "CPU",
        "C4": "CPU",
        "C5": "GPU",
        "C6": "CPU",
        "C7": "CPU",
    },
    "D": {
        "D1": "CPU",
        "D2": "CPU",
        "D3": "CPU",
        "D4": "CPU",
        "D5": "CPU",
        "D6": "CPU",
        "D7": "CPU",
        "D8": "GPU",
    },
    "E": {f"E{i}": "CPU" for i in range(1, 14)},
    "F": {f"F{i}": "CPU" for i in range(1, 20)},
    "G": {f"G{i}": "CPU" for i in range(1, 9)},
    "H": {f"H{i}": "CPU" for i in range(1, 8)},
    "I": {
        "I1": "CPU",
        "I2": "CPU",
        "I3": "CPU",
        "I4": "CPU",
        "I5": "CPU",
        "I6": "GPU",
        "I7": "CPU",
        "I8": "CPU",
    },
    "J": {f"J{i}": "CPU" for i in range(1, 13)},
}


def run_tests(slow: bool) -> list[dict]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        report = f.name
    env = {**os.environ, "AIAYN_RELIABILITY_REPORT": report}
    marker = "rows" if slow else "rows and not slow"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        check=False,
    )
    records = [json.loads(x) for x in Path(report).read_text().splitlines() if x.strip()]
    os.unlink(report)
    return records


def summarize(records: list[dict]) -> dict:
    by_row: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        for row in r["rows"]:
            by_row[row].append(r)
    groups = {}
    for g, rows in ROWS.items():
        cpu = [r for r, tier in rows.items() if tier in ("CPU", "R")]
        tested = [r for r in cpu if by_row.get(r)]
        failed = [r for r in tested if any(t["outcome"] == "failed" for t in by_row[r])]
        passed = [
            r
            for r in tested
            if r not in failed and any(t["outcome"] == "passed" for t in by_row[r])
        ]
        skipped = sorted(
            {
                t["test"].split("::")[-1]
                for r in tested
                for t in by_row[r]
                if t["outcome"] == "skipped"
            }
        )
        groups[g] = {
            "rows": len(rows),
            "cpu_rows": len(cpu),
            "run": len(tested),
            "passed": len(passed),
            "failed": failed,
            "skipped_tests": skipped,
            "untested": [r for r in cpu if r not in tested],
            "not_cpu": [f"{r} ({t})" for r, t in rows.items() if t not in ("CPU", "R")],
        }
    faults: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    lost: list[int] = []
    for r in records:
        for kind, n in r["properties"].get("faults", {}).items():
            faults[kind][0] += n
            faults[kind][1] += n if r["outcome"] == "passed" else 0
        lost += r["properties"].get("steps_lost", [])
    return {
        "groups": groups,
        "faults": dict(faults),
        "steps_lost": lost,
        "tests": len(records),
        "tests_passed": sum(r["outcome"] == "passed" for r in records),
        "tests_skipped": sum(r["outcome"] == "skipped" for r in records),
    }


def print_summary(s: dict) -> None:
    print("\nRELIABILITY matrix (section 4 figures)\n")
    print(f"{'group':<6}{'rows':>5}{'CPU/R':>7}{'run':>5}{'passed':>8}  notes")
    for g, x in s["groups"].items():
        notes = []
        if x["failed"]:
            notes.append("FAILED " + " ".join(x["failed"]))
        if x["skipped_tests"]:
            notes.append("skipped here: " + " ".join(x["skipped_tests"]))
        if x["untested"]:
            notes.append("no test: " + " ".join(x["untested"]))
        if x["not_cpu"]:
            notes.append("not on this tier: " + " ".join(x["not_cpu"]))
        print(
            f"{g:<6}{x['rows']:>5}{x['cpu_rows']:>7}{x['run']:>5}{x['passed']:>8}  "
            f"{'; '.join(notes)}"
        )
    print(f"\ntests: {s['tests']} run, {s['tests_passed']} passed, {s['tests_skipped']} skipped")
    print("\nfaults injected / survived")
    for kind, (n, ok) in sorted(s["faults"].items()):
        print(f"  {kind:<40}{n:>4} / {ok}")
    lost = s["steps_lost"]
    if lost:
        print(
            f"\nwork lost per recovery (steps redone): max {max(lost)}, "
            f"mean {sum(lost) / len(lost):.2f} over {len(lost)} recoveries"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", action="store_true", help="include the slow (20-trial) tests")
    p.add_argument("--json", help="also write the summary here")
    args = p.parse_args()
    summary = summarize(run_tests(args.slow))
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0 if all(not g["failed"] for g in summary["groups"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
