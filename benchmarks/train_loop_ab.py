"""The real training loop (`aiayn train` on a prepared data directory) with one of its GPU
choices switched off, alternating fresh processes: what each choice buys in a run, not in
the fixed-shape `bench train` step.

Arms:
  default      aiayn as shipped
  no-prefetch  batches built on the main thread after each step (`Trainer.prefetch`)
  cudnn        PyTorch's cuDNN attention allowed (`aiayn.fast.attention.NoCudnnAttention` off)
  no-kernel    PyTorch's attention kernels instead of aiayn's Triton one (`aiayn.fast.kernels`)

Prints the training clock (train_seconds in train_log.jsonl: updates only, no validation
or checkpoints) at every logged step, and the last logged loss. Example
(docs/experiments/2026-11-25-perf-gpu-training-loop.md, "The training loop on the GPU"):

  python benchmarks/train_loop_ab.py runs/m30k-en-de/data/prepared --arms default,cudnn \
      --rounds 2 -- --config configs/multi30k-en-de.toml --device cuda --set max_steps=300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = ("default", "no-prefetch", "cudnn", "no-kernel")


def _child(arm: str, argv: list[str]) -> int:
    """Runs `aiayn train` in this process with `arm`'s choice switched off."""
    import aiayn.training.trainer as train_mod
    from aiayn.cli import main
    from aiayn.fast import attention, kernels

    if arm == "no-prefetch":
        init = train_mod.Trainer.__init__

        def no_prefetch(self: train_mod.Trainer, *a: object, **kw: object) -> None:
            init(self, *a, **kw)  # type: ignore[arg-type]
            self.prefetch = False

        train_mod.Trainer.__init__ = no_prefetch  # type: ignore[method-assign]
    elif arm == "cudnn":
        attention.NoCudnnAttention.__init__ = (  # type: ignore[method-assign]
            lambda self, q: setattr(self, "active", False)
        )
    elif arm == "no-kernel":
        kernels.MIN_ELEMENTS = 1 << 62
    return main(argv)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="after --: arguments for `aiayn train`"
    )
    ap.add_argument("data", help="a directory made by `aiayn prepare`")
    ap.add_argument("--arms", default="default,no-prefetch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    extra = argv[cut + 1 :]  # for `aiayn train`: config, device, --set ...
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        ap.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    env = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1"}  # one process, patches kept
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in arms:
                out = Path(tmp) / f"{arm}-{r}"
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    arm,
                    "train",
                    args.data,
                    "--out",
                    str(out),
                    "--no-progress",
                    *extra,
                ]
                rc: int | str
                try:
                    rc = subprocess.run(
                        cmd, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                log = out / "train_log.jsonl"
                rows = (
                    [json.loads(line) for line in log.read_text().splitlines()]
                    if log.exists()
                    else []
                )
                steps = [(r_["step"], round(r_["time"], 1)) for r_ in rows if "loss" in r_]
                last = next((r_["loss"] for r_ in reversed(rows) if "loss" in r_), None)
                print(
                    f"round {r + 1} {arm:<12} rc={rc} clock (step, s): {steps} last loss: {last}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
