"""What valid BLEU (train.valid_bleu_interval_steps) costs each time it runs: decoding the
subset with `aiayn.training.watch.decode_ids`, on a model of a preset with random weights.

A random model never emits EOS, so every sentence runs to its cap (input + 50): the worst
case; a trained model stops near the reference length, about 2-3x sooner.

    python benchmarks/valid_bleu_cost.py --preset base --device cuda --dtype bf16
    python benchmarks/valid_bleu_cost.py --preset tiny --sentences 100 --beam 1 4

Prints one JSON line per (beam): seconds for --sentences sources of WMT-like lengths
(uniform 10-50 subwords, mean 30), after one untimed warm-up pass on 20 of them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aiayn.config import EOS_ID, get_preset
from aiayn.fast import accelerate
from aiayn.model import Transformer
from aiayn.training.watch import decode_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (the run's autocast)")
    p.add_argument("--sentences", type=int, default=500)
    p.add_argument("--beam", type=int, nargs="+", default=[1, 4])
    p.add_argument("--vocab", type=int, default=37000)
    p.add_argument("--max-tokens", type=int, default=4000, help="decode.max_tokens")
    args = p.parse_args()
    cfg = get_preset(args.preset)
    torch.manual_seed(0)
    model = accelerate(
        Transformer(cfg.model.__class__(**{**vars(cfg.model), "vocab_size": args.vocab}))
    )
    model.to(args.device)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(10, 51, (args.sentences,), generator=g).tolist()
    sources = [[*torch.randint(4, args.vocab, (n,), generator=g).tolist(), EOS_ID] for n in lengths]
    decode = cfg.decode.__class__(max_tokens=args.max_tokens)
    device = torch.device(args.device)
    for beam in args.beam:
        decode_ids(model, sources[:20], beam, decode, device, args.dtype)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = decode_ids(model, sources, beam, decode, device, args.dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "preset": args.preset,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "dtype": args.dtype,
                    "beam": beam,
                    "sentences": args.sentences,
                    "output_tokens": sum(len(x) for x in out),
                    "seconds": round(seconds, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
