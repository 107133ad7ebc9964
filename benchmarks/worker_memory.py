"""Memory each forked decoding process adds, with and without the one-call step's weights
laid out before forking (`aiayn.decoding.workers.prepare_shared`).

    python benchmarks/worker_memory.py --preset base --vocab 37000 --dtype fp32
    python benchmarks/worker_memory.py --preset base --vocab 37000 --dtype int8

A random model of the preset's shapes, cast as `aiayn translate` casts it, decodes
`--batches` batches of `--sentences` random sentences (8-16 tokens, beam 4, 10 output tokens
at most) in `--workers` forked one-thread processes (`map_batches`); each reports its
Private_Dirty (`/proc/self/smaps_rollup`: pages it wrote itself, not shared with the
parent) after each batch, the largest kept. Run once with `--no-prepare` (each worker lays
the weights out itself, as before) and once without (the parent does, before forking).
Linux only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from aiayn.config import get_preset
from aiayn.decoding import workers
from aiayn.decoding.search import beam_search
from aiayn.fast.machine import cast_for_inference
from aiayn.model import Transformer


def private_mib() -> int:
    """This process's Private_Dirty in MiB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no Private_Dirty in /proc/self/smaps_rollup")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab", type=int, default=37000)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--sentences", type=int, default=8)
    p.add_argument("--no-prepare", action="store_true", help="leave the layout to each worker")
    args = p.parse_args()

    cfg = dataclasses.replace(get_preset(args.preset).model, vocab_size=args.vocab)
    torch.manual_seed(0)
    model = cast_for_inference(Transformer(cfg).eval(), args.dtype)
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(4, args.vocab, (args.sentences, int(torch.randint(8, 17, (1,), generator=g))))
        for _ in range(args.batches)
    ]
    if not args.no_prepare:
        workers.prepare_shared(model)

    def decode(b: int) -> tuple[int, int]:
        with torch.inference_mode():
            beam_search(model, batches[b], 4, 0.6, 0.0, 10, 1)
        return os.getpid(), private_mib()

    most: dict[int, int] = {}
    for pid, mib in workers.map_batches(decode, len(batches), args.workers):
        most[pid] = max(most.get(pid, 0), mib)
    layout = "each worker's own" if args.no_prepare else "laid out before forking"
    print(
        f"{args.preset} vocab {args.vocab} {args.dtype}, weights {layout}: "
        f"private MiB per worker {sorted(most.values())}"
    )


if __name__ == "__main__":
    main()
