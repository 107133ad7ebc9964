"""The subcommands that ship a trained model: `aiayn serve` (the HTTP API) and `aiayn
export` (CTranslate2, MarianMT). Imports of other aiayn modules are inside the functions,
as in `aiayn.cli.commands`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiayn.cli.commands import _load_decoder
from aiayn.files import UsageError, check_output_dir


def cmd_serve(args: argparse.Namespace) -> int:
    """`aiayn serve`: load (and check) the checkpoints, then answer HTTP until SIGTERM."""
    from aiayn.deploy.server import AiaynBackend, ServerLimits, create_app, serve

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: a TCP port is 0..65535")
    limits = ServerLimits(
        max_batch_tokens=args.max_batch_tokens,
        batch_wait_ms=args.batch_wait_ms,
        max_queue=args.max_queue,
        max_texts=args.max_texts,
        max_input_tokens=args.max_input_tokens,
        max_body_bytes=args.max_body_bytes,
        max_beam=args.max_beam,
    )
    try:
        limits.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    model, tokenizer, cfg = _load_decoder(args, (), {})
    processes = args.device == "cpu" and args.workers > 1  # as translate --workers: forked
    name = Path(args.checkpoint[0]).name if len(args.checkpoint) == 1 else "ensemble"
    backend = AiaynBackend(model, tokenizer, cfg.decode, args.device, name=name)
    app = create_app(backend, cfg.decode, limits, workers=args.workers, processes=processes)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"aiayn serve: listening on {args.host}: reachable from other machines", file=sys.stderr
        )
    return serve(app, args.host, args.port, args.graceful_timeout, args.log_level)


def cmd_export(args: argparse.Namespace) -> int:
    """`aiayn export`: a checkpoint as a CTranslate2 or MarianMT model directory."""
    checkpoint, out = Path(args.checkpoint), Path(args.out)
    if not checkpoint.is_file():
        raise UsageError(f"--checkpoint {checkpoint}: no such file")
    check_output_dir(out)  # a run directory never, even with --force: its config.json is its own
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(
            f"--out {out} exists and is not empty: choose a new directory, or pass --force "
            "to write into it"
        )
    try:  # a read-only or missing place fails now, naming it, not after loading the model
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create {out.parent}: {e.strerror}") from None
    if args.quantization is not None and args.to != "ctranslate2":
        raise UsageError("--quantization is for --to ctranslate2")
    from aiayn.cli.extras import EXPORT, require

    require(f"export --to {args.to}", tuple((m, "export") for m in EXPORT[args.to]))
    if args.to == "ctranslate2":
        from aiayn.deploy.export import export_ctranslate2

        export_ctranslate2(checkpoint, out, args.quantization)
    else:
        from aiayn.deploy.marian import export_marian

        export_marian(checkpoint, out)
    print(f"exported {checkpoint} to {out} ({args.to}); how to call it: {out / 'README.md'}")
    return 0
