"""The analysis subcommands, table1 and attention: each parses its arguments and calls
`aiayn.analysis`. Imports of aiayn modules (but `aiayn.config`, `aiayn.files`) and of
torch are inside the functions, as in `aiayn.cli.commands`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aiayn.cli.commands import check_device
from aiayn.files import UsageError


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
