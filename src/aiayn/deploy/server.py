"""`aiayn serve`: a trained model behind an HTTP JSON API, batched dynamically and bounded.

The stack is FastAPI on uvicorn: the most used ASGI pair in Python, with request
validation (pydantic), OpenAPI documentation at /docs and a graceful-shutdown server,
so that what is written here is only what is particular to translation.

How a request flows: the handler reads the body under a byte limit, parses and checks it
(each fault a 4xx with a JSON error, group G3 of RELIABILITY.md), counts each text's
subwords, and hands the texts to the `Batcher`. Under load (a batch already decoding) the
batcher waits a few milliseconds for more requests with the same decoding options (an
idle server decodes a request at once), takes up to `max_batch_tokens` source
subwords, and decodes them in a worker thread with the same function `aiayn translate`
uses (`translate_nbest`): beam search is batch-invariant, so a sentence's output does not
depend on what it was batched with (G1). The queue is bounded: beyond `max_queue`
sentences, requests are answered at once with 503 and Retry-After (G2). A client that
goes away before its batch starts has its work dropped (G4). SIGTERM stops the listener,
lets the requests in flight finish and exits 0 (G5); the checkpoint is loaded (and
checked) before the port is opened (G6).

The HTTP layer does not care which engine decodes: `Backend` is aiayn's model or, for
the load benchmark, the same model exported to CTranslate2 (`CTranslate2Backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from aiayn.config import DecodeConfig
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.translate import Decoder, Translation, _input_limit, translate_nbest

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts; beyond each limit a request gets a 4xx or 503, never a crash.

    max_input_tokens: 0 means the model's own limit (decode.max_input_len, and the
    position table); the CLI truncates longer lines, the server refuses them (413).
    """

    max_batch_tokens: int = 4000  # source subwords decoded together
    batch_wait_ms: float = 5.0  # under load, how long a batch's first request waits for company
    max_queue: int = 256  # sentences waiting or decoding; more -> 503 + Retry-After
    max_texts: int = 64  # texts in one request
    max_input_tokens: int = 0  # subwords in one text (0: the model's limit)
    max_body_bytes: int = 1 << 20  # request body
    max_beam: int = 16
    retry_after_s: int = 1

    def validate(self) -> None:
        for name in ("max_batch_tokens", "max_queue", "max_texts", "max_body_bytes", "max_beam"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0 or self.max_input_tokens < 0 or self.retry_after_s < 0:
            raise ValueError("batch_wait_ms, max_input_tokens and retry_after_s must be >= 0")


#: The request fields that only sampling takes.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


@dataclass(frozen=True)
class Options:
    """The decoding options a request may choose; requests batch only with equal options."""

    beam: int
    alpha: float
    nbest: int  # outputs per text: the n best, or with `sampling` the samples
    sampling: SamplingOptions | None = None  # draw instead of searching


# ------------------------------------------------------------------------- engines
#: `decode.max_tokens` that keeps any batch the batcher made in one decoding batch.
ONE_BATCH = 1 << 62


class Backend(Protocol):
    """What decodes: texts in, each text's n best translations out (best first)."""

    name: str
    input_limit: int  # longest source in subwords

    def count_tokens(self, text: str) -> int: ...

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]: ...


class AiaynBackend:
    """aiayn's own decoder: `translate_nbest`, exactly as `aiayn translate` runs it."""

    def __init__(
        self,
        model: Decoder,
        tokenizer: Any,
        decode: DecodeConfig,
        device: str = "cpu",
        name: str = "aiayn",
    ) -> None:
        self.model, self.tokenizer, self.decode, self.device = model, tokenizer, decode, device
        self.name = name
        self.input_limit = _input_limit(model, decode)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]:
        # the batcher sized the batch: one decoding batch for all of it, whatever its padding
        cfg = replace(
            self.decode,
            beam=options.beam,
            alpha=options.alpha,
            nbest=1 if options.sampling is not None else options.nbest,
            max_tokens=ONE_BATCH,
        )
        # with sampling, each text is seeded by its index in its own request (the batcher
        # joins requests with equal options): a request samples alike however it is batched
        results, _ = translate_nbest(
            self.model,
            self.tokenizer,
            texts,
            cfg,
            self.device,
            sampling=options.sampling,
            line_numbers=line_numbers,
        )
        return results


