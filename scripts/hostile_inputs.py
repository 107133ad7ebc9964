"""Try every subcommand as a hostile user would: each path argument pointing at the wrong kind
of thing, each numeric argument at its edges, each file format truncated or corrupted.

Each case runs `aiayn ...` in a fresh process (with a time limit) and is judged:
  ok           exit 0 where that is right (a harmless edge), or the documented refusal:
               exit 1, 2 or 4 with exactly one `error:` line on stderr and no traceback
  data lost    a file that was there is replaced or damaged (a device node, a symlink, a
               run's manifest), or a partial output or temporary file is left
  silent       exit 0 where work should have been refused, or a fault not said
               (a model weighted twice, a setting dropped on resume)
  traceback    a traceback, a crash by signal, a server answer that is not JSON
  hang         a time-out, or worker processes left alive after their parent ended
  other        a wrong exit code, an error message of several lines, a message that
               misleads (a flag that does not exist)

    python scripts/hostile_inputs.py [--only train,translate] [--json FILE] [--round 1,3]

Round 3 (scripts/hostile_round3.py, issue 71) adds output paths of every kind, a run's own
files as outputs, duplicated checkpoints, NaN settings, resume settings, Ctrl-C and
SIGTERM, hostile JSON to the server, missing optional extras and corrupt compressed input.

It builds what it needs (a tiny prepared data set and a 4-step run) in a temporary
directory from ../shared/data/multi30k. Its findings, and what was done about them, are
in docs/reliability.md ("Rows added for a careless user", and its figures).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_round3  # noqa: E402  (beside this script)

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
ENV = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
# the tries run in the temporary directory: a relative PYTHONPATH must not change meaning
if os.environ.get("PYTHONPATH"):
    ENV["PYTHONPATH"] = os.pathsep.join(
        os.path.abspath(x) for x in os.environ["PYTHONPATH"].split(os.pathsep) if x
    )
os.environ["PYTHONPATH"] = ENV.get("PYTHONPATH", "")
TINY = [
    "--preset",
    "tiny",
    "--set",
    "N=1",
    "--set",
    "d_model=32",
    "--set",
    "d_ff=64",
    "--set",
    "h=2",
    "--set",
    "d_k=16",
    "--set",
    "d_v=16",
    "--set",
    "dtype=fp32",
    "--no-progress",
]


CLASSES = ("data lost", "silent", "traceback", "hang", "other")


@dataclass
class Case:
    command: str
    what: str
    argv: list[str]
    ok_codes: tuple[int, ...] = (1, 2, 4)  # refusals; add 0 where success is right
    check: Callable[[Any], str | None] | None = None  # after the run: a verdict, or None
    check_factory: Callable[[], Callable[[Any], str | None]] | None = None  # made at run time
    run_factory: Callable[[list[str]], Callable[[], Any]] | None = None  # instead of a run
    setup: list[str] | None = None  # `aiayn SETUP` first (must exit 0)
    block: tuple[str, ...] = ()  # modules hidden: an optional extra not installed
    env: dict[str, str] = field(default_factory=dict)
    fsize: int | None = None  # RLIMIT_FSIZE in bytes: a full disk
    round: int = 1


def aiayn(
    argv: list[str],
    timeout: float = 120,
    *,
    block: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    fsize: int | None = None,
    cwd: str | Path | None = None,
) -> tuple[int | None, str, str, float]:
    """(exit code or None when it timed out, stdout, stderr, seconds)."""
    import resource

    t0 = time.perf_counter()
    if block:
        code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
        cmd = [sys.executable, "-c", code + "from aiayn.cli import main\nsys.exit(main())"]
    else:
        cmd = [sys.executable, "-m", "aiayn"]

    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    try:
        proc = subprocess.run(
            [*cmd, *argv],
            env={**ENV, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limit if fsize is not None else None,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        return None, out, "timed out", time.perf_counter() - t0
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def judge(case: Case, code: int | None, err: str) -> str:
    """The verdict from the exit code and stderr alone: "ok" or "CLASS: why"."""
    if code is None:
        return "hang: timed out"
    if "Traceback" in err:
        return "traceback: a traceback on stderr"
    if code < 0 and code not in case.ok_codes:
        return f"traceback: killed by signal {-code}"
    if code not in case.ok_codes:
        if code == 0:
            return "silent: exit 0 where a refusal was due"
        return f"other: exit {code}"
    refused = code not in (0, 3) and code > 0  # 3: translated, invalid UTF-8 repaired
    errors = [line for line in err.splitlines() if "error:" in line]
    if code in (130, 143):  # stopped by a signal: one line saying so, no error line needed
        words = ("interrupted", "terminated", "received SIG")  # train: saved, then stopped
        if not any(w in line for line in err.splitlines() for w in words):
            return "other: no line saying it stopped"
    elif refused and len(errors) != 1:
        return "other: not one error line"
    return "ok"


def run_case(
    case: Case, tmp: Path, paths: dict[str, Path]
) -> tuple[str, tuple[int | None, str, str, float]]:
    if case.round == 3:
        hostile_round3.restore(paths)
    if case.setup is not None:
        code, _, err, _ = aiayn(case.setup, cwd=tmp)
        if code != 0:
            return f"other: setup failed ({err.strip().splitlines()[-1:]})", (code, "", err, 0.0)
    check = case.check_factory() if case.check_factory is not None else case.check
    if case.run_factory is not None:
        result = case.run_factory(case.argv)()
    else:
        result = aiayn(case.argv, block=case.block, env=case.env, fsize=case.fsize, cwd=tmp)
    code, _, err, _ = result
    verdict = judge(case, code, err)
    if check is not None:
        try:
            found = check(result)
        except OSError as e:  # the path the check reads was destroyed
            found = f"data lost: {e}"
        # what was lost outranks how the command ended (exit 0 over a run's manifest)
        # (a hang stays a hang: the check then reads what the killed run left)
        if found and (verdict == "ok" or found.startswith("data lost") and "hang" not in verdict):
            verdict = found
    return verdict, result


def build(tmp: Path) -> dict[str, Path]:
    """A tiny prepared set, a 4-step run with its average, text files good and bad."""
    p: dict[str, Path] = {"tmp": tmp}
    for lang in ("en", "de"):
        with gzip.open(MULTI30K / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [next(f) for _ in range(300)]
        (tmp / f"train.{lang}").write_text("".join(lines), encoding="utf-8")
    p["prep"] = tmp / "prep"
    assert (
        aiayn(
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                str(tmp / "train"),
                "--validpref",
                str(tmp / "train"),
                "--out",
                str(p["prep"]),
                "--vocab-size",
                "200",
            ]
        )[0]
        == 0
    )
    p["run"] = tmp / "run"
    assert (
        aiayn(
            [
                "train",
                str(p["prep"]),
                "--out",
                str(p["run"]),
                *TINY,
                "--max-steps",
                "4",
                "--save-interval-steps",
                "2",
            ]
        )[0]
        == 0
    )
    p["ckpt"] = p["run"] / "checkpoint_last.pt"
    p["src"] = tmp / "src.en"
    p["src"].write_text("a man rides a bike .\ntwo dogs .\n", encoding="utf-8")
    p["binary"] = tmp / "binary.bin"
    p["binary"].write_bytes(os.urandom(4096))
    p["empty"] = tmp / "empty.txt"
    p["empty"].write_text("", encoding="utf-8")
    p["truncated_gz"] = tmp / "cut.en.gz"
    whole = gzip.compress(b"a man rides a bike .\n" * 3000)
    p["truncated_gz"].write_bytes(whole[: len(whole) // 2])
    data = p["ckpt"].read_bytes()
    p["truncated_ckpt"] = tmp / "truncated.pt"
    p["truncated_ckpt"].write_bytes(data[: len(data) // 3])
    p["flipped_ckpt"] = tmp / "flipped.pt"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    p["flipped_ckpt"].write_bytes(bytes(flipped))
    p["bad_toml"] = tmp / "bad.toml"
    p["bad_toml"].write_text("preset = \n[train\n", encoding="utf-8")
    p["no_dir"] = tmp / "no" / "such" / "dir"
    p["empty_dir"] = tmp / "empty_dir"
    p["empty_dir"].mkdir()
    hostile_round3.build(p)
    return p


def cases(p: dict[str, Path]) -> list[Case]:
    s = {k: str(v) for k, v in p.items()}
    tr = ["translate", "--checkpoint", s["ckpt"], "--input", s["src"], "--no-progress"]
    out = s["tmp"] + "/out.txt"
    train = ["train", s["prep"], "--out", s["tmp"] + "/t", *TINY]
    avg = ["average", s["run"], "--out", s["tmp"] + "/avg.pt"]
    ev = ["evaluate", "--hyp", s["src"], "--ref", s["src"]]
    return [
        # data
        Case(
            "data",
            "--out is a file",
            [
                "data",
                "multi30k",
                "--from",
                str(MULTI30K),
                "--out",
                s["src"],
                "--splits",
                "val",
                "--langs",
                "en",
            ],
        ),
        Case(
            "data",
            "--from is a file",
            ["data", "multi30k", "--from", s["src"], "--out", s["tmp"] + "/d"],
        ),
        Case(
            "data",
            "--from is an empty directory",
            ["data", "multi30k", "--from", s["empty_dir"], "--out", s["tmp"] + "/d2"],
        ),
        Case(
            "data",
            "unknown split",
            [
                "data",
                "multi30k",
                "--from",
                str(MULTI30K),
                "--out",
                s["tmp"] + "/d3",
                "--splits",
                "nope",
            ],
        ),
        # prepare
        Case(
            "prepare",
            "--trainpref missing",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/nope",
                "--out",
                s["tmp"] + "/p1",
            ],
        ),
        Case(
            "prepare",
            "--out is a file",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/train",
                "--out",
                s["src"],
            ],
        ),
        *[
            Case(
                "prepare",
                f"--vocab-size {v}",
                [
                    "prepare",
                    "-s",
                    "en",
                    "-t",
                    "de",
                    "--trainpref",
                    s["tmp"] + "/train",
                    "--out",
                    s["tmp"] + f"/pv{v}",
                    "--vocab-size",
                    v,
                ],
            )
            for v in ("0", "-1", "5", "1000000000")
        ],
        Case(
            "prepare",
            "--max-len 0",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/train",
                "--out",
                s["tmp"] + "/pm",
                "--max-len",
                "0",
            ],
        ),
        Case(
            "prepare",
            "--max-len-ratio -1",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/train",
                "--out",
                s["tmp"] + "/pr",
                "--max-len-ratio",
                "-1",
            ],
        ),
        # train
        Case(
            "train", "DATA missing", ["train", s["tmp"] + "/nope", "--out", s["tmp"] + "/t0", *TINY]
        ),
        Case("train", "DATA is a file", ["train", s["src"], "--out", s["tmp"] + "/t1", *TINY]),
        Case(
            "train",
            "DATA is an empty directory",
            ["train", s["empty_dir"], "--out", s["tmp"] + "/t2", *TINY],
        ),
        Case("train", "--out is a file", ["train", s["prep"], "--out", s["src"], *TINY]),
        Case(
            "train",
            "--out under a missing directory",
            ["train", s["prep"], "--out", s["no_dir"] + "/r", *TINY, "--max-steps", "1"],
            (0, 1, 2, 4),
        ),
        *[Case("train", f"--max-steps {v}", [*train, "--max-steps", v]) for v in ("0", "-3")],
        *[Case("train", f"--max-tokens {v}", [*train, "--max-tokens", v]) for v in ("0", "-1")],
        Case(
            "train",
            "--max-tokens 1 (no pair fits)",
            [*train, "--max-tokens", "1", "--max-steps", "2"],
            (0, 1, 2),
        ),
        Case("train", "--update-freq 0", [*train, "--update-freq", "0"]),
        Case("train", "--keep-last 0", [*train, "--keep-last", "0"]),
        Case("train", "--max-minutes -1", [*train, "--max-minutes", "-1"]),
        Case("train", "--save-interval-steps -1", [*train, "--save-interval-steps", "-1"]),
        Case("train", "--valid-interval-steps 0", [*train, "--valid-interval-steps", "0"]),
        Case("train", "--set P_drop=1.5", [*train, "--set", "P_drop=1.5"]),
        Case("train", "--set warmup_steps=abc", [*train, "--set", "warmup_steps=abc"]),
        Case("train", "--set with no =", [*train, "--set", "P_drop"]),
        Case(
            "train",
            "--set h=3 (d_model not divisible)",
            [*train, "--set", "h=3", "--max-steps", "1"],
            (0, 1, 2),
        ),
        Case(
            "train",
            "--config not TOML",
            ["train", s["prep"], "--out", s["tmp"] + "/tc", "--config", s["bad_toml"]],
        ),
        Case(
            "train",
            "--config is binary",
            ["train", s["prep"], "--out", s["tmp"] + "/tb", "--config", s["binary"]],
        ),
        Case("train", "--device cuda:7", [*train, "--device", "cuda:7"]),
        # average
        Case(
            "average",
            "input missing",
            ["average", s["tmp"] + "/nope.pt", "--out", s["tmp"] + "/a.pt"],
        ),
        Case("average", "input is a text file", ["average", s["src"], "--out", s["tmp"] + "/a.pt"]),
        Case(
            "average",
            "input is a truncated checkpoint",
            ["average", s["truncated_ckpt"], "--out", s["tmp"] + "/a.pt"],
        ),
        Case(
            "average",
            "input directory has no checkpoints",
            ["average", s["empty_dir"], "--out", s["tmp"] + "/a.pt"],
        ),
        *[Case("average", f"--last {v}", [*avg, "--last", v]) for v in ("0", "-2")],
        Case("average", "--out is a directory", ["average", s["run"], "--out", s["tmp"]]),
        Case(
            "average",
            "--out is the run's checkpoint_last.pt",
            ["average", s["run"], "--out", s["ckpt"]],
        ),
        # translate
        Case(
            "translate",
            "--checkpoint missing",
            ["translate", "--checkpoint", s["tmp"] + "/no.pt", "--input", s["src"]],
        ),
        Case(
            "translate",
            "--checkpoint is a text file",
            ["translate", "--checkpoint", s["src"], "--input", s["src"]],
        ),
        Case(
            "translate",
            "--checkpoint is a directory",
            ["translate", "--checkpoint", s["run"], "--input", s["src"]],
        ),
        Case(
            "translate",
            "--checkpoint truncated",
            ["translate", "--checkpoint", s["truncated_ckpt"], "--input", s["src"]],
        ),
        Case(
            "translate",
            "--checkpoint one bit flipped, no manifest",
            ["translate", "--checkpoint", s["flipped_ckpt"], "--input", s["src"]],
        ),
        Case("translate", "--input is a directory", [*tr[:3], "--input", s["run"]]),
        Case(
            "translate",
            "--input is binary",
            [*tr[:3], "--input", s["binary"], "--output", out],
            (0, 3),
        ),
        Case(
            "translate", "--input is empty", [*tr[:3], "--input", s["empty"], "--output", out], (0,)
        ),
        Case("translate", "--input truncated gzip", [*tr[:3], "--input", s["truncated_gz"]]),
        *[Case("translate", f"--beam {v}", [*tr, "--beam", v]) for v in ("0", "-1")],
        Case("translate", "--beam 1000", [*tr, "--beam", "1000", "--output", out], (0,)),
        Case("translate", "--alpha -1", [*tr, "--alpha", "-1"]),
        Case("translate", "--alpha nan", [*tr, "--alpha", "nan"]),
        Case("translate", "--max-len-a -1", [*tr, "--max-len-a", "-1"]),
        *[Case("translate", f"--nbest {v}", [*tr, "--nbest", v]) for v in ("0", "9")],
        Case("translate", "--max-tokens 0", [*tr, "--max-tokens", "0"]),
        *[Case("translate", f"--workers {v}", [*tr, "--workers", v]) for v in ("0", "-1")],
        Case("translate", "--workers 64", [*tr, "--workers", "64", "--output", out], (0, 1, 2)),
        Case("translate", "--dtype fp16", [*tr, "--dtype", "fp16"]),
        # evaluate
        Case(
            "evaluate", "--hyp missing", ["evaluate", "--hyp", s["tmp"] + "/no", "--ref", s["src"]]
        ),
        Case(
            "evaluate", "--hyp is a directory", ["evaluate", "--hyp", s["run"], "--ref", s["src"]]
        ),
        Case("evaluate", "--ref is binary", ["evaluate", "--hyp", s["src"], "--ref", s["binary"]]),
        Case("evaluate", "both empty", ["evaluate", "--hyp", s["empty"], "--ref", s["empty"]]),
        Case("evaluate", "--bootstrap -1", [*ev, "--bootstrap", "-1"]),
        Case(
            "evaluate",
            "--ref truncated gzip",
            ["evaluate", "--hyp", s["src"], "--ref", s["truncated_gz"]],
        ),
        # recipe
        Case(
            "recipe", "config missing", ["recipe", s["tmp"] + "/no.toml", "--out", s["tmp"] + "/r0"]
        ),
        Case("recipe", "config is a directory", ["recipe", s["tmp"], "--out", s["tmp"] + "/r1"]),
        Case(
            "recipe",
            "config without [recipe]",
            ["recipe", s["bad_toml"], "--out", s["tmp"] + "/r2"],
        ),
        Case(
            "recipe",
            "--out is a file",
            ["recipe", str(ROOT / "configs/multi30k-en-de.toml"), "--out", s["src"]],
        ),
        Case(
            "recipe",
            "--max-minutes -1",
            [
                "recipe",
                str(ROOT / "configs/multi30k-en-de.toml"),
                "--out",
                s["tmp"] + "/r3",
                "--max-minutes",
                "-1",
            ],
        ),
        Case(
            "recipe",
            "--data is a file",
            [
                "recipe",
                str(ROOT / "configs/multi30k-en-de.toml"),
                "--out",
                s["tmp"] + "/r4",
                "--data",
                s["src"],
            ],
        ),
        # bench
        *[
            Case("bench", f"{what} {flag} {v}", ["bench", what, "--preset", "tiny", flag, v])
            for what, flag, v in (
                ("train", "--steps", "0"),
                ("decode", "--sentences", "0"),
                ("decode", "--beam", "0"),
                ("decode", "--workers", "0"),
                ("train", "--batch-sentences", "0"),
            )
        ],
        Case("bench", "--preset foo", ["bench", "train", "--preset", "foo"]),
        Case("bench", "--dtype foo", ["bench", "decode", "--preset", "tiny", "--dtype", "foo"]),
        # info
        *[Case("info", f"--vocab-size {v}", ["info", "--vocab-size", v]) for v in ("0", "-5")],
        Case("info", "--preset foo", ["info", "--preset", "foo"]),
        # serve (only refusals: a valid command serves until stopped)
        Case("serve", "--checkpoint missing", ["serve", "--checkpoint", s["tmp"] + "/no.pt"]),
        Case("serve", "--checkpoint truncated", ["serve", "--checkpoint", s["truncated_ckpt"]]),
        Case("serve", "--checkpoint flipped", ["serve", "--checkpoint", s["flipped_ckpt"]]),
        Case("serve", "--checkpoint is a directory", ["serve", "--checkpoint", s["run"]]),
        *[
            Case("serve", f"{flag} {v}", ["serve", "--checkpoint", s["ckpt"], flag, v])
            for flag, v in (
                ("--workers", "0"),
                ("--max-queue", "0"),
                ("--max-batch-tokens", "-1"),
                ("--max-body-bytes", "0"),
                ("--batch-wait-ms", "-5"),
                ("--port", "70000"),
                ("--port", "-1"),
                ("--beam", "0"),
                ("--dtype", "fp16"),
            )
        ],
        # export
        *[
            Case(
                "export",
                f"--checkpoint {what}",
                ["export", "--checkpoint", s[key], "--to", "ctranslate2", "--out", s["tmp"] + "/x"],
            )
            for what, key in (("truncated", "truncated_ckpt"), ("flipped", "flipped_ckpt"))
        ],
        Case(
            "export",
            "--out is a file",
            ["export", "--checkpoint", s["ckpt"], "--to", "marian", "--out", s["src"]],
        ),
        Case("export", "--to onnx", ["export", "--checkpoint", s["ckpt"], "--to", "onnx"]),
        # table1
        *[
            Case("table1", f"{flag} {v}", ["table1", flag, v, "--out", s["tmp"] + "/t1"])
            for flag, v in (("--d", "0"), ("--n-min", "0"), ("--n-max", "-4"), ("--repeats", "0"))
        ],
        Case("table1", "--out is a file", ["table1", "--n-max", "32", "--out", s["src"]]),
        # attention
        *[
            Case(
                "attention",
                what,
                ["attention", "--checkpoint", ckpt, "--text", text, "--out", s["tmp"] + "/a"]
                + extra,
            )
            for what, ckpt, text, extra in (
                ("--checkpoint flipped", s["flipped_ckpt"], "A dog.", []),
                ("--text empty", s["ckpt"], "", []),
                ("--text whitespace", s["ckpt"], "  ", []),
                ("--layer 99", s["ckpt"], "A dog.", ["--layer", "99"]),
                ("--word absent", s["ckpt"], "A dog.", ["--word", "zebra"]),
            )
        ],
        # table3
        Case("table3", "config missing", ["table3", s["tmp"] + "/no.toml", "--out", s["tmp"]]),
        Case("table3", "config without [sweep]", ["table3", s["bad_toml"], "--out", s["tmp"]]),
        Case("table3", "--csv missing", ["table3", "--csv", s["tmp"] + "/no.csv", "--markdown"]),
        Case("table3", "--csv is binary", ["table3", "--csv", s["binary"], "--markdown"]),
    ]


def round3(p: dict[str, Path]) -> list[Case]:
    def case(
        command: str, what: str, argv: list[str], ok: tuple[int, ...] = (1, 2, 4), **kw: Any
    ) -> Case:
        return Case(command, what, argv, ok, round=3, **kw)

    return hostile_round3.cases(p, case, TINY, MULTI30K)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated subcommands")
    ap.add_argument("--json", help="write every case's outcome here")
    ap.add_argument("--round", default="1,3", help="which passes: 1 (the first two), 3")
    ap.add_argument("--what", help="only the cases whose description holds this text")
    args = ap.parse_args()
    rounds = {int(x) for x in args.round.split(",")}
    with tempfile.TemporaryDirectory() as d:
        paths = build(Path(d))
        selected = [
            c
            for c in [*cases(paths), *round3(paths)]
            if (not args.only or c.command in args.only.split(","))
            and (3 if c.round == 3 else 1) in rounds
            and (not args.what or args.what in c.what)
        ]
        results = []
        counts = dict.fromkeys(CLASSES, 0)
        for case in selected:
            verdict, (code, _, err, seconds) = run_case(case, Path(d), paths)
            if verdict != "ok":
                counts[verdict.split(":")[0]] += 1
            lines = [
                x for x in err.strip().splitlines() if x.strip() and not x.startswith("leftover")
            ]
            last = lines[-1] if lines else ""
            results.append(
                {
                    "command": case.command,
                    "what": case.what,
                    "exit": code,
                    "verdict": verdict,
                    "seconds": round(seconds, 1),
                    "stderr": last,
                }
            )
            print(
                f"{verdict[:40]:40s} {case.command:9s} {case.what[:50]:50s} exit {code}  "
                f"{last[:100]}",
                flush=True,
            )
        with contextlib.suppress(OSError):
            for f in Path("/dev/shm").glob("aiayn-hostile-*"):
                f.unlink()
    bad = sum(counts.values())
    print(
        f"\n{len(results)} inputs tried, {bad} bad: "
        + ", ".join(f"{counts[c]} {c}" for c in CLASSES)
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
