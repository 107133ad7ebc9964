"""Where a decoding step's time goes at small batches: framework overhead against arithmetic.

    python benchmarks/step_breakdown.py --preset tiny --dtype int8 --batch 1 --beam 4
    python benchmarks/step_breakdown.py --checkpoint RUN/checkpoint_avg.pt --dtype int8

One thread, the bench model (`aiayn.experiments.bench.random_model`, outputs forced to
--out-len tokens) or a checkpoint's weights on random sources. Two ways of running the same
search, interleaved over --rounds:

- `per-layer`: the decoder step as PyTorch operators (`AIAYN_NATIVE_STEP=0`), timed with the
  PyTorch profiler: the operators' own time (self CPU time summed over every operator)
  against the step's wall time; the difference is the interpreter and the framework between
  them (Python, dispatch, allocation).
- `one call`: the whole step in one C call (`aiayn.fast.decoder_step`, `AIAYN_NATIVE_STEP=1`),
  the search's loop in Python (the compiled search switched off): the time inside that call
  (perf_counter around it) against the step's wall time.
- `compiled search`: the whole search in one C call (csrc/beam_search.c): its wall time per
  step, encoder and Python before and after included.

Both report ms per decoder step (a step = one call of the search's step for every row),
and the search's sentences/s. The encoder runs the PyTorch path in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch


def build(args: argparse.Namespace) -> tuple[Any, torch.Tensor]:
    from aiayn.experiments.bench import random_batch, random_model
    from aiayn.fast.machine import cast_for_inference

    if args.checkpoint:
        from aiayn.checkpoints import load_model

        model, _, _ = load_model(args.checkpoint)
        vocab = model.cfg.vocab_size
    else:
        model, vocab = random_model(args.preset, args.vocab), args.vocab
    model = cast_for_inference(model.eval(), args.dtype)
    return model, random_batch(args.sentences, vocab, seed=3)


def search(model: Any, src: torch.Tensor, args: argparse.Namespace) -> None:
    from aiayn.decoding.search import beam_search, greedy_search

    for i in range(0, src.size(0), args.batch):
        chunk = src[i : i + args.batch]
        if args.beam == 1:
            greedy_search(model, chunk, 0.0, args.out_len, min_len=args.out_len)
        else:
            beam_search(model, chunk, args.beam, 0.6, 0.0, args.out_len, min_len=args.out_len)


def wall(model: Any, src: torch.Tensor, args: argparse.Namespace, warm: bool = True) -> float:
    """Seconds of one search over `src` (after a warm-up search unless `warm` is False)."""
    with torch.inference_mode():
        if warm:
            search(model, src, args)
        t0 = time.perf_counter()
        search(model, src, args)
        return time.perf_counter() - t0


def per_layer(model: Any, src: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    os.environ["AIAYN_NATIVE_STEP"] = "0"
    seconds = wall(model, src, args)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        search(model, src, args)
    events = prof.key_averages()
    ops = sum(e.self_cpu_time_total for e in events) / 1e6
    steps = _steps(src, args)
    return {
        "sentences_per_s": src.size(0) / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "ops_ms_per_step_profiled": 1e3 * ops / steps,
        "op_calls_per_step": sum(e.count for e in events) / steps,
    }


def one_call(model: Any, src: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    from aiayn import speed

    whole = speed.IMPLEMENTATIONS.pop("whole_search", None)  # the search's loop in Python
    try:
        return _one_call(model, src, args)
    finally:
        if whole is not None:
            speed.IMPLEMENTATIONS["whole_search"] = whole


def compiled_search(model: Any, src: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    os.environ["AIAYN_NATIVE_STEP"] = "1"
    seconds = wall(model, src, args)
    return {
        "sentences_per_s": src.size(0) / seconds,
        "ms_per_step": 1e3 * seconds / _steps(src, args),
    }


def _one_call(model: Any, src: torch.Tensor, args: argparse.Namespace) -> dict[str, float]:
    from aiayn.fast import decoder_step

    os.environ["AIAYN_NATIVE_STEP"] = "1"
    inside = [0.0]
    original = decoder_step.NativeStates._call

    def timed(self: Any, *a: Any) -> None:
        t = time.perf_counter()
        original(self, *a)
        inside[0] += time.perf_counter() - t

    seconds = wall(model, src, args)
    decoder_step.NativeStates._call = timed  # type: ignore[method-assign]
    try:
        wall_timed = wall(model, src, args, warm=False)
    finally:
        decoder_step.NativeStates._call = original  # type: ignore[method-assign]
    steps = _steps(src, args)
    return {
        "sentences_per_s": src.size(0) / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "c_ms_per_step": 1e3 * inside[0] / steps,
        "ms_per_step_timed_run": 1e3 * wall_timed / steps,
    }


PATHS = (("per-layer", per_layer), ("one call", one_call), ("compiled search", compiled_search))


def _steps(src: torch.Tensor, args: argparse.Namespace) -> int:
    batches = -(-src.size(0) // args.batch)
    return batches * args.out_len


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="bench model preset (random weights)")
    p.add_argument("--checkpoint", help="a checkpoint's weights instead of a preset's")
    p.add_argument("--vocab", type=int, default=8000, help="preset model's vocabulary")
    p.add_argument("--dtype", default="int8", help="fp32 or int8 (or auto)")
    p.add_argument("--batch", type=int, default=1, help="sentences per search")
    p.add_argument("--beam", type=int, default=4, help="beam size (1: greedy)")
    p.add_argument("--out-len", type=int, default=20, help="every output forced to this")
    p.add_argument("--sentences", type=int, default=32, help="sources searched per round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, src = build(args)
    rows = []
    for r in range(args.rounds):
        for name, fn in PATHS:
            rec = {"round": r, "path": name, **fn(model, src, args)}
            rows.append(rec)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}),
                flush=True,
            )
    for name, _ in PATHS:
        best = max((x for x in rows if x["path"] == name), key=lambda x: x["sentences_per_s"])
        print(
            f"{name}: best {best['sentences_per_s']:.1f} sentences/s, "
            f"{best['ms_per_step']:.3f} ms/step (median over rounds "
            f"{statistics.median(x['ms_per_step'] for x in rows if x['path'] == name):.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