class CTranslate2Backend:
    """A model exported by `aiayn export --to ctranslate2`, decoded by CTranslate2's
    `Translator.translate_batch` as its users call it (one call per batch, the batch's
    longest length cap): the engine the load benchmark compares aiayn with.

    CTranslate2's length penalty is score / length**alpha, not GNMT's: beam outputs can
    differ from aiayn's (docs/deploy.md gives the agreement); greedy ones are equal.
    """

    def __init__(
        self,
        model_dir: str | Path,
        compute_type: str = "float32",
        inter_threads: int = 1,
        intra_threads: int = 0,
    ) -> None:
        import ctranslate2
        import sentencepiece as spm

        from aiayn.deploy.export import read_export_info, target_sentencepiece

        info = read_export_info(model_dir)
        known = {f.name for f in dataclasses.fields(DecodeConfig)}
        self.decode = DecodeConfig(**{k: v for k, v in info["decode"].items() if k in known})
        self.sp = spm.SentencePieceProcessor(
            model_file=str(Path(model_dir) / info["sentencepiece"])
        )
        self.sp_out = target_sentencepiece(model_dir, info) or self.sp  # separate vocabularies
        self.translator = ctranslate2.Translator(
            str(model_dir),
            device="cpu",
            compute_type=compute_type,
            inter_threads=inter_threads,
            intra_threads=intra_threads,
        )
        self.name = f"ctranslate2-{compute_type}"
        self.input_limit = min(self.decode.max_input_len, info["max_positions"] - 1)

    def count_tokens(self, text: str) -> int:
        return len(self.sp.encode(text))

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]:
        from aiayn.deploy.export import length_caps

        if options.sampling is not None:
            raise ValueError("the CTranslate2 backend does beam search only, not sampling")

        sources = [self.sp.encode(t, out_type=str) for t in texts]  # the model adds </s>
        d = self.decode
        caps = length_caps([len(s) for s in sources], d.max_len_a, d.max_len_b, None)
        results = self.translator.translate_batch(
            sources,
            beam_size=options.beam,
            num_hypotheses=options.nbest,
            length_penalty=options.alpha,
            max_decoding_length=max(caps),
            min_decoding_length=0,
            return_scores=True,
        )
        # one call for the batch, as CTranslate2's users make it; each output cut to its
        # sentence's own cap (for greedy search, exactly aiayn's output)
        return [
            [
                Translation(str(self.sp_out.decode(tokens[:cap])), float(score))
                for tokens, score in zip(r.hypotheses, r.scores, strict=True)
            ]
            for r, cap in zip(results, caps, strict=True)
        ]


# ------------------------------------------------------------------------- batching
#: The backend of the forked decoding processes: set before they are forked.
_forked_backend: Backend | None = None


