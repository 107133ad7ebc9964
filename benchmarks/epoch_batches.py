"""Time and memory of one epoch's length bucketing (`token_batches`) at WMT14's sizes.

    python benchmarks/epoch_batches.py --pairs 4500000            # En-De's corpus
    python benchmarks/epoch_batches.py --pairs 36000000           # En-Fr's
    python benchmarks/epoch_batches.py --pairs 4500000 --max-tokens 3125   # 8 ranks' share

Every rank builds its epoch's batches at the start of each epoch from the corpus lengths
alone (`aiayn.training.epochs`), so this is time the GPUs wait and memory every rank holds
all epoch. Lengths are synthetic and WMT-like (log-normal, median ~22 subwords, 1-250,
the target within ~15% of the source), as int32 like `MmapCorpus`'s. Prints one JSON line:
batches, seconds, the peak RSS above the starting point and the RSS still held by the
result.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from aiayn.data.batching import token_batches


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=4_500_000, help="corpus size (default: 4.5M)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=25_000,
        help="tokens per batch and side (default: 25,000, the paper's global batch)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n = args.pairs
    src = torch.empty(n, dtype=torch.int32)
    tgt = torch.empty(n, dtype=torch.int32)
    for a in range(0, n, 1 << 20):  # in chunks: no freed temporaries inflate the baseline
        b = min(n, a + (1 << 20))
        s = (torch.randn(b - a, generator=g) * 0.6 + 3.1).exp().clamp(1, 250)
        src[a:b] = s.to(torch.int32)
        tgt[a:b] = (s.floor() * (1 + 0.15 * torch.randn(b - a, generator=g))).clamp(1, 250).int()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS: the peak of what follows alone
    start = _kib("VmRSS:")
    t0 = time.perf_counter()
    batches = token_batches(src, tgt, args.max_tokens, seed=1, epoch=0)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "pairs": n,
                "max_tokens": args.max_tokens,
                "batches": len(batches),
                "seconds": round(seconds, 2),
                "peak_mib_over_start": round((_kib("VmHWM:") - start) / 1024),
                "held_mib": round((_kib("VmRSS:") - start) / 1024),
            }
        )
    )


if __name__ == "__main__":
    main()
