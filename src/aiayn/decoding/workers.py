"""Decoding whole batches in parallel worker processes, one thread each (CPU).

Two threads split each small product of a decoding step across both cores, which then
meet at every one, and much of a step runs on one thread whatever the count (the search's
Python; the one C call of `aiayn.fast.decoder_step`). Handing whole batches to
single-threaded processes instead, as CTranslate2's `inter_threads` does, decoded more
sentences per second on a 2-core CPU: `aiayn translate` 1.2-1.3x (float32) to 1.6-1.8x
(int8), `aiayn parse` 1.2-1.3x, the same outputs (measured: docs/performance.md, "Worker
processes by default"), so `--workers auto`, the commands' default, takes one a core.

The workers are forked: they share the model's memory (copy-on-write), and only batch
numbers and results cross between processes. A forked process may use only one OpenMP
thread (GNU OpenMP, which PyTorch's CPU build uses, hangs in a forked child that starts
more), so each worker runs exactly one. A worker that dies (killed, out of memory) fails
the whole call with an error instead of hanging it.

While batches are decoded, the objects that existed before (the model, PyTorch's own:
~170,000) are frozen out of Python's garbage collector (`gc_frozen`).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, TypeVar

import torch

from aiayn.processes import end_pool, sigint_deferred, worker_init

T = TypeVar("T")

# The job of the pool being run: set before the workers are forked, so they inherit it.
_job: Callable[[int], Any] | None = None


def _init_worker() -> None:
    worker_init()  # dies with this process, however it dies; Ctrl-C is this process's
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


def default_workers(device: str | torch.device = "cpu") -> int:
    """The processes `--workers auto` decodes in: on the CPU one per thread PyTorch would use
    (`torch.get_num_threads()`: the physical cores, or OMP_NUM_THREADS), as the module doc
    says why; 1 on a GPU or where processes cannot be forked."""
    if torch.device(device).type != "cpu" or "fork" not in mp.get_all_start_methods():
        return 1
    return max(1, torch.get_num_threads())


def resolve_workers(workers: int | str, device: str | torch.device = "cpu") -> int:
    """`workers` as a count: "auto" is `default_workers(device)`."""
    if workers == "auto":
        return default_workers(device)
    if isinstance(workers, str):
        raise ValueError(f"workers must be a count >= 1 or 'auto', got {workers!r}")
    return workers


def prepare_shared(model: Any) -> None:
    """Build here, before forking, what each decoding process would otherwise build for
    itself on its first batch (`FastTransformer.prepare_decoding`: the one-call step's
    weights), so that the workers share one copy. Any model or ensemble (`members`)."""
    for member in getattr(model, "members", None) or [model]:
        prepare = getattr(member, "prepare_decoding", None)
        if prepare is not None:
            prepare()


#: Set by `freeze_for_workers`: this process keeps its objects frozen for good.
_kept_frozen = False


def freeze_for_workers() -> None:
    """Freeze every object now, for good, before forking long-lived workers (`aiayn serve`):
    they inherit the objects frozen, and copy-on-write keeps the pages shared. Recorded, so
    that `gc_frozen` need not ask `gc.get_freeze_count()`, which walks every frozen object
    (~11 ms for ~170,000: measured on every request of a server before this)."""
    global _kept_frozen
    gc.freeze()
    _kept_frozen = True


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """The objects that exist now out of the garbage collector's sight until the block ends
    (`gc.freeze`). Decoding allocates enough short-lived objects to start collections, and
    each full one traversed every object of the process, a measurable part of a small
    model's batch; frozen, they have almost nothing to traverse (measured:
    docs/performance.md). A forked worker inherits the frozen objects, and no collection
    there touches their pages, so copy-on-write keeps them shared (as Python's
    documentation of gc.freeze advises). Unfrozen at the end, so that nothing stays out of
    the collector's reach for longer, unless the caller had frozen objects itself (gc
    cannot unfreeze only some): then they all stay frozen."""
    # (get_freeze_count is instant when nothing is frozen, the usual case)
    frozen_before = _kept_frozen or gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def map_batches(
    fn: Callable[[int], T], n: int, workers: int = 1, done: Callable[[int, T], None] | None = None
) -> list[T]:
    """[fn(0), ..., fn(n - 1)], by `workers` forked single-thread processes if > 1.

    `done(i, result)` is called in this process as each result arrives (in completion
    order with workers, in order without). Workers take the next batch when free, so
    batches of uneven cost balance out.
    """
    check_workers(workers)
    with gc_frozen():
        return _map_batches(fn, n, workers, done)


def _map_batches(
    fn: Callable[[int], T], n: int, workers: int, done: Callable[[int, T], None] | None
) -> list[T]:
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
        pool = ProcessPoolExecutor(
            min(workers, n), mp_context=mp.get_context("fork"), initializer=_init_worker
        )
        try:
            with sigint_deferred():  # the forks start with Ctrl-C left to this process
                pending = {pool.submit(_run, i) for i in range(n)}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in finished:
                    i, result = future.result()  # re-raises a worker's error here
                    out[i] = result
                    if done is not None:
                        done(i, result)
        except BaseException:
            end_pool(pool)  # Ctrl-C, SIGTERM or an error: no more batches decoded
            raise
        pool.shutdown()
    finally:
        _job = None
    return out
