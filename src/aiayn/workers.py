"""Decoding whole batches in parallel worker processes, one thread each (CPU).

A decoding step is ~1,300 small operators; with two threads each of them is split across
both cores, which then meet ~1,300 times a step. Handing whole batches to single-threaded
processes instead, as CTranslate2's `inter_threads` does, decoded 1.2-1.6x more sentences
per second on a 2-core CPU with 64-sentence batches; with batches large enough to keep
both threads busy, no gain showed (docs/performance.md).

The workers are forked: they share the model's memory (copy-on-write), and only batch
numbers and results cross between processes. A forked process may use only one OpenMP
thread (GNU OpenMP, which PyTorch's CPU build uses, hangs in a forked child that starts
more), so each worker runs exactly one. A worker that dies (killed, out of memory) fails
the whole call with an error instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# The job of the pool being run: set before the workers are forked, so they inherit it.
_job: Callable[[int], Any] | None = None


def _init_worker() -> None:
    torch.set_num_threads(1)  # before any operator: see the module doc


def _run(i: int) -> tuple[int, Any]:
    assert _job is not None, "worker started without a job"
    return i, _job(i)


def check_workers(workers: int, device: str | torch.device = "cpu") -> None:
    """Refuse a worker count this machine cannot use, naming the option."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers > 1 and torch.device(device).type != "cpu":
        raise ValueError(f"workers > 1 is for CPU decoding; got device {device}")
    if workers > 1 and "fork" not in mp.get_all_start_methods():
        raise ValueError("workers > 1 needs the 'fork' start method (Linux, macOS)")


def map_batches(fn: Callable[[int], T], n: int, workers: int = 1,
                done: Callable[[int, T], None] | None = None) -> list[T]:
    """[fn(0), ..., fn(n - 1)], by `workers` forked single-thread processes if > 1.

    `done(i, result)` is called in this process as each result arrives (in completion
    order with workers, in order without). Workers take the next batch when free, so
    batches of uneven cost balance out.
    """
    check_workers(workers)
    if workers == 1 or n <= 1:
        results = []
        for i in range(n):
            results.append(fn(i))
            if done is not None:
                done(i, results[-1])
        return results
    global _job
    if _job is not None:
        raise RuntimeError("map_batches is not re-entrant")
    _job = fn
    out: list[Any] = [None] * n
    try:
        with ProcessPoolExecutor(min(workers, n), mp_context=mp.get_context("fork"),
                                 initializer=_init_worker) as pool:
            pending = {pool.submit(_run, i) for i in range(n)}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in finished:
                    i, result = future.result()  # re-raises a worker's error here
                    out[i] = result
                    if done is not None:
                        done(i, result)
    finally:
        _job = None
    return out
