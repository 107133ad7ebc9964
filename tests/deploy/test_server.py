"""`aiayn serve`: group G of RELIABILITY.md, against a real server on 127.0.0.1.

The model is the copy task's (tests/helpers.py), half trained, with a sentencepiece
vocabulary of one piece per letter: its outputs follow its inputs, so a response that went
to the wrong request, or a batch that changed an output, shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from aiayn.checkpoints import FORMAT, load_ensemble, save_checkpoint_file  # noqa: E402
from aiayn.config import Config, DecodeConfig  # noqa: E402
from aiayn.data.tokenizer import Tokenizer  # noqa: E402
from aiayn.decoding.translate import Translation, translate_nbest  # noqa: E402
from aiayn.deploy.server import (  # noqa: E402
    AiaynBackend,
    Batcher,
    Options,
    ServerLimits,
    create_app,
)
from aiayn.fast import native  # noqa: E402
from helpers import MODEL, ROOT, assert_one_line_error, cli, train_copy_model  # noqa: E402

LETTERS = "abcdefghi"


def _texts(n: int, seed: int) -> list[str]:
    """Mixed-length sentences of the copy model's letters: 1 to 12 subwords."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [
            "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(1, 4))
        ]
        out.append(" ".join(words))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    sentences = [
        " ".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4))) for _ in range(6))
        for _ in range(300)
    ]
    tok = Tokenizer.train_from_sentences(sentences, MODEL.vocab_size, None)
    assert tok.vocab_size == MODEL.vocab_size
    torch.manual_seed(0)
    model, _ = train_copy_model(torch.Generator().manual_seed(1), steps=150)
    path = tmp_path_factory.mktemp("serve") / "copy.pt"
    config = Config(model=MODEL, decode=DecodeConfig(beam=4, alpha=0.6, max_len_b=12))
    save_checkpoint_file(
        path,
        {
            "format": FORMAT,
            "config": config.to_dict(),
            "vocab_sha256": tok.sha256,
            "tokenizer": torch.frombuffer(bytearray(tok.to_bytes()), dtype=torch.uint8),
            "model": model.state_dict(),
            "step": 150,
        },
    )
    return path


@pytest.fixture(scope="module")
def backend(checkpoint: Path) -> AiaynBackend:
    models, tokenizer, cfg = load_ensemble([checkpoint])
    return AiaynBackend(models[0].eval(), tokenizer, cfg.decode, name="copy")


