"""The subcommands about speed on this machine: `aiayn bench` (training and decoding
throughput) and `aiayn info` (the CPU's class, what dtype auto chose, the probe's rates).
Imports of other aiayn modules are inside the functions, as in `aiayn.cli.commands`."""

from __future__ import annotations

import argparse
import json

from aiayn.cli.commands import check_device
from aiayn.cli.resume import resolve_config
from aiayn.files import UsageError


def _lengths(text: str) -> tuple[int, int]:
    """`--lengths LO,HI` as two ints, 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--lengths takes LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"--lengths {text}: need 1 <= LO <= HI")
    return lo, hi


def cmd_bench(args: argparse.Namespace) -> int:
    """`aiayn bench`: one measurement per dtype, a line (or JSON object) each."""
    from aiayn.experiments import bench

    check_device(args.device)
    for flag in ("steps", "sentences", "batch_sentences", "out_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for dtype in args.dtype.split(","):  # "auto" is resolved by each measurement
        if args.what == "peak":
            result = bench.bench_peak(dtype, args.device)
        elif args.what == "train":
            result = bench.bench_train(
                args.preset,
                dtype,
                args.device,
                steps=args.steps,
                batch=args.batch_sentences or 291,
                compile=args.compile,
                vocab=args.vocab_size,
                lengths=_lengths(args.lengths),
            )
        else:
            result = bench.bench_decode(
                args.preset,
                dtype,
                args.device,
                beam=args.beam,
                alpha=args.alpha,
                out_len=args.out_len,
                sentences=args.sentences,
                batch=args.batch_sentences or 64,
                peak=True,
                workers=args.workers,
                vocab=args.vocab_size,
            )
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            fields = (
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()
            )
            print("  ".join(fields), flush=True)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """`aiayn info`: a configuration's hyperparameters and parameter count."""
    from dataclasses import replace

    import torch

    from aiayn.model import Transformer, count_parameters, parameter_formula

    cfg = resolve_config(args)
    model_cfg = replace(cfg.model, vocab_size=args.vocab_size)
    with torch.device("meta"):
        n = count_parameters(Transformer(model_cfg))
    from aiayn.fast import machine

    if args.reprobe:
        machine.probe(refresh=True)
        machine.best.cache_clear()
    info = {
        "preset": args.config or args.preset or "base",
        "vocab_size": args.vocab_size,
        "parameters": n,
        "parameters_formula": parameter_formula(model_cfg),
        "config": replace(cfg, model=model_cfg).to_dict(),
        "machine": {"cpu": machine.cpu().model, **machine.best().to_dict()},
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        m = model_cfg
        print(
            f"{info['preset']}: N={m.N} d_model={m.d_model} d_ff={m.d_ff} h={m.h} d_k={m.d_k} "
            f"d_v={m.d_v} P_drop={m.P_drop} eps_ls={cfg.train.eps_ls} "
            f"positional={m.positional} norm={m.norm}"
        )
        print(f"parameters: {n:,} ({n / 1e6:.1f}M) with a shared vocabulary of {args.vocab_size:,}")
        print(machine.describe())
    return 0
