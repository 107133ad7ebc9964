"""Streaming (aiayn.decoding.stream, `aiayn translate` reading stdin): a line written to a
pipe is translated, and its translation readable, before the pipe is closed."""

from __future__ import annotations

import io
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiayn.config import DecodeConfig
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.stream import translate_stream
from aiayn.decoding.translate import translate_nbest
from helpers import ROOT, random_checkpoint, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = DecodeConfig(beam=2, alpha=0.6, max_len_a=1.0, max_len_b=3)


class Words:
    """Fake tokenizer: "w<n>" <-> id n (4 <= n < 40); anything else is <unk> (1)."""

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) if w[1:].isdigit() else 1 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


class Lines(io.TextIOBase):
    """A text sink whose writes become lines on a queue, as a reader of stdout sees them."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.buffer = ""

    def write(self, s: str) -> int:
        self.buffer += s
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self.lines.put(line)
        return len(s)


def test_each_line_is_translated_before_the_pipe_closes() -> None:
    model = tiny_model()
    r, w = os.pipe()
    reader, writer = os.fdopen(r, "rb"), os.fdopen(w, "wb")
    sink = Lines()
    result: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: result.update(translate_stream(model, Words(), reader, sink, CFG)),
        daemon=True,
    )
    thread.start()
    expected, _ = translate_nbest(model, Words(), ["w5 w6 w7", "", "w9"], CFG)
    for line, outputs in zip(["w5 w6 w7", "", "w9"], expected, strict=True):
        writer.write(f"{line}\n".encode())
        writer.flush()
        got = sink.lines.get(timeout=30)  # the pipe is still open
        assert got == (outputs[0].text if outputs else "")
    writer.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["lines"] == 3 and result["empty"] == 1


def test_a_burst_is_batched_and_equals_the_file_translation(monkeypatch) -> None:
    """Lines that arrive together are decoded together; the outputs, n-best numbering and
    samples are the file path's (line numbers count from the stream's start)."""
    # one decoding step for every batch size: a float32 batch of more than 16 sentences
    # otherwise takes the per-layer step, whose scores differ in the last bits (decoder_step)
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "1")
    model = tiny_model()
    lines = [f"w{4 + i % 30} w{5 + i % 7}" for i in range(25)]
    opts = SamplingOptions(n=2, seed=3)
    sink = Lines()
    data = io.BytesIO("".join(f"{x}\n" for x in lines).encode())
    translate_stream(model, Words(), data, sink, CFG, sampling=opts, max_lines=10)
    got = [sink.lines.get_nowait() for _ in range(50)]
    expected, _ = translate_nbest(model, Words(), lines, CFG, sampling=opts)
    want = [f"{i} ||| {t.text} ||| {t.score:.6f}" for i, o in enumerate(expected) for t in o]
    assert got == want


def test_invalid_utf8_is_replaced_and_counted() -> None:
    sink = Lines()
    data = io.BytesIO(b"\xef\xbb\xbfw5\nw\xff6\n")
    summary = translate_stream(tiny_model(), Words(), data, sink, CFG)
    assert summary["bad_utf8"] == 1 and summary["lines"] == 2


def test_the_command_writes_a_translation_before_stdin_closes(tmp_path: Path) -> None:
    """`aiayn translate` without --input, in a pipe: the first translation is on stdout
    while stdin is still open (fairseq-interactive's behaviour)."""
    ckpt = random_checkpoint(tmp_path / "model.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "AIAYN_NO_MALLOC_TUNING": "1"}
    cmd = [sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt)]
    proc = subprocess.Popen(
        [*cmd, "--dtype", "fp32", "--no-progress"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        start = time.monotonic()
        proc.stdin.write(b"abc de fgh\n")
        proc.stdin.flush()
        first = proc.stdout.readline()  # blocks until the translation is written
        assert first.endswith(b"\n") and proc.poll() is None
        assert time.monotonic() - start < 120
        proc.stdin.write(b"ij\n")
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
        assert len(rest.splitlines()) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