class Running:
    """A uvicorn server in a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def running(app: Any) -> Iterator[Running]:
    r = Running(app)
    try:
        yield r
    finally:
        r.stop()


def post(
    url: str, body: bytes | dict[str, Any], timeout: float = 60
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers) of a POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


def expected(backend: AiaynBackend, texts: list[str], beam: int, alpha: float = 0.6) -> list[str]:
    """What `aiayn translate` writes for these lines (its library function, one batch)."""
    cfg = replace(backend.decode, beam=beam, alpha=alpha)
    results, _ = translate_nbest(backend.model, backend.tokenizer, texts, cfg)
    return [r[0].text for r in results]


# ------------------------------------------------------------------------- G1
def _load(url: str, clients: int, per_client: int, texts: list[str]) -> list[tuple[Any, ...]]:
    """`clients` threads, each posting `per_client` requests: one text or a few, beam 1 or 4."""

    def client(c: int) -> list[tuple[Any, ...]]:
        rng = random.Random(c)
        out = []
        for _ in range(per_client):
            chosen = rng.sample(texts, rng.choice([1, 1, 2, 3]))
            beam = rng.choice([1, 4])
            body: dict[str, Any] = {"text": chosen if len(chosen) > 1 else chosen[0]}
            if beam != 4:
                body["beam"] = beam
            status, answer, _ = post(f"{url}/translate", body)
            out.append((chosen, beam, status, answer))
        return out

    with ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(client, range(clients)) for r in rs]


def _check_load(backend: AiaynBackend, results: list[tuple[Any, ...]], texts: list[str]) -> None:
    want = {beam: dict(zip(texts, expected(backend, texts, beam), strict=True)) for beam in (1, 4)}
    assert len(set(want[4].values())) > len(texts) // 2  # outputs follow inputs
    for chosen, beam, status, answer in results:
        assert status == 200, answer
        assert [t["text"] for t in answer["translations"]] == [want[beam][c] for c in chosen]


@pytest.mark.rows("G1")
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_concurrent_clients_get_the_cli_output_of_their_own_sentences(
    backend: AiaynBackend, checkpoint: Path, tmp_path: Path, processes: bool
) -> None:
    texts = _texts(60, seed=1)
    limits = ServerLimits(batch_wait_ms=20)
    app = create_app(backend, backend.decode, limits, workers=2, processes=processes)
    with running(app) as server:
        results = _load(server.url, clients=10, per_client=5, texts=texts)
        _, metrics = get(f"{server.url}/metrics")
    _check_load(backend, results, texts)
    batches = [
        line for line in metrics.decode().splitlines() if line.startswith("aiayn_batch_sentences")
    ]
    count = next(
        float(x.split()[-1]) for x in batches if x.startswith("aiayn_batch_sentences_count")
    )
    total = next(float(x.split()[-1]) for x in batches if x.startswith("aiayn_batch_sentences_sum"))
    assert total == sum(len(r[0]) for r in results)
    assert count < len(results), "requests that arrive together are decoded together"

    # the CLI itself, on a file of the same sentences, agrees with the expectation above
    src = tmp_path / "src.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    code, out, err = cli(
        "translate", "--checkpoint", checkpoint, "--input", src, "--no-progress", "--dtype", "fp32"
    )  # float32, as the backend above (the default, auto, may quantize)
    assert code == 0, err
    assert out.splitlines() == expected(backend, texts, 4)


@pytest.mark.slow
@pytest.mark.rows("G1")
def test_fifty_clients_twenty_requests_each(backend: AiaynBackend) -> None:
    texts = _texts(200, seed=2)
    app = create_app(backend, backend.decode, ServerLimits(), workers=2, processes=True)
    with running(app) as server:
        results = _load(server.url, clients=50, per_client=20, texts=texts)
    assert len(results) == 1000
    _check_load(backend, results, texts)


def test_forked_decoding_processes_share_the_plan_made_before(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --workers K` lays out the one-call step's weights before forking its
    processes (`decoding.workers.prepare_shared`): one copy for all, not one each."""
    from aiayn.decoding import workers
    from aiayn.deploy import batcher

    models, tokenizer, cfg = load_ensemble([checkpoint])
    fresh = AiaynBackend(models[0].eval(), tokenizer, cfg.decode, name="fresh")
    assert "_decoder_plan" not in fresh.model.__dict__
    monkeypatch.setattr(workers, "freeze_for_workers", lambda: None)  # not for good, here
    pool = batcher._fork_workers(fresh, 1)
    pool.shutdown()
    key_and_plan = fresh.model.__dict__.get("_decoder_plan")
    assert key_and_plan is not None and (key_and_plan[1] is not None) == (
        native.library() is not None
    )


def test_options_nbest_and_scores_equal_the_library(backend: AiaynBackend) -> None:
    texts = _texts(5, seed=3)
    with running(create_app(backend, backend.decode)) as server:
        status, answer, _ = post(
            f"{server.url}/translate", {"text": texts, "beam": 3, "alpha": 1.0, "nbest": 2}
        )
    assert status == 200 and answer["beam"] == 3 and answer["alpha"] == 1.0
    cfg = replace(backend.decode, beam=3, alpha=1.0, nbest=2)
    want, _ = translate_nbest(backend.model, backend.tokenizer, texts, cfg)
    for item, hyps in zip(answer["translations"], want, strict=True):
        assert item["text"] == hyps[0].text
        assert [(h["text"], h["score"]) for h in item["nbest"]] == [
            (h.text, pytest.approx(h.score, abs=1e-6)) for h in hyps
        ]


# ------------------------------------------------------------------------- G2, G4
class Gate:
    """A backend that decodes only when let through: requests pile up deterministically."""

    def __init__(self, inner: AiaynBackend) -> None:
        self.inner, self.name, self.input_limit = inner, "gated", inner.input_limit
        self.open = threading.Event()
        self.started = 0  # batches begun
        self.sentences = 0

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def translate(self, texts: list[str], options: Options) -> list[list[Translation]]:
        self.started += 1
        self.sentences += len(texts)
        self.open.wait(60)
        return self.inner.translate(texts, options)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.mark.rows("G2")
