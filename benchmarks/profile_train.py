"""Where a training step's time goes: `aiayn bench train`'s step under torch.profiler.

    python benchmarks/profile_train.py --preset base --dtype bf16                 # CPU
    python benchmarks/profile_train.py --device cuda --batch-sentences 1700       # a GPU

Prints the operators by self time (device time on a GPU) and, on a GPU, how busy the
device was: the sum of kernel times over the step's wall time. A GPU that is idle for
much of the step is waiting for Python to launch kernels (launch-bound), which larger
batches, CUDA graphs or torch.compile address; a busy one is bound by its kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from aiayn.experiments.bench import _sync, train_step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sentences", type=int, default=291)
    p.add_argument("--steps", type=int, default=5, help="profiled steps (after 3 warm-up)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", help="also write a Chrome trace (chrome://tracing) here")
    args = p.parse_args()

    dev = torch.device(args.device)
    step, _, _, _ = train_step(
        args.preset, args.dtype, args.device, batch=args.batch_sentences, compile=args.compile
    )
    for _ in range(3):
        step()
    _sync(dev)
    walls = []
    for _ in range(args.steps):  # unprofiled: the profiler itself slows the launches
        t0 = time.perf_counter()
        step()
        _sync(dev)
        walls.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        _sync(dev)
    wall = statistics.median(walls)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))
    if dev.type == "cuda":
        kernels = (
            sum(
                e.device_time
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
            )
            / 1e6
            / args.steps
        )
        print(
            f"step wall {wall * 1e3:.1f} ms (median of {args.steps}, unprofiled); kernels "
            f"{kernels * 1e3:.1f} ms a step: the GPU is busy {kernels / wall:.0%} of the step"
        )
    else:
        print(f"step wall {wall * 1e3:.1f} ms (median of {args.steps}, unprofiled)")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
