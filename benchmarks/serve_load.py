"""Load on `aiayn serve` against the same model exported to CTranslate2, behind the same
HTTP layer (issue 57): sentences/s and p50/p99 latency at each concurrency.

Each engine's server runs in a child process (FastAPI + uvicorn, `aiayn.deploy.server`:
the same batcher, limits and JSON); this process is the load: C clients, each posting one
sentence per request and posting the next when the answer comes, until the sentences are
done. Engines alternate level by level and round by round (this machine's speed drifts by
~10% over minutes); the best round of each is reported, with its output-agreement rate.

    python benchmarks/serve_load.py --checkpoint RUN/checkpoint_avg.pt \\
        --input ../shared/data/multi30k/test_2016_flickr.en.gz --sentences 256 \\
        --concurrency 1,8,32 --rounds 2 --json out.json
    python benchmarks/serve_load.py --checkpoint RUN/checkpoint_avg.pt --preset base ...
        (the base preset's shapes, random weights, with the checkpoint's vocabulary)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server(engine: str, checkpoint: str, port: int, opts: dict[str, Any]) -> None:
    """A child process: load the model, build the app, serve until terminated."""
    import torch

    workers = opts["workers"]
    threads = max(1, opts["threads"] // workers)  # the cores, shared among the workers
    torch.set_num_threads(threads)
    from aiayn.checkpoints import load_ensemble
    from aiayn.deploy.server import (
        AiaynBackend,
        CTranslate2Backend,
        ServerLimits,
        create_app,
        serve,
    )

    limits = ServerLimits(batch_wait_ms=opts["batch_wait_ms"], max_queue=4096)
    if engine == "aiayn":
        from aiayn.fast.machine import cast_for_inference

        models, tokenizer, cfg = load_ensemble([checkpoint])
        if opts["dtype"] == "int8-r7":  # int8, inputs to 7 bits (read while casting)
            os.environ["AIAYN_INT8_ACTIVATIONS"] = "7"
        model = cast_for_inference(models[0].eval(), opts["dtype"].removesuffix("-r7"))
        backend: Any = AiaynBackend(model, tokenizer, cfg.decode, name=f"aiayn-{opts['dtype']}")
    else:
        from aiayn.deploy.export import export_ctranslate2

        out = export_ctranslate2(checkpoint, Path(tempfile.mkdtemp(prefix="ct2-")) / "model")
        compute = {"fp32": "float32", "int8": "int8", "int8-r7": "int8", "bf16": "bfloat16"}[
            opts["dtype"]
        ]
        backend = CTranslate2Backend(out, compute, inter_threads=workers, intra_threads=threads)
    processes = engine == "aiayn" and opts["processes"]
    app = create_app(backend, backend.decode, limits, workers=workers, processes=processes)
    serve(app, "127.0.0.1", port, log_level="warning")


def _preset_checkpoint(checkpoint: str, preset: str, out: Path) -> str:
    """A checkpoint of `preset`'s shapes with random weights and `checkpoint`'s vocabulary
    and decoding options: the speed of a model that size, whatever it would translate."""
    import dataclasses

    import torch

    from aiayn.checkpoints import FORMAT, load_checkpoint, save_checkpoint_file
    from aiayn.config import Config, DecodeConfig, get_preset
    from aiayn.model import Transformer

    ckpt = load_checkpoint(checkpoint)
    vocab = Config.from_dict(ckpt["config"]).model.vocab_size
    cfg = get_preset(preset)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=vocab),
        decode=DecodeConfig(**ckpt["config"]["decode"]),
    )
    torch.manual_seed(0)
    path = out / f"{preset}-random.pt"
    save_checkpoint_file(
        path,
        {
            "format": FORMAT,
            "config": cfg.to_dict(),
            "vocab_sha256": ckpt["vocab_sha256"],
            "tokenizer": ckpt["tokenizer"],
            "model": Transformer(cfg.model).state_dict(),
            "step": 0,
        },
    )
    return str(path)


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> tuple[int, bytes]:
    """One POST /translate on a kept-alive HTTP/1.1 connection: (status, body)."""
    writer.write(
        b"POST /translate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(x.split(":", 1)[1]) for x in lines if x.lower().startswith("content-length"))
    return status, await reader.readexactly(length)


async def _clients(url: str, sentences: list[str], concurrency: int) -> dict[str, Any]:
    """`concurrency` closed-loop clients, each on its own kept-alive connection, posting
    one sentence and the next when the answer comes. Plain HTTP/1.1 over asyncio streams:
    httpx's client spent ~5 ms of CPU a request at 32 connections (0.8 of a core here,
    taken from the servers on a 2-core machine; 1.9 ms at 8), which set the rate at 32
    clients for both engines."""
    host, port = url.removeprefix("http://").split(":")
    queue = list(enumerate(sentences))
    queue.reverse()  # pop() from the end: the sentences in order
    latencies: list[float] = []
    outputs: dict[int, str] = {}
    errors = 0

    async def one() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while queue:
                i, text = queue.pop()
                start = time.perf_counter()
                status, body = await _post(reader, writer, json.dumps({"text": text}).encode())
                latencies.append(time.perf_counter() - start)
                if status == 200:
                    outputs[i] = json.loads(body)["translations"][0]["text"]
                else:
                    errors += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    latencies.sort()
    return {
        "sentences_per_s": len(sentences) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "errors": errors,
        "outputs": [outputs.get(i, "") for i in range(len(sentences))],
    }


def _wait(url: str, proc: mp.Process) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise SystemExit(f"the server exited with {proc.exitcode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="an aiayn checkpoint (its vocabulary)")
    ap.add_argument("--preset", help="random weights of this preset's shapes (e.g. base)")
    ap.add_argument("--input", required=True, type=Path, help="source sentences, a line each")
    ap.add_argument("--sentences", type=int, default=256, help="the first N lines")
    ap.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    ap.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "int8", "int8-r7"],
        help="aiayn's (int8-r7: int8 with 7-bit activations, AIAYN_INT8_ACTIVATIONS=7); "
        "CTranslate2's the same (int8 for int8-r7)",
    )
    ap.add_argument("--threads", type=int, default=2, help="compute threads per server")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="batches decoded at once (aiayn: batcher threads; CTranslate2: inter_threads "
        "and as many batcher threads), threads/workers compute threads each",
    )
    ap.add_argument("--batch-wait-ms", type=float, default=5.0)
    ap.add_argument(
        "--threads-not-processes",
        action="store_true",
        help="aiayn's workers as threads (default: forked processes, as `aiayn serve`)",
    )
    ap.add_argument("--engines", default="aiayn,ctranslate2")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    from aiayn.experiments.manifest import environment
    from aiayn.files import read_lines

    sentences = [s for s in read_lines(args.input)][: args.sentences]
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = args.engines.split(",")
    opts = {
        "dtype": args.dtype,
        "threads": args.threads,
        "workers": args.workers,
        "processes": not args.threads_not_processes,
        "batch_wait_ms": args.batch_wait_ms,
    }
    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    checkpoint = args.checkpoint
    if args.preset:
        checkpoint = _preset_checkpoint(args.checkpoint, args.preset, tmp)
    ctx = mp.get_context("spawn")
    servers = {}
    for engine in engines:
        port = _free_port()
        proc = ctx.Process(target=_server, args=(engine, checkpoint, port, opts))
        proc.start()
        servers[engine] = (f"http://127.0.0.1:{port}", proc)
    best: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        for url, proc in servers.values():
            _wait(url, proc)
            asyncio.run(_clients(url, sentences[:16], 4))  # warm-up
        for r in range(args.rounds):
            for c in levels:
                for engine in engines if r % 2 == 0 else engines[::-1]:
                    m = asyncio.run(_clients(servers[engine][0], sentences, c))
                    key = (engine, c)
                    if key not in best or m["sentences_per_s"] > best[key]["sentences_per_s"]:
                        best[key] = m
                    print(
                        f"round {r + 1} {engine:12s} c={c:3d}: {m['sentences_per_s']:7.2f} sent/s"
                        f"  p50 {m['p50_ms']:7.1f} ms  p99 {m['p99_ms']:7.1f} ms"
                        f"  errors {m['errors']}",
                        flush=True,
                    )
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.join(30)
    rows = []
    for c in levels:
        row: dict[str, Any] = {"concurrency": c}
        for engine in engines:
            m = best[(engine, c)]
            row[engine] = {k: round(v, 2) for k, v in m.items() if k != "outputs"}
        if len(engines) == 2:
            a, b = (best[(e, c)] for e in engines)
            row["speedup"] = round(a["sentences_per_s"] / b["sentences_per_s"], 3)
            row["same_output"] = sum(
                x == y for x, y in zip(a["outputs"], b["outputs"], strict=True)
            )
        rows.append(row)
    result = {
        "checkpoint": args.checkpoint,
        "preset": args.preset,
        "sentences": len(sentences),
        "dtype": args.dtype,
        "threads": args.threads,
        "workers": args.workers,
        "rows": rows,
        "environment": environment(),
    }
    print(json.dumps(rows, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
