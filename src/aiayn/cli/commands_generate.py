"""`aiayn score`, and translate's sampling options and streaming input."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from aiayn.files import UsageError, check_output_file

SAMPLING_FLAGS = ("samples", "temperature", "top_k", "top_p", "seed")


def sampling_options(args: argparse.Namespace) -> Any:
    """translate's `SamplingOptions`, or None without --sampling; a UsageError for a
    sampling flag without --sampling, or a search flag with it. Takes --nbest N as
    --samples N (and clears it: it is not the search's n-best then)."""
    from aiayn.decoding.sampling import SamplingOptions

    given = [f"--{f.replace('_', '-')}" for f in SAMPLING_FLAGS if getattr(args, f) is not None]
    if not args.sampling:
        if given:
            raise UsageError(f"{', '.join(given)} need --sampling")
        return None
    search = [f for f in ("beam", "greedy") if getattr(args, f)]
    if search:
        raise UsageError(f"--sampling draws outputs; --{search[0]} is for beam search")
    n = args.samples
    if args.nbest is not None:
        if n is not None and n != args.nbest:
            raise UsageError(f"--nbest {args.nbest} and --samples {n}: give one")
        n, args.nbest = args.nbest, None
    opts = SamplingOptions(
        n=1 if n is None else n,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_k=args.top_k or 0,
        top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed or 0,
    )
    try:
        opts.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return opts


def translate_stdin(
    model: Any, tokenizer: Any, args: argparse.Namespace, cfg: Any, sampling: Any, bar: Any
) -> dict[str, Any]:
    """translate reading stdin: each batch's outputs written as soon as it is decoded."""
    from aiayn.decoding.stream import translate_stream

    out = args.output if args.output is not None else sys.stdout
    return translate_stream(
        model,
        tokenizer,
        sys.stdin.buffer,
        out,
        cfg.decode,
        device=args.device,
        progress=bar.update,
        workers=args.workers,
        sampling=sampling,
    )


def _read_pairs(src: Path, ref: Path) -> tuple[list[str], list[str]]:
    from aiayn.decoding.translate import read_input

    for flag, path in (("--src", src), ("--ref", ref)):
        if not path.is_file():
            raise UsageError(f"{flag} {path}: no such file")
    sources, bad_src = read_input(src)
    references, bad_ref = read_input(ref)
    if bad_src or bad_ref:
        name, line = (src, bad_src[0]) if bad_src else (ref, bad_ref[0])
        raise UsageError(f"{name}:{line}: invalid UTF-8: scores of repaired text mean nothing")
    if len(sources) != len(references):
        raise UsageError(
            f"--src {src} has {len(sources)} lines but --ref {ref} has {len(references)}: "
            "a reference per source line"
        )
    return sources, references


def score_files(args: argparse.Namespace) -> int:
    """`aiayn score` after the device is checked: each pair's log-probability by teacher
    forcing."""
    from aiayn.checkpoints import load_ensemble
    from aiayn.config import apply_overrides
    from aiayn.decoding.ensemble import as_decoder
    from aiayn.decoding.score import score_lines
    from aiayn.fast.machine import cast_for_inference
    from aiayn.files import atomic_write

    src, ref = Path(args.src), Path(args.ref)
    if args.output is not None:
        check_output_file(args.output, inputs=(src, ref, *args.checkpoint), force=args.force)
    sources, references = _read_pairs(src, ref)
    models, tokenizer, cfg = load_ensemble([Path(p) for p in args.checkpoint], device=args.device)
    model = as_decoder([cast_for_inference(m, args.dtype) for m in models])
    overrides = {
        f"decode.{k}": getattr(args, k)
        for k in ("alpha", "max_tokens")
        if getattr(args, k) is not None
    }
    cfg = apply_overrides(cfg, overrides)
    scores = score_lines(model, tokenizer, sources, references, cfg.decode, args.device)
    if args.json:
        text = "".join(
            json.dumps(
                {
                    "total": s.total,
                    "per_token": s.per_token,
                    "normalized": s.normalized,
                    "tokens": s.tokens,
                }
            )
            + "\n"
            for s in scores
        )
    else:
        text = "".join(
            f"{s.total:.6f}\t{s.per_token:.6f}\t{s.normalized:.6f}\t{s.tokens}\n" for s in scores
        )
    if args.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with atomic_write(args.output, "w") as f:
            f.write(text)
    tokens = sum(s.tokens for s in scores)
    total = sum(s.total for s in scores)
    summary = {
        "pairs": len(scores),
        "tokens": tokens,
        "log_prob": total,
        "per_token": total / tokens if tokens else 0.0,
        "ppl": math.exp(-total / tokens) if tokens else float("nan"),
    }
    print(json.dumps(summary), file=sys.stderr)
    return 0