def _fork_workers(backend: Backend, workers: int) -> Executor:
    """`workers` processes forked now (before any request: no other thread holds a lock
    mid-way), each with one torch thread (aiayn.decoding.workers says why only one)."""
    import gc
    import multiprocessing as mp

    from aiayn.decoding.workers import check_workers

    global _forked_backend
    check_workers(workers)
    _forked_backend = backend
    gc.freeze()  # the model's objects stay shared, copy-on-write (aiayn.decoding.workers)
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

    # -- life
    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        if self.processes:
            self._pool = _fork_workers(self.backend, self.workers)
        else:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="aiayn-decode")
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._pool is not None:
            self._pool.shutdown(wait=True)
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
        max_batch_tokens (the first job always). A job whose client left is not here:
        `submit` took it out."""
        if not self.pending:
            return []
        first = self.pending[0]
        batch: list[_Job] = []
        tokens, keep = 0, deque[_Job]()
        for job in self.pending:
            if job.options == first.options and (
                not batch or tokens + job.tokens <= self.limits.max_batch_tokens
            ):
                batch.append(job)
                tokens += job.tokens
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
            self.busy += 1
            try:
                decode = _decode_forked if self.processes else self.backend.translate
                options = batch[0].options
                if options.sampling is None:
                    results = await loop.run_in_executor(self._pool, decode, texts, options)
                else:  # each text's index in its own request seeds its samples
                    numbers = [i for job in batch for i in range(len(job.texts))]
                    results = await loop.run_in_executor(
                        self._pool, decode, texts, options, numbers
                    )
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


# ------------------------------------------------------------------------- metrics
class Metrics:
    """Prometheus counters of one server (its own registry: two apps in a process do not mix)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "aiayn_requests", "HTTP requests to /translate by status code", ["code"], registry=r
        )
        self.latency = Histogram(
            "aiayn_request_seconds",
            "time from a /translate request's arrival to its answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.batch_sentences = Histogram(
            "aiayn_batch_sentences",
            "sentences decoded together",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.queue = Gauge("aiayn_queue_sentences", "sentences waiting or decoding", registry=r)
        self.sentences = Counter("aiayn_sentences", "sentences translated", registry=r)
        self.out_tokens = Counter("aiayn_output_tokens", "output subwords generated", registry=r)
        self.tokens_per_s = Gauge(
            "aiayn_output_tokens_per_second",
            "output subwords per second of decoding, over the last 10 s of batches",
            registry=r,
        )
        self.disconnects = Counter(
            "aiayn_client_disconnects", "clients that left before their answer", registry=r
        )
        self._recent: deque[tuple[float, int, float]] = deque()  # (end, tokens, seconds)
        self._lock = threading.Lock()

    def batch_done(
        self, texts: list[str], results: list[list[Translation]], seconds: float, backend: Backend
    ) -> None:
        tokens = sum(backend.count_tokens(r[0].text) + 1 for r in results if r)  # + EOS
        self.batch_sentences.observe(len(texts))
        self.sentences.inc(len(texts))
        self.out_tokens.inc(tokens)
        now = time.perf_counter()
        with self._lock:
            self._recent.append((now, tokens, seconds))
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()
            busy = sum(s for _, _, s in self._recent)
            self.tokens_per_s.set(sum(t for _, t, _ in self._recent) / busy if busy > 0 else 0.0)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ------------------------------------------------------------------------- HTTP
class HTTPError(Exception):
    """A refused request: its status code and one sentence saying why."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _request_model() -> Any:
    """The /translate body's schema (pydantic, strict: a number is not a string)."""
    from pydantic import BaseModel, ConfigDict, Field

    class TranslateRequest(BaseModel):
        """One text, or a list of them, and optional decoding options."""

        model_config = ConfigDict(strict=True, extra="forbid")
        text: str | list[str] = Field(description="a sentence, or a list of sentences")
        beam: int | None = Field(None, ge=1, description="beam size (default: the model's)")
        alpha: float | None = Field(
            None, ge=0, le=10, description="length penalty (default: the model's)"
        )
        nbest: int | None = Field(
            None, ge=1, description="translations per text: <= beam, or with sampling samples"
        )
        sampling: bool = Field(
            False, description="draw each output from the model instead of beam search"
        )
        temperature: float | None = Field(
            None, gt=0, le=100, description="sampling: divide the logits by this (default 1)"
        )
        top_k: int | None = Field(
            None, ge=0, description="sampling: among the k most probable tokens (default 0: all)"
        )
        top_p: float | None = Field(
            None, gt=0, le=1, description="sampling: nucleus, the head of mass p (default 1: all)"
        )
        seed: int | None = Field(
            None, ge=0, description="sampling: text i's samples are seeded by (seed, i)"
        )

    return TranslateRequest


async def _read_body(request: Any, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (never read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the body has {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"the body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body: bytes, schema: Any) -> Any:
    from pydantic import ValidationError

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the body is not JSON: {e}") from None
    except RecursionError:  # `[[[[...` 100,000 deep: Python's parser gives up, not the server
        raise HTTPError(400, "the body is JSON nested too deep") from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise HTTPError(422, f"{where}: {first['msg']}") from None


async def _wait_disconnect(request: Any) -> None:
    """Returns when the client goes away (the body has been read: only that message remains)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    backend: Backend,
    defaults: DecodeConfig,
    limits: ServerLimits | None = None,
    workers: int = 1,
    processes: bool = False,
) -> Any:
    """The FastAPI application: POST /translate, GET /health, GET /metrics, docs at /docs.

    defaults: the decoding options of a request that names none (the checkpoint's, as
    `aiayn translate` uses them), and the length limit max_len_a/b for all. workers,
    processes: see `Batcher`.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    limits = limits or ServerLimits()
    limits.validate()
    defaults.validate()
    metrics = Metrics()
    batcher = Batcher(backend, limits, workers, metrics, processes)
    schema = _request_model()
    input_limit = min(backend.input_limit, limits.max_input_tokens or backend.input_limit)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await batcher.start()
        kind = "process(es)" if processes else "thread(s)"
        logger.info("serving %s: %d decoding %s", backend.name, workers, kind)
        yield
        await batcher.stop()

    app = FastAPI(
        title="aiayn",
        summary="The Transformer of 'Attention Is All You Need': translation over HTTP",
        lifespan=lifespan,
    )
    app.state.batcher, app.state.metrics, app.state.limits = batcher, metrics, limits

    def error(e: HTTPError) -> Response:
        metrics.requests.labels(str(e.status)).inc()
        return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)

    def check(req: Any) -> tuple[list[str], Options]:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts:
            raise HTTPError(422, "text: the list is empty")
        if len(texts) > limits.max_texts:
            raise HTTPError(413, f"text: {len(texts)} texts; at most {limits.max_texts}")
        for i, t in enumerate(texts):
            if not t.strip():
                raise HTTPError(422, f"text[{i}]: empty or only whitespace")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's "\ud800": valid JSON, not a character
                raise HTTPError(
                    422, f"text[{i}]: a lone surrogate ({t[e.start]!r}) at {e.start} is not text"
                ) from None
        alpha = req.alpha if req.alpha is not None else defaults.alpha
        nbest = req.nbest if req.nbest is not None else 1
        if req.sampling:
            return texts, sampling_options(req, alpha, nbest)
        given = [f for f in SAMPLING_FIELDS if getattr(req, f) is not None]
        if given:
            raise HTTPError(422, f'{", ".join(given)}: for sampling; add "sampling": true')
        beam = req.beam if req.beam is not None else defaults.beam
        if beam > limits.max_beam:
            raise HTTPError(422, f"beam: {beam} is over this server's limit of {limits.max_beam}")
        if nbest > beam:
            raise HTTPError(422, f"nbest: {nbest} is over the beam size {beam}")
        return texts, Options(beam, float(alpha), nbest)

    def sampling_options(req: Any, alpha: float, n: int) -> Options:
        if req.beam is not None:
            raise HTTPError(422, "beam: sampling draws outputs; beam is for beam search")
        if n > limits.max_beam:  # the same work bound as a beam
            raise HTTPError(
                422, f"nbest: {n} samples is over this server's limit of {limits.max_beam}"
            )
        opts = SamplingOptions(
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed or 0,
        )
        return Options(1, float(alpha), n, opts)

    async def translate(request):  # type: ignore[no-untyped-def]  # annotated below
        """Each text's best translation (`text`, `score`: the length-normalised
        log-probability), and with nbest > 1 the list `nbest`; equal to `aiayn translate`'s
        output for the same sentence and options. With `sampling`: nbest samples a text
        (`text` is the first), text i of the request seeded by (seed, i)."""
        start = time.perf_counter()
        try:
            body = await _read_body(request, limits.max_body_bytes)
            texts, options = check(_parse(body, schema))
            tokens = 0
            for i, t in enumerate(texts):
                n = backend.count_tokens(t)
                if n > input_limit:
                    raise HTTPError(
                        413, f"text[{i}]: {n} subwords; this server takes at most {input_limit}"
                    )
                tokens += n + 1
            work = asyncio.ensure_future(batcher.submit(texts, tokens, options))
            gone = asyncio.ensure_future(_wait_disconnect(request))
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                metrics.disconnects.inc()
                with contextlib.suppress(asyncio.CancelledError, OverloadedError):
                    await work
                return Response(status_code=499)  # nobody reads it: the client left
            gone.cancel()
            results = work.result()
        except HTTPError as e:
            return error(e)
        except OverloadedError as e:
            return error(HTTPError(503, str(e), {"Retry-After": str(limits.retry_after_s)}))
        except Exception as e:  # a fault of the server's own: a JSON 500, counted and logged
            logger.exception("POST /translate failed")
            return error(HTTPError(500, f"internal error ({type(e).__name__}); see the log"))
        metrics.requests.labels("200").inc()
        metrics.latency.observe(time.perf_counter() - start)
        out = []
        for hyps in results:
            best = hyps[0] if hyps else Translation("", 0.0)
            item: dict[str, Any] = {"text": best.text, "score": best.score}
            if options.nbest > 1:  # samples: in the order drawn
                item["nbest"] = [{"text": h.text, "score": h.score} for h in hyps]
            out.append(item)
        answer: dict[str, Any] = {
            "translations": out,
            "beam": options.beam,
            "alpha": options.alpha,
            "model": backend.name,
        }
        if options.sampling is not None:  # what was drawn with: enough to draw it again
            answer["sampling"] = dataclasses.asdict(options.sampling)
            del answer["beam"]
        return JSONResponse(answer)

    # this module's annotations are strings (PEP 563) that FastAPI resolves in the module's
    # globals, where its own classes are not imported (it is an optional dependency)
    translate.__annotations__ = {"request": Request, "return": Response}
    app.post(
        "/translate",
        summary="Translate one text or a list of texts",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema.model_json_schema()}},
            }
        },
        responses={
            400: {"description": "the body is not UTF-8 JSON"},
            413: {"description": "a body, a list or a text over the server's limits"},
            422: {"description": "a field missing, of the wrong type, empty or out of range"},
            503: {"description": "the queue is full: retry after Retry-After seconds"},
        },
    )(translate)

    @app.get("/health", summary="Liveness and queue depth")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": backend.name, "queued_sentences": batcher.queued}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response, response_model=None)
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ------------------------------------------------------------------------- running
def serve(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    graceful_timeout_s: int = 30,
    log_level: str = "info",
) -> int:
    """Run `app` until SIGTERM or Ctrl-C; requests in flight finish first (up to
    `graceful_timeout_s`). Returns the exit code: 0 after SIGTERM (a clean stop that
    the service manager asked for), 130 after Ctrl-C."""
    import uvicorn

    class Server(uvicorn.Server):
        got: list[int] = []

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self.got.append(sig)
            self._captured_signals.clear()  # drained: exit with our code, do not re-raise

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_timeout_s,
        lifespan="on",
    )
    server = Server(config)
    try:
        server.run()
    except SystemExit:  # uvicorn's answer to a port it cannot bind (it logged why)
        return 4
    if not server.started:
        return 4
    return 130 if signal.SIGINT in server.got else 0
