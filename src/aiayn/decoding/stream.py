"""Translating a stream as it arrives (`aiayn translate` reading stdin), as
`fairseq-interactive` and `marian-decoder` do: in a pipe or at a terminal, each line's
translation is written, and flushed, as soon as it is decoded, not at end of input.

A reader thread takes lines off the input as they come. The decoder waits for the first
line, then keeps collecting for a short window (`window_s`, default 20 ms) or until
`max_lines`, and decodes what it has as one call of `translate_nbest` (which batches it
by `decode.max_tokens`): one line typed at a terminal is translated alone and at once, a
file piped in is decoded in large batches. Outputs keep input order; line numbers in
warnings and n-best output count from the start of the stream; sampling seeds by those
numbers, so a streamed file samples exactly as the same file given with --input.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

import torch

from aiayn.config import DecodeConfig
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.translate import (
    MAX_LINE_WARNINGS,
    Decoder,
    SubwordTokenizer,
    TranslateStats,
    format_output,
    summarize,
    translate_nbest,
)
from aiayn.files import atomic_write

logger = logging.getLogger(__name__)

#: How long the decoder keeps collecting lines after the first one of a batch.
WINDOW_S = 0.02
#: Most lines decoded as one call.
MAX_LINES = 2000

_EOF = object()


def _reader(stream: IO[bytes], lines: queue.Queue[Any]) -> None:
    """Put each raw line of `stream` on `lines` as it arrives, then _EOF (or the error)."""
    try:
        for raw in iter(stream.readline, b""):
            lines.put(raw)
        lines.put(_EOF)
    except BaseException as e:  # handed to the decoding thread, which raises it
        lines.put(e)


class _Decoder:
    """Raw lines -> text with the rules of `translate.decode_lines` (split on b"\\n",
    a leading byte-order mark dropped, invalid UTF-8 replaced and counted, F9)."""

    def __init__(self, name: str) -> None:
        self.name, self.count, self.bad = name, 0, 0

    def __call__(self, raw: bytes) -> str:
        self.count += 1
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        if self.count == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.bad += 1
            if self.bad <= MAX_LINE_WARNINGS:
                logger.warning(
                    "%s:%d: invalid UTF-8 at byte %d, replaced by U+FFFD",
                    self.name,
                    self.count,
                    e.start,
                )
            return raw.decode("utf-8", errors="replace")


def _next_batch(
    lines: queue.Queue[Any], window_s: float, max_lines: int
) -> tuple[list[bytes], bool]:
    """Block for one line, then take what arrives within `window_s` (at most `max_lines`).
    Returns the raw lines and whether the input has ended."""
    batch: list[bytes] = []
    deadline = None
    while len(batch) < max_lines:
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            break
        try:
            item = lines.get(timeout=timeout)
        except queue.Empty:
            break
        if item is _EOF:
            return batch, True
        if isinstance(item, BaseException):
            raise item
        batch.append(item)
        if deadline is None:
            deadline = time.monotonic() + window_s
    return batch, False


def translate_stream(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    stream: IO[bytes],
    out: IO[str] | str | Path,
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    sampling: SamplingOptions | None = None,
    *,
    name: str = "<stdin>",
    window_s: float = WINDOW_S,
    max_lines: int = MAX_LINES,
) -> dict[str, Any]:
    """Translate lines from `stream` as they arrive; write each batch's outputs to `out`
    (a text stream, flushed after each batch; or a path, written atomically at the end,
    F13) in `translate_file`'s format.

    Returns:
        `translate_file`'s summary.
    """
    cfg.validate()
    if sampling is not None:
        sampling.validate()
    start = time.perf_counter()
    total = TranslateStats()
    decode = _Decoder(name)
    lines: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_reader, args=(stream, lines), daemon=True).start()
    n = cfg.nbest if sampling is None else sampling.n
    with contextlib.ExitStack() as stack:
        sink: IO[str] = (
            stack.enter_context(atomic_write(out, "w")) if isinstance(out, (str, Path)) else out
        )
        done = False
        while not done:
            raw, done = _next_batch(lines, window_s, max_lines)
            if not raw:
                continue
            first = decode.count
            text = [decode(r) for r in raw]
            numbers = range(first, first + len(text))
            nbest, stats = translate_nbest(
                model, tokenizer, text, cfg, device, progress, workers, sampling, numbers
            )
            for f in fields(TranslateStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
            sink.write("".join(format_output(first + i, o, n) for i, o in enumerate(nbest)))
            sink.flush()
    if not decode.count:
        logger.warning("%s: empty input, writing no output lines", name)
    return summarize(total, decode.bad, time.perf_counter() - start)