def test_overload_is_answered_at_once_with_503_and_retry_after(backend: AiaynBackend) -> None:
    gate = Gate(backend)
    limits = ServerLimits(max_queue=8, batch_wait_ms=0, retry_after_s=2)
    app = create_app(gate, backend.decode, limits)
    with running(app) as server, ThreadPoolExecutor(8) as pool:
        held = [pool.submit(post, f"{server.url}/translate", {"text": "ab"}) for _ in range(8)]
        deadline = time.monotonic() + 30
        while app.state.batcher.queued < 8:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rss = _rss_mib()
        times = []
        for _ in range(300):
            start = time.perf_counter()
            status, answer, headers = post(f"{server.url}/translate", {"text": "abc"})
            times.append(time.perf_counter() - start)
            assert status == 503 and "queued" in answer["error"]
            assert headers["retry-after"] == "2"
        assert app.state.batcher.queued == 8  # refused work never entered the queue
        assert _rss_mib() - rss < 50
        gate.open.set()
        assert all(f.result()[0] == 200 for f in held)
        times.sort()
        assert times[len(times) // 2] < 0.1, times[len(times) // 2]  # p50 of a refusal
        assert get(f"{server.url}/health")[0] == 200


def _disconnect(port: int, body: bytes) -> None:
    """Send a whole request, then go away without reading the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )


def _disconnects(backend: AiaynBackend, n: int) -> tuple[Any, Gate]:
    gate = Gate(backend)
    app = create_app(gate, backend.decode, ServerLimits(max_queue=4 * n, batch_wait_ms=0))
    with running(app) as server:
        # one request holds the decoder; the n that follow wait behind it, then leave
        first = threading.Thread(target=post, args=(f"{server.url}/translate", {"text": "ab"}))
        first.start()
        while gate.started < 1:
            time.sleep(0.01)
        for i in range(n):
            _disconnect(server.port, json.dumps({"text": _texts(1, seed=i)[0]}).encode())
        # every handler notices its client left (and cancels its job) while the gate is shut
        deadline = time.monotonic() + 60
        while _metric(server.url, "aiayn_client_disconnects_total") < n:
            assert time.monotonic() < deadline, "disconnects not noticed"
            time.sleep(0.02)
        # their work left the queue at once, while the decoder was still held
        assert (app.state.batcher.dropped, app.state.batcher.queued) == (n, 1)
        gate.open.set()
        first.join(60)
        assert _metric(server.url, "aiayn_client_disconnects_total") == n
        assert get(f"{server.url}/health")[0] == 200
        time.sleep(0.2)
        assert app.state.batcher.queued == 0
    return app, gate


def _metric(url: str, name: str) -> float:
    _, text = get(f"{url}/metrics")
    return float(next(x for x in text.decode().splitlines() if x.startswith(name + " ")).split()[1])


@pytest.mark.rows("G4")
def test_clients_that_leave_have_their_work_dropped(backend: AiaynBackend) -> None:
    app, gate = _disconnects(backend, 40)
    # the 40 left while the first request held the decoder: none of them was decoded
    assert app.state.batcher.dropped == 40
    assert gate.sentences == 1


@pytest.mark.slow
@pytest.mark.rows("G4")
def test_a_thousand_disconnects_free_their_memory(backend: AiaynBackend) -> None:
    _disconnects(backend, 50)  # warm up the allocator and the server's code paths
    rss = _rss_mib()
    app, gate = _disconnects(backend, 1000)
    assert app.state.batcher.dropped == 1000 and gate.sentences == 1
    assert _rss_mib() < rss * 1.05, (rss, _rss_mib())


# ------------------------------------------------------------------------- G3
MALFORMED: list[tuple[str, bytes, int, str]] = [
    ("invalid JSON", b'{"text": "ab"', 400, "not JSON"),
    ("missing field", b'{"beam": 2}', 422, "text"),
    ("non-string text", b'{"text": 5}', 422, "text"),
    ("non-string in a list", b'{"text": ["ab", 7]}', 422, "text"),
    ("string beam", b'{"text": "ab", "beam": "4"}', 422, "beam"),
    ("empty text", b'{"text": ""}', 422, "empty"),
    ("whitespace text", b'{"text": " \\t\\n "}', 422, "empty"),
    ("empty list", b'{"text": []}', 422, "empty"),
    ("unknown field", b'{"text": "ab", "beams": 2}', 422, "beams"),
    ("beam 0", b'{"text": "ab", "beam": 0}', 422, "beam"),
    ("beam over the limit", b'{"text": "ab", "beam": 99}', 422, "limit"),
    ("nbest over beam", b'{"text": "ab", "beam": 2, "nbest": 3}', 422, "nbest"),
    ("non-UTF-8", b'{"text": "a\xff\xfeb"}', 400, "UTF-8"),
    ("a JSON list", b'["ab"]', 422, "body"),
    ("10,000-token text", json.dumps({"text": "a " * 10_000}).encode(), 413, "subwords"),
    ("too many texts", json.dumps({"text": ["ab"] * 65}).encode(), 413, "texts"),
]


def _raw(port: int, head: bytes, pieces: Iterator[bytes]) -> tuple[int, dict[str, Any]]:
    """Send a request's head, then body pieces until the server answers or stops reading;
    return the status and JSON body of its answer. The way a client sees a server refuse a
    body it is still sending."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        s.setblocking(False)
        answer = b""
        for piece in pieces:
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(65536)
            if answer:
                break
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
                s.send(piece)
        s.setblocking(True)
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                more = s.recv(65536)
                if not more:
                    break
                answer += more
    head_text, _, body = answer.partition(b"\r\n\r\n")
    if b"chunked" in head_text.lower():
        body = body.split(b"\r\n")[1]
    return int(head_text.split()[1]), json.loads(body)


@pytest.mark.rows("G3")
def test_a_ten_megabyte_body_is_refused_without_being_read(backend: AiaynBackend) -> None:
    """Declared (Content-Length) or streamed (chunked), the body is cut off at the limit."""
    mb = b"a" * (1 << 20)
    with running(create_app(backend, backend.decode)) as server:
        head = (
            b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10485760\r\n\r\n"
        )
        status, answer = _raw(server.port, head, iter([mb] * 10))
        assert (status, "10485760 bytes" in answer["error"]) == (413, True), answer
        head = (
            b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = f"{len(mb):x}\r\n".encode() + mb + b"\r\n"
        status, answer = _raw(server.port, head, iter([chunk] * 10))
        assert (status, "over 1048576 bytes" in answer["error"]) == (413, True), answer
        assert get(f"{server.url}/health")[0] == 200


@pytest.mark.rows("G3")
def test_malformed_requests_get_a_json_4xx_and_the_server_stays_healthy(
    backend: AiaynBackend,
) -> None:
    with running(create_app(backend, backend.decode)) as server:
        for what, body, code, fragment in MALFORMED:
            status, answer, _ = post(f"{server.url}/translate", body)
            assert (status, fragment in answer.get("error", "")) == (code, True), (what, answer)
        assert get(f"{server.url}/health")[0] == 200
        status, answer, _ = post(f"{server.url}/translate", {"text": "ab"})
        assert status == 200 and answer["translations"][0]["text"]
        _, text = get(f"{server.url}/metrics")
    assert f'aiayn_requests_total{{code="422"}} {sum(c == 422 for *_, c, _ in MALFORMED)}' in (
        text.decode()
    )


def test_health_metrics_and_openapi(backend: AiaynBackend) -> None:
    with running(create_app(backend, backend.decode)) as server:
        post(f"{server.url}/translate", {"text": ["ab c", "dd"]})
        status, health = get(f"{server.url}/health")
        assert status == 200 and json.loads(health) == {
            "status": "ok",
            "model": "copy",
            "queued_sentences": 0,
        }
        _, metrics = get(f"{server.url}/metrics")
        text = metrics.decode()
        for name in (
            'aiayn_requests_total{code="200"} 1.0',
            "aiayn_request_seconds_bucket",
            "aiayn_batch_sentences_sum 2.0",
            "aiayn_queue_sentences 0.0",
            "aiayn_sentences_total 2.0",
            "aiayn_output_tokens_per_second",
        ):
            assert name in text, name
        _, spec = get(f"{server.url}/openapi.json")
        schema = json.loads(spec)["paths"]["/translate"]["post"]["requestBody"]["content"]
        assert "text" in schema["application/json"]["schema"]["properties"]
        assert get(f"{server.url}/docs")[0] == 200


# ------------------------------------------------------------------------- G5, G6, the CLI
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(checkpoint: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.Popen(
        [sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(checkpoint)]
        + ["--port", str(port), "--log-level", "warning", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()
        with contextlib.suppress(OSError):
            if get(f"{url}/health")[0] == 200:
                return
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


@pytest.mark.rows("G5")
def test_sigterm_finishes_requests_in_flight_and_exits_0(
    checkpoint: Path, backend: AiaynBackend
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(checkpoint, port, "--max-beam", "64", "--workers", "2", "--dtype", "fp32")
    try:
        _wait_healthy(url, proc)
        texts = _texts(64, seed=5)  # beam 64 on 64 sentences: some seconds of work
        answer: list[Any] = []
        client = threading.Thread(
            target=lambda: answer.append(post(f"{url}/translate", {"text": texts, "beam": 64}))
        )
        client.start()
        deadline = time.monotonic() + 30
        while json.loads(get(f"{url}/health")[1])["queued_sentences"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert proc.wait(60) == 0, proc.communicate()
    finally:
        proc.kill()
    status, body, _ = answer[0]
    assert status == 200
    assert [t["text"] for t in body["translations"]] == expected(backend, texts, 64)
    with pytest.raises(OSError):
        get(f"{url}/health")  # no longer listening


@pytest.mark.rows("G6")
def test_a_corrupt_checkpoint_refuses_to_start(checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    port = _free_port()
    proc = _serve(bad, port)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert_one_line_error(err, "bad.pt")
    with pytest.raises(OSError):
        get(f"http://127.0.0.1:{port}/health")


def test_serve_refuses_bad_flags_before_loading(tmp_path: Path) -> None:
    for bad in ("0", "many"):  # argparse's error: usage, then the one line naming the flag
        with pytest.raises(SystemExit) as e:
            cli("serve", "--checkpoint", tmp_path / "none.pt", "--workers", bad)
        assert e.value.code == 2
    code, _, err = cli("serve", "--checkpoint", tmp_path / "none.pt", "--max-queue", "0")
    assert code == 2
    assert_one_line_error(err, "max_queue")
    code, _, err = cli("serve", "--checkpoint", tmp_path / "none.pt")
    assert code == 1
    assert_one_line_error(err, "none.pt")


def test_ctranslate2_behind_the_same_http_layer_gives_aiayn_greedy_outputs(
    checkpoint: Path, backend: AiaynBackend, tmp_path: Path
) -> None:
    """The load benchmark's other engine: the exported model, served by the same app."""
    pytest.importorskip("ctranslate2")
    from aiayn.deploy.export import export_ctranslate2
    from aiayn.deploy.server import CTranslate2Backend

    ct2 = CTranslate2Backend(export_ctranslate2(checkpoint, tmp_path / "ct2"))
    assert ct2.decode == backend.decode
    texts = _texts(30, seed=7)
    with running(create_app(ct2, ct2.decode)) as server:
        status, answer, _ = post(f"{server.url}/translate", {"text": texts, "beam": 1})
    assert status == 200 and answer["model"] == "ctranslate2-float32"
    assert [t["text"] for t in answer["translations"]] == expected(backend, texts, 1)


def test_a_batch_the_batcher_made_is_one_decoding_batch(
    backend: AiaynBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lengths from 1 to 12 subwords padded to the longest exceed decode.max_tokens' budget
    by far; the backend still decodes them as one batch (the batcher sized it)."""
    import aiayn.decoding.translate as translate

    made: list[int] = []
    real = translate.decode_batches

    def counting(lengths: Any, max_tokens: int) -> list[list[int]]:
        batches = real(lengths, max_tokens)
        made.append(len(batches))
        return batches

    monkeypatch.setattr(translate, "decode_batches", counting)
    texts = _texts(60, seed=9)
    narrow = replace(backend.decode, max_tokens=20)
    small = AiaynBackend(backend.model, backend.tokenizer, narrow, name="narrow")
    results = small.translate(texts, Options(1, 0.6, 1))
    assert made == [1]
    assert [r[0].text for r in results] == expected(backend, texts, 1)


class HeldBackend:
    """Records each batch it decodes; the first waits until `release` is set."""

    name = "held"
    input_limit = 100

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def translate(self, texts: list[str], options: Options) -> list[list[Translation]]:
        self.batches.append(list(texts))
        if len(self.batches) == 1:
            self.release.wait(30)
        return [[Translation(t.upper(), 0.0)] for t in texts]


def test_an_idle_server_decodes_at_once_and_a_busy_one_batches() -> None:
    """Issue 72: no batching wait when nothing is decoding (latency at low load); while a
    batch decodes, a new request waits `batch_wait_ms` for company (throughput)."""
    backend, options = HeldBackend(), Options(beam=1, alpha=0.6, nbest=1)

    async def scenario() -> list[Any]:
        batcher = Batcher(backend, ServerLimits(batch_wait_ms=500), workers=2)
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit(["a"], 1, options))
            while not backend.batches:  # the idle server started it without waiting
                await asyncio.sleep(0.001)
            assert batcher.waits == 0
            second = asyncio.create_task(batcher.submit(["b"], 1, options))
            await asyncio.sleep(0.05)  # well inside the 500 ms window
            third = asyncio.create_task(batcher.submit(["c"], 1, options))
            rest = await asyncio.gather(second, third)
            backend.release.set()
            return [await first, *rest, batcher.waits]
        finally:
            backend.release.set()
            await batcher.stop()

    first, second, third, waits = asyncio.run(scenario())
    assert backend.batches == [["a"], ["b", "c"]]  # b waited for c while a was decoding
    assert waits == 1
    assert [first[0][0].text, second[0][0].text, third[0][0].text] == ["A", "B", "C"]


def test_a_worker_takes_no_more_than_its_share_of_the_sentences() -> None:
    """Under a closed loop of clients the workers stay equally busy: a batch holds at most
    the sentences in the server (waiting or decoding) divided by the workers, so requests
    arriving together are split between the free workers, not all taken by one."""
    backend, options = HeldBackend(), Options(beam=1, alpha=0.6, nbest=1)
    texts = list("bcdefg")

    async def scenario() -> list[Any]:
        batcher = Batcher(backend, ServerLimits(batch_wait_ms=20), workers=2)
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit(["a"], 1, options))
            while not backend.batches:
                await asyncio.sleep(0.001)
            rest = [asyncio.create_task(batcher.submit([t], 1, options)) for t in texts]
            while len(backend.batches) < 2:  # the free worker's batch (after its wait)
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            backend.release.set()
            return [await first, *await asyncio.gather(*rest)]
        finally:
            backend.release.set()
            await batcher.stop()

    results = asyncio.run(scenario())
    # 7 sentences in the server (a decoding, 6 waiting), 2 workers: batches of at most 4
    assert backend.batches[0] == ["a"] and backend.batches[1] == ["b", "c", "d", "e"]
    assert sorted(t for b in backend.batches[2:] for t in b) == ["f", "g"]
    assert [r[0][0].text for r in results] == ["A", *"BCDEFG"]


# ------------------------------------------------------------------------- sampling
def test_sampling_options_draw_what_translate_sampling_draws(backend: AiaynBackend) -> None:
    """A request with "sampling": its nbest samples a text equal the library's for the same
    seed, with text i seeded by (seed, i) whatever else shares its batch; sampling
    options without "sampling", or a beam with it, are refused by name."""
    from aiayn.decoding.sampling import SamplingOptions

    texts = _texts(4, seed=5)
    body = {"text": texts, "sampling": True, "nbest": 3, "top_k": 5, "seed": 11}
    with running(create_app(backend, backend.decode)) as server:
        status, answer, _ = post(f"{server.url}/translate", body)
        again = post(f"{server.url}/translate", body)[1]
        alone = post(f"{server.url}/translate", {**body, "text": texts[0]})[1]
        refused = post(f"{server.url}/translate", {"text": texts, "top_p": 0.5})
        with_beam = post(f"{server.url}/translate", {**body, "beam": 2})
    assert status == 200, answer
    assert answer["sampling"] == {"n": 3, "temperature": 1.0, "top_k": 5, "top_p": 1.0, "seed": 11}
    opts = SamplingOptions(n=3, top_k=5, seed=11)
    want, _ = translate_nbest(
        backend.model, backend.tokenizer, texts, backend.decode, sampling=opts
    )
    for item, hyps in zip(answer["translations"], want, strict=True):
        assert [h["text"] for h in item["nbest"]] == [h.text for h in hyps]
        assert item["text"] == hyps[0].text
    assert again["translations"] == answer["translations"]
    # alone or batched: the same samples (scores up to float rounding across batch shapes)
    first, first_alone = answer["translations"][0]["nbest"], alone["translations"][0]["nbest"]
    assert [h["text"] for h in first_alone] == [h["text"] for h in first]
    assert [h["score"] for h in first_alone] == pytest.approx([h["score"] for h in first])
    assert refused[0] == 422 and "top_p" in refused[1]["error"]
    assert with_beam[0] == 422 and "beam" in with_beam[1]["error"]


# ------------------------------------------------------------------------- G7
class _Broken:
    """A backend whose decoding fails: a fault of the server's own."""

    def __init__(self, inner: AiaynBackend) -> None:
        self.inner, self.name, self.input_limit = inner, "broken", inner.input_limit

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def translate(self, texts: list[str], options: Options) -> list[list[Translation]]:
        raise RuntimeError("decoder fault")


def _count(metrics: str, code: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'aiayn_requests_total{{code="{code}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.rows("G7")
def test_hostile_json_gets_a_json_4xx_counted_and_a_fault_a_json_500(
    backend: AiaynBackend,
) -> None:
    """A lone surrogate is valid JSON and no text; a body nested 100,000 deep is valid JSON
    that Python's parser cannot hold: both were a plain-text 500, uncounted. Now a JSON 4xx,
    counted in /metrics; a real fault (the decoder raising) is a JSON 500, counted too."""
    with running(create_app(backend, backend.decode)) as server:
        url = server.url + "/translate"
        status, body, _ = post(url, b'{"text": "\\ud800 abc"}')
        assert status == 422 and "surrogate" in body["error"]
        status, body, _ = post(url, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "nested" in body["error"]
        status, body, _ = post(url, {"text": "abc"})  # negative control, and still healthy
        assert status == 200 and body["translations"][0]["text"]
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert _count(metrics, "422") >= 1 and _count(metrics, "400") >= 1
    with running(create_app(_Broken(backend), backend.decode)) as server:  # type: ignore[arg-type]
        status, body, _ = post(server.url + "/translate", {"text": "abc"})
        assert status == 500 and "RuntimeError" in body["error"]
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert _count(metrics, "500") == 1


class PidBackend:
    """A backend whose every output is the id of the process that decoded it."""

    name = "pids"
    input_limit = 100

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def translate(
        self, texts: list[str], options: Options, line_numbers: list[int] | None = None
    ) -> list[list[Translation]]:
        time.sleep(0.05)  # long enough for the requests sent together to meet here
        return [[Translation(str(os.getpid()), 0.0)] for _ in texts]


def test_with_processes_a_lone_request_is_decoded_in_the_servers_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 72, latency at low load: with decoding processes, a lone request on an idle
    server is decoded in the server's own process (no pipe to a worker and back), on one
    thread as in the workers; requests that come together still go to the workers."""
    from aiayn.decoding import workers

    monkeypatch.setattr(workers, "freeze_for_workers", lambda: None)  # not for good, here
    options, threads = Options(beam=1, alpha=0.6, nbest=1), torch.get_num_threads()

    async def scenario() -> tuple[Any, Any, int]:
        batcher = Batcher(PidBackend(), ServerLimits(batch_wait_ms=0), workers=2, processes=True)
        await batcher.start()
        try:
            lone = await batcher.submit(["a"], 1, options)
            inside = torch.get_num_threads()
            together = await asyncio.gather(*(batcher.submit([t], 1, options) for t in "bcdefgh"))
            return lone, together, inside
        finally:
            await batcher.stop()

    lone, together, inside = asyncio.run(scenario())
    here = str(os.getpid())
    assert lone[0][0].text == here and inside == 1
    assert any(r[0][0].text != here for r in together)  # a worker's
    assert torch.get_num_threads() == threads  # given back at stop
