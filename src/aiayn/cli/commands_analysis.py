"""The analysis subcommands, table1 and attention: each parses its arguments and calls
`aiayn.analysis`. Imports of aiayn modules (but `aiayn.config`, `aiayn.files`) and of
torch are inside the functions, as in `aiayn.cli.commands`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aiayn.cli.commands import check_device
from aiayn.files import UsageError, check_output_dir, check_output_file


def cmd_table1(args: argparse.Namespace) -> int:
    """`aiayn table1`: measure Table 1's layers, print the table, write CSV, JSON and PNG."""
    import torch
    from tqdm import tqdm

    from aiayn.analysis.layers import KINDS
    from aiayn.analysis.table1 import Settings, run_table1, write_outputs
    from aiayn.analysis.table1_text import format_table

    check_device(args.device)
    kinds = KINDS if args.kinds is None else tuple(k.strip() for k in args.kinds.split(","))
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise UsageError(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    for flag in ("d", "heads", "kernel", "n_min", "batch", "repeats", "path_n"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.n_max < args.n_min:
        raise UsageError("--n-max must be >= --n-min")
    if args.r < 1 or args.r % 2 == 0:
        raise UsageError(f"--r {args.r}: the neighbourhood must be odd (centred on the query)")
    if args.d % args.heads:
        raise UsageError(f"--d {args.d} does not divide into --heads {args.heads}")
    if args.threads < 1:
        raise UsageError("--threads must be >= 1")
    check_output_dir(args.out, run_ok=True)
    torch.set_num_threads(args.threads)
    settings = Settings(
        d=args.d,
        h=args.heads,
        k=args.kernel,
        r=args.r,
        batch=args.batch,
        n_min=args.n_min,
        n_max=args.n_max,
        repeats=args.repeats,
        warmup=args.warmup,
        path_n=args.path_n,
        device=args.device,
        kinds=kinds,
    )
    total = len(settings.grid()) * len(kinds)
    bar = tqdm(total=total, unit="point", file=sys.stderr, disable=args.no_progress or None)

    def progress(kind: str, n: int) -> None:
        bar.set_postfix_str(f"{kind} n={n}", refresh=False)
        bar.update()

    try:
        report = run_table1(settings, progress)
    finally:
        bar.close()
    files = write_outputs(report, Path(args.out))
    if args.json:
        print(json.dumps({**report.to_dict(), "files": [str(f) for f in files]}, indent=1))
    else:
        print(format_table(report))
        print("wrote " + ", ".join(str(f) for f in files))
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    """`aiayn attention`: a sentence's attention weights, drawn (and with --json, written)."""
    from aiayn.analysis.attention import run_attention

    check_device(args.device)
    if not Path(args.checkpoint).is_file():
        raise UsageError(f"--checkpoint {args.checkpoint}: no such file")
    if not args.text.strip():
        raise UsageError("--text: nothing to translate")
    if args.beam is not None and args.beam < 1:
        raise UsageError("--beam must be >= 1")
    check_output_dir(args.out, run_ok=True)
    summary = run_attention(
        Path(args.checkpoint),
        args.text,
        Path(args.out),
        layer=args.layer,
        head=args.head,
        word=args.word,
        numbers=args.json,
        beam=args.beam,
        dtype=args.dtype,
        device=args.device,
    )
    print(f"source:      {' '.join(summary['source_tokens'])}")
    print(f"translation: {summary['translation']}")
    print(f"target:      {' '.join(summary['target_tokens'])}")
    print("wrote " + ", ".join(summary["files"]))
    return 0


def cmd_table3(args: argparse.Namespace) -> int:
    """`aiayn table3`: train and score Table 3's rows, print the table, write CSV and JSON
    (or render a table3.csv, or the probes' rows alone)."""
    from typing import Any

    from aiayn.cli.commands import _progress
    from aiayn.config import parse_set_args
    from aiayn.experiments import table3
    from aiayn.experiments.stages import RecipeStoppedError
    from aiayn.experiments.tasks import load_recipe

    if args.config and args.csv:
        raise UsageError("--csv renders a table3.csv already written: not with FILE.toml")
    for path in args.csv or []:
        if not Path(path).is_file():
            raise UsageError(f"--csv {path}: no such file")
    if not (args.config or args.csv or args.import_probes):
        raise UsageError("give FILE.toml (with --out), --csv CSV or --import-probes CSV")
    if args.config and not args.out:
        raise UsageError("FILE.toml needs --out DIR: the sweep's run directories go there")
    if args.out:
        check_output_dir(args.out, run_ok=False)
    if args.seeds is not None and args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.max_minutes_per_row is not None and args.max_minutes_per_row <= 0:
        raise UsageError(f"--max-minutes-per-row must be > 0, got {args.max_minutes_per_row}")
    overrides = parse_set_args(args.set or [])
    if args.max_minutes_per_row is not None:
        overrides["train.max_minutes"] = args.max_minutes_per_row
    exp = table3.load_table3(args.config, overrides) if args.config else None
    extra: list[table3.TableRow] = []
    left_out: list[str] = []
    if args.import_probes:
        base_cfg, recipe = load_recipe(exp.recipe_path if exp else args.probes_recipe)
        extra, left_out = table3.import_probes(args.import_probes, base_cfg, recipe.vocab_size)
    if exp is None:
        rows = table3.combine([(path, table3.read_csv(path)) for path in args.csv or []])
        rows += extra
        report = table3.Table3Report(rows, [], [])
        if args.out and not args.csv:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            report.files = table3.write_outputs(report, Path(args.out))
    else:
        check_device(args.device)
        wanted = args.rows.split(",") if args.rows else None
        table3.select_rows(exp, wanted)  # an unknown row fails before any work
        bars: list[Any] = []

        def hooks_for(row: str, seed: int, steps: int) -> Any:
            while bars:
                bars.pop().close()
            bar, hooks = _progress(steps, args.no_progress)
            bar.set_description(f"{row} seed {seed}")
            bars.append(bar)
            return hooks

        try:
            report = table3.run_table3(
                exp,
                args.out,
                data=args.data,
                prepared=args.prepared,
                rows=wanted,
                seeds=args.seeds,
                device=args.device,
                hooks_for=hooks_for,
                rerun_changed=args.rerun_changed,
                train=not args.no_train,
                extra_rows=extra,
                jobs=args.jobs,
            )
        except RecipeStoppedError as e:
            print(f"aiayn table3: {e}", file=sys.stderr)
            return {"SIGTERM": 143, "SIGINT": 130}[e.signal_name]
        finally:
            while bars:
                bars.pop().close()
    if args.json:
        print(json.dumps({**table3.to_json(report, exp), "probes_left_out": left_out}, indent=1))
        return 0
    if args.markdown:
        print(table3.markdown(report.rows))
    else:
        title = ""
        if exp is not None:
            decode = exp.decode()
            how = "greedy" if decode.beam == 1 else f"beam {decode.beam}, alpha {decode.alpha:g}"
            title = (
                f"Table 3 at {exp.scale or exp.recipe_path}; dev = {exp.recipe.valid_split}, "
                f"PPL of the averaged model, sacreBLEU ({how})"
            )
        print(table3.format_table(report.rows, title))
    for line in left_out:
        print(f"probe left out: {line}")
    if report.missing:
        print(f"not in the table yet: {', '.join(report.missing)}")
    if report.files:
        print("wrote " + ", ".join(str(f) for f in report.files))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """`aiayn plot`: the curves of train_log.jsonl (one run or several) as a PNG."""
    from aiayn.experiments.curves import plot_runs, run_labels

    metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    out = Path(args.out) if args.out else Path(args.runs[0]) / "curves.png"
    if out.suffix.lower() != ".png":
        raise UsageError(f"--out {out}: give a .png file")
    check_output_file(out, what="--out", stdout_ok=False)
    try:
        drawn = plot_runs(run_labels(args.runs), out, metrics)
    except ValueError as e:
        if "unknown metric" in str(e):
            raise UsageError(f"--metrics: {e}") from None
        raise
    for metric, counts in drawn.items():
        missing = [label for label, n in counts.items() if not n]
        if missing:
            print(f"no {metric} in the log of {', '.join(missing)}")
    print(f"wrote {out}")
    return 0
