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

The parts, a module each: `engines` (the limits, a request's options, the engines),
`batcher` (the queue and the decoding workers), `metrics` (Prometheus), and here the HTTP
layer and `serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from aiayn.config import DecodeConfig
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.translate import Translation
from aiayn.deploy.batcher import Batcher, OverloadedError
from aiayn.deploy.engines import (
    ONE_BATCH,
    SAMPLING_FIELDS,
    AiaynBackend,
    Backend,
    CTranslate2Backend,
    Options,
    ServerLimits,
)
from aiayn.deploy.metrics import Metrics

logger = logging.getLogger(__name__)

__all__ = [
    "ONE_BATCH",
    "AiaynBackend",
    "Backend",
    "Batcher",
    "CTranslate2Backend",
    "Metrics",
    "OverloadedError",
    "Options",
    "ServerLimits",
    "create_app",
    "serve",
]


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
