"""Run one recipe in several variants ("arms") side by side and print their scores.

Each arm is the recipe (`aiayn recipe CONFIG`) with its own `--set` overrides, run as its own
process into OUT/NAME, at most `--parallel` at a time; a rerun skips the arms that already
have their results.json and resumes the others (the recipe resumes from its checkpoints).
On one GPU the recipe's small model leaves it mostly idle (the step is bound by launching
kernels: docs/performance.md), so a few arms run together at little cost each (En->De
recipe on one H200: 25 ms a step alone, 29 ms with three at once, 40 ms with six); on a
2-core CPU run one at a time.

    python benchmarks/recipe_arms.py configs/multi30k-en-de.toml --data ../shared/data/multi30k \\
        --out runs/arms --device cuda --parallel 3 \\
        --arm recipe: --arm seed2:seed=2 --arm ls02:train.eps_ls=0.2,seed=2

An arm is NAME:KEY=VALUE,KEY=VALUE (nothing after the colon: the recipe as it is); `--set`
applies to every arm. The table (and OUT/arms.json) gives, per arm, the steps and training
minutes, the last validation perplexity, the alpha chosen on val and the test scores.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name:k=v,k=v' -> (name, ['k=v', 'k=v'])."""
    name, sep, rest = text.partition(":")
    if not sep or not NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"an arm is NAME:KEY=VALUE,... with NAME in letters, digits, '.', '_', '-': {text!r}"
        )
    sets = [s.strip() for s in rest.split(",") if s.strip()]
    for s in sets:
        if "=" not in s:
            raise argparse.ArgumentTypeError(f"arm {name}: {s!r} is not KEY=VALUE")
    return name, sets


def command(
    config: str, data: str | None, out: Path, device: str | None, sets: list[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "aiayn", "recipe", config, "--out", str(out), "--no-progress"]
    if data:
        cmd += ["--data", data]
    if device:
        cmd += ["--device", device]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def summary(name: str, sets: list[str], run: Path, rc: int | None) -> dict:
    """One arm's row: what its results.json says, or why there is none."""
    row: dict = {"arm": name, "overrides": ",".join(sets), "rc": rc}
    path = run / "results.json"
    if not path.is_file():
        return row
    r = json.loads(path.read_text())
    train = r.get("train", {})
    row.update(
        steps=train.get("steps"),
        train_minutes=round(train.get("train_seconds", 0) / 60, 2),
        valid_ppl=(train.get("last_valid") or {}).get("valid_ppl"),
        alpha=r["config"]["decode"]["alpha"],  # chosen on val where the recipe tunes it
        sacrebleu=r["scores"]["sacrebleu"],
        tok_bleu=r["scores"]["tok_bleu"],
        chrf=r["scores"]["chrf"],
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| arm | overrides | steps | train min | valid PPL | alpha | sacreBLEU | tok-BLEU "
        "| chrF2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tok_bleu" not in r:
            lines.append(
                f"| {r['arm']} | {r['overrides']} | failed (rc {r['rc']}; see its log) "
                "| | | | | | |"
            )
            continue
        ppl = "" if r["valid_ppl"] is None else f"{r['valid_ppl']:.2f}"
        lines.append(
            f"| {r['arm']} | {r['overrides'] or '(recipe)'} | {r['steps']} | "
            f"{r['train_minutes']} | {ppl} | {r['alpha']} | {r['sacrebleu']:.2f} | "
            f"{r['tok_bleu']:.2f} | {r['chrf']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--out", required=True, type=Path, help="one run directory per arm in here")
    ap.add_argument("--data", help="local copy of the corpus (default: the recipe downloads)")
    ap.add_argument("--device")
    ap.add_argument("--parallel", type=int, default=1, help="arms running at once")
    ap.add_argument(
        "--arm",
        action="append",
        type=parse_arm,
        required=True,
        help="NAME:KEY=VALUE,... (repeatable)",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for every arm")
    args = ap.parse_args(argv)
    names = [n for n, _ in args.arm]
    if len(set(names)) != len(names):
        ap.error(f"arm names must differ: {names}")
    if args.parallel < 1:
        ap.error("--parallel must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    todo = [(n, args.set + s) for n, s in args.arm if not (args.out / n / "results.json").is_file()]
    running: list[tuple[str, subprocess.Popen, float]] = []
    rcs: dict[str, int | None] = {}
    while todo or running:
        while todo and len(running) < args.parallel:
            name, sets = todo.pop(0)
            log = (args.out / f"{name}.log").open("ab")
            cmd = command(args.config, args.data, args.out / name, args.device, sets)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[1:])}", flush=True)
            running.append(
                (
                    name,
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                    time.monotonic(),
                )
            )
            log.close()
        time.sleep(1.0)
        for entry in list(running):
            name, proc, t0 = entry
            if proc.poll() is not None:
                rcs[name] = proc.returncode
                running.remove(entry)
                print(
                    f"[{time.strftime('%H:%M:%S')}] {name}: exit {proc.returncode} after "
                    f"{(time.monotonic() - t0) / 60:.1f} min",
                    flush=True,
                )
    rows = [summary(n, args.set + s, args.out / n, rcs.get(n, 0)) for n, s in args.arm]
    (args.out / "arms.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0 if all("tok_bleu" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
