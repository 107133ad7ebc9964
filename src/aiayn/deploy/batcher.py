"""`aiayn serve`'s dynamic batching: requests of equal options collected into batches,
bounded by a queue, decoded in worker threads or forked one-thread processes that die with
the server. Under load a batch's first request waits a few milliseconds for company; an
idle server decodes a request at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiayn.decoding.translate import Translation
from aiayn.deploy.engines import Backend, Options, ServerLimits

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------- batching
#: The backend of the forked decoding processes: set before they are forked.
_forked_backend: Backend | None = None


def _fork_workers(backend: Backend, workers: int) -> Executor:
    """`workers` processes forked now (before any request: no other thread holds a lock
    mid-way), each with one torch thread (aiayn.decoding.workers says why only one)."""
    import multiprocessing as mp

    from aiayn.decoding.workers import check_workers, freeze_for_workers, prepare_shared

    global _forked_backend
    check_workers(workers)
    _forked_backend = backend
    model = getattr(backend, "model", None)  # aiayn's backend (engines.AiaynBackend)
    if model is not None:
        prepare_shared(model)  # one copy for every process, not one each
    freeze_for_workers()  # the model's objects stay shared, copy-on-write
    pool = ProcessPoolExecutor(
        workers, mp_context=mp.get_context("fork"), initializer=_init_decoding_process
    )
    for f in [pool.submit(_one_thread) for _ in range(workers)]:
        f.result()  # every process forked and ready
    return pool


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _init_decoding_process() -> None:
    """A decoding process dies with the server, even by kill -9 (aiayn.processes)."""
    from aiayn.processes import worker_init

    worker_init()
    _one_thread()


def _decode_forked(
    texts: list[str], options: Options, line_numbers: list[int] | None = None
) -> list[list[Translation]]:
    assert _forked_backend is not None, "decoding process without a backend"
    return _forked_backend.translate(texts, options, line_numbers)


class OverloadedError(Exception):
    """The queue is full: the request is refused at once (503 + Retry-After)."""


@dataclass(eq=False)  # a job is itself: removed from the queue by identity
class _Job:
    texts: list[str]
    tokens: int  # source subwords, EOS included
    options: Options
    future: asyncio.Future[list[list[Translation]]]
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    """Collects requests into batches of equal options and decodes them in worker threads
    or processes.

    Args:
        backend: the engine.
        limits: batch size, wait window, queue bound.
        workers: batches decoded at once, each in its own thread (give each torch thread
            count cores / workers: `aiayn serve` does), or with `processes`, each in a
            forked process of one thread, as `aiayn translate --workers` decodes: the
            beam search's Python then runs beside the HTTP layer's, not under one lock.
            With processes, a lone request on an idle server (nothing decoding, nothing
            else waiting) is decoded in this process instead, on one thread: it skips the
            pipe to a worker and back (8-13% more one-client sentences/s). Not more:
            decoding here every batch that found the workers idle cost 10-13% of the
            sentences/s at 32 clients, this process's lock being the HTTP layer's too
            (docs/performance.md, "Worker processes by default").
        metrics: where counts go (a `Metrics`), or None.
    """

    def __init__(
        self,
        backend: Backend,
        limits: ServerLimits,
        workers: int = 1,
        metrics: Any = None,
        processes: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.processes = processes
        self.backend, self.limits, self.workers, self.metrics = backend, limits, workers, metrics
        self.pending: deque[_Job] = deque()
        self.queued = 0  # sentences waiting or decoding
        self.dropped = 0  # jobs whose client left before their batch started
        self.busy = 0  # batches decoding now
        self.waits = 0  # times a first request waited for company (only under load)
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: Executor | None = None
        self._here: Executor | None = None  # with processes: idle batches, in this process
        self._threads_before = 0  # torch's threads before start() set one (processes)

    # -- life
    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        if self.processes:
            self._pool = _fork_workers(self.backend, self.workers)
            self._here = ThreadPoolExecutor(1, thread_name_prefix="aiayn-decode-here")
            # one thread here too, as in the workers: the same path, the same outputs, and
            # no third thread on the cores beside two busy workers
            import torch

            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
        else:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="aiayn-decode")
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for pool in (self._pool, self._here):
            if pool is not None:
                pool.shutdown(wait=True)
        if self._threads_before:
            import torch

            torch.set_num_threads(self._threads_before)
        for job in self.pending:
            if not job.future.done():
                job.future.set_exception(OverloadedError("the server is stopping"))
        self.pending.clear()

    # -- requests
    async def submit(
        self, texts: list[str], tokens: int, options: Options
    ) -> list[list[Translation]]:
        """Queue texts and wait for their translations; raises OverloadedError when full."""
        if self.queued + len(texts) > self.limits.max_queue:
            raise OverloadedError(
                f"{self.queued} sentences queued; the limit is {self.limits.max_queue}"
            )
        assert self._wakeup is not None, "Batcher.start() first"
        job = _Job(texts, tokens, options, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self.queued += len(texts)
        self._gauge()
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:  # the client left (its future is cancelled too)
            if job in self.pending:  # not started: its place in the queue is freed now
                self.pending.remove(job)
                self._drop(job)
            raise  # in a batch already: the batch finishes, its result is not delivered

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(self.queued)

    # -- the worker loop
    def _take(self) -> list[_Job]:
        """The oldest job's options; every waiting job with them, oldest first, up to
        max_batch_tokens and to this worker's share of the sentences in the server (waiting
        or decoding, divided by the workers; the first job always). The share keeps the
        workers equally busy under a closed loop of clients: without it one worker took
        every waiting request while the other decoded the few that came after, the load's
        sentences/s at 32 clients fell below that at 8, and the big batch's requests
        waited longest (p99). A job whose client left is not here: `submit` took it out."""
        if not self.pending:
            return []
        first = self.pending[0]
        share = -(-self.queued // self.workers)
        batch: list[_Job] = []
        tokens, sentences, keep = 0, 0, deque[_Job]()
        for job in self.pending:
            if job.options == first.options and (
                not batch
                or (
                    tokens + job.tokens <= self.limits.max_batch_tokens
                    and sentences + len(job.texts) <= share
                )
            ):
                batch.append(job)
                tokens += job.tokens
                sentences += len(job.texts)
            else:
                keep.append(job)
        self.pending = keep
        return batch

    def _drop(self, job: _Job) -> None:
        self.dropped += 1
        self.queued -= len(job.texts)
        self._gauge()

    async def _worker(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self.pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            # Under load (another batch decoding), the first request waits a moment for
            # others to batch with: throughput. On an idle server nothing is coming that
            # waiting would gather, so it is decoded at once: latency at low load.
            wait = self.limits.batch_wait_ms / 1000 - (
                time.perf_counter() - self.pending[0].enqueued
            )
            tokens = sum(j.tokens for j in self.pending)
            if self.busy and wait > 0 and tokens < self.limits.max_batch_tokens:
                self.waits += 1
                await asyncio.sleep(wait)
            batch = self._take()
            if not batch:
                continue
            if self.pending:
                self._wakeup.set()  # another worker may take the rest
            texts = [t for job in batch for t in job.texts]
            start = time.perf_counter()
            # an idle server's lone request is decoded here, without the pipes (class doc)
            here = self._here is not None and len(batch) == 1 and not (self.busy or self.pending)
            self.busy += 1
            try:
                pool = self._here if here else self._pool
                forked = self.processes and not here
                decode = _decode_forked if forked else self.backend.translate
                options = batch[0].options
                if options.sampling is None:
                    results = await loop.run_in_executor(pool, decode, texts, options)
                else:  # each text's index in its own request seeds its samples
                    numbers = [i for job in batch for i in range(len(job.texts))]
                    results = await loop.run_in_executor(pool, decode, texts, options, numbers)
            except Exception as e:  # a bug or a system fault: each request gets a 500
                logger.exception("decoding a batch of %d sentences failed", len(texts))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
            else:
                if self.metrics is not None:
                    self.metrics.batch_done(
                        texts, results, time.perf_counter() - start, self.backend
                    )
                at = 0
                for job in batch:
                    if not job.future.done():  # cancelled by a client that left
                        job.future.set_result(results[at : at + len(job.texts)])
                    at += len(job.texts)
            finally:
                self.busy -= 1
                self.queued -= len(texts)
                self._gauge()
