"""Translate text: subword-encode, batch by source tokens, beam search, restore order (6.1).

Promises (RELIABILITY.md, group F):

- F1: no input lines give no output lines (and `translate_file` logs a warning).
- F2: an empty or whitespace-only line gives an empty output line and is not fed to the
  model.
- F3: one output per input line, in input order, although batches are sorted by length.
- F4: an input longer than `max_input_len` subwords (or than the model's position table)
  is truncated, with a warning naming its line number.
- F6/F7: outputs do not depend on batch size or on the run (search is batch-invariant).
- F8: characters the vocabulary never saw (emoji, other scripts) become <unk> (id 1) in
  the source, as sentencepiece encodes them (its NFKC normalisation drops control
  characters before that); the model translates the rest of the line; <unk> tokens and
  the lines holding them are counted in the summary. The output never contains "<unk>"
  text: decoding renders it as " ⁇ ".
- F9: invalid UTF-8 is replaced by U+FFFD, counted and reported as a partial result.
- F13: the output file is written atomically (temporary file, fsync, rename).

The source fed to the model is the line's subword ids followed by EOS.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from aiayn.config import EOS_ID, PAD_ID, UNK_ID, DecodeConfig
from aiayn.data.batching import decode_batches
from aiayn.decoding.constraints import Constraint, ForcedPrefix
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.sampling import SamplingOptions, sample
from aiayn.decoding.search import Hypothesis, beam_search, position_limit
from aiayn.decoding.workers import check_workers, map_batches, prepare_shared
from aiayn.files import InputError, atomic_write, read_bytes
from aiayn.model import Transformer

logger = logging.getLogger(__name__)

#: Individual warnings for truncated lines; later ones are only counted.
MAX_LINE_WARNINGS = 10

#: What translates: one model, or several as an ensemble (`aiayn.decoding.ensemble`).
Decoder = Transformer | Ensemble


class SubwordTokenizer(Protocol):
    """Text <-> subword ids (aiayn.data.tokenizer.Tokenizer); `decode` removes the subword marks."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Translation:
    """One output of one input line: detokenised text and its length-normalised score."""

    text: str
    score: float
    tokens: tuple[int, ...] = ()  # the subword ids, no BOS/EOS (what `text` decodes)


@dataclass
class TranslateStats:
    """Counts for the exit summary."""

    lines: int = 0
    empty: int = 0
    truncated: int = 0
    unk_tokens: int = 0  # source subwords that are <unk> (F8)
    unk_lines: int = 0


# ------------------------------------------------------------------------- preparing
def encode_sources(
    tokenizer: SubwordTokenizer,
    lines: Sequence[str],
    max_input_len: int,
    stats: TranslateStats,
    first_lineno: int = 1,
) -> list[list[int] | None]:
    """Subword ids + [EOS] per line; None for a blank line (it is not translated).

    Lines longer than `max_input_len` subwords are cut to that length, with a warning
    naming the (1-based) line number, `first_lineno` for the first of `lines`.
    """
    sources: list[list[int] | None] = []
    for lineno, line in enumerate(lines, start=first_lineno):
        if not line.strip():
            stats.empty += 1
            sources.append(None)
            continue
        ids = tokenizer.encode(line)
        unk = sum(1 for i in ids if i == UNK_ID)
        stats.unk_tokens += unk
        stats.unk_lines += unk > 0
        if len(ids) > max_input_len:
            stats.truncated += 1
            if stats.truncated <= MAX_LINE_WARNINGS:
                logger.warning(
                    "line %d: %d subwords, truncated to max_input_len=%d",
                    lineno,
                    len(ids),
                    max_input_len,
                )
            ids = ids[:max_input_len]
        sources.append([*ids, EOS_ID])
    if stats.truncated > MAX_LINE_WARNINGS:
        logger.warning(
            "%d lines truncated to max_input_len=%d in all", stats.truncated, max_input_len
        )
    return sources


def pad_batch(sequences: Sequence[list[int]], device: str | torch.device) -> Tensor:
    """Right-pad id lists with PAD into (B, S)."""
    longest = max(len(s) for s in sequences)
    src = torch.full((len(sequences), longest), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(sequences):
        src[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return src.to(device)


# ------------------------------------------------------------------------- translating
def _input_limit(model: Decoder, cfg: DecodeConfig) -> int:
    """Longest source in subwords: max_input_len, and room for EOS in the position table."""
    limit = position_limit(model)
    return cfg.max_input_len if limit is None else min(cfg.max_input_len, limit - 1)


def _to_translations(tokenizer: SubwordTokenizer, hyps: list[Hypothesis]) -> list[Translation]:
    # one output line per input line: a newline inside a decoded string would break that
    return [
        Translation(
            tokenizer.decode(h.tokens).replace("\n", " ").replace("\r", " "),
            h.score,
            tuple(h.tokens),
        )
        for h in hyps
    ]


def translate_nbest(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    lines: Sequence[str],
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    sampling: SamplingOptions | None = None,
    line_numbers: Sequence[int] | None = None,
    constraint_for: Callable[[list[int]], Constraint] | None = None,
) -> tuple[list[list[Translation]], TranslateStats]:
    """Translate lines with beam search; each line gets its `cfg.nbest` best outputs
    (with `sampling`: its `sampling.n` samples, in the order drawn).

    Args:
        model: a `Transformer` on `device`, or an `Ensemble` of them; put in eval mode.
        lines: input sentences; blank ones give [] and are not fed to the model.
        cfg: beam, alpha, length cap, nbest, batch size (max_tokens), max_input_len.
        progress: called with the number of lines finished after each batch.
        workers: CPU only: decode the batches in this many forked processes of one
            thread each (`aiayn.decoding.workers`), instead of one process with all threads.
        sampling: draw outputs (`aiayn.decoding.sampling`) instead of searching; line i's
            samples are seeded by (sampling.seed, line_numbers[i]), so they do not depend
            on batching.
        line_numbers: each line's number in its input, 0-based (default 0, 1, ...): the
            sampling seeds, and the 1-based numbers in warnings about long lines.
        constraint_for: the `Constraint` of a batch, given its lines' indices (0-based, in
            the batch's order); None decodes unconstrained.
    Returns:
        One list of Translation per input line, in input order, best first; and counts.
    Raises:
        ConfigError (a ValueError) naming an invalid option, before any work.
    """
    cfg.validate()
    if sampling is not None:
        sampling.validate()
        if constraint_for is not None:
            raise ValueError("sampling draws unconstrained: give a constraint or sampling")
    check_workers(workers, device)
    stats = TranslateStats(lines=len(lines))
    numbers = list(range(len(lines))) if line_numbers is None else list(line_numbers)
    if len(numbers) != len(lines):
        raise ValueError(f"{len(numbers)} line numbers for {len(lines)} lines")
    first = numbers[0] + 1 if numbers else 1
    sources = encode_sources(tokenizer, lines, _input_limit(model, cfg), stats, first)
    results: list[list[Translation]] = [[] for _ in lines]
    kept = [i for i, s in enumerate(sources) if s is not None]  # blank lines skip the model
    if progress is not None and stats.empty:
        progress(stats.empty)
    # eval() walks and sets every module: ~1 ms a call, a tenth of a one-sentence request
    if not isinstance(model, nn.Module) or any(m.training for m in model.modules()):
        model.eval()
    # decode_batches counts the EOS itself: pass the lengths without it.
    batches = [
        [kept[r] for r in rows]
        for rows in decode_batches(
            [len(sources[i]) - 1 for i in kept],  # type: ignore[arg-type]
            cfg.max_tokens,
        )
    ]

    def decode(b: int) -> list[list[Hypothesis]]:
        src = pad_batch([sources[i] for i in batches[b]], device)  # type: ignore[misc]
        if sampling is not None:
            lines_b = [numbers[i] for i in batches[b]]
            return sample(model, src, sampling, cfg.max_len_a, cfg.max_len_b, cfg.alpha, lines_b)
        constraint = None if constraint_for is None else constraint_for(batches[b])
        return beam_search(
            model,
            src,
            cfg.beam,
            cfg.alpha,
            cfg.max_len_a,
            cfg.max_len_b,
            cfg.nbest,
            constraint=constraint,
        )

    def done(b: int, hyps: list[list[Hypothesis]]) -> None:
        for i, sentence_hyps in zip(batches[b], hyps, strict=True):
            results[i] = _to_translations(tokenizer, sentence_hyps)
        if progress is not None:
            progress(len(batches[b]))

    if workers > 1 and len(batches) > 1:
        prepare_shared(model)  # one copy for every worker, not one each
    map_batches(decode, len(batches), workers, done)
    return results, stats


def translate_lines(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    lines: Sequence[str],
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
) -> list[str]:
    """The best translation of each line, in input order; "" for a blank line (F1-F3).

    See `translate_nbest` for the arguments.
    """
    nbest, _ = translate_nbest(model, tokenizer, lines, cfg, device, progress, workers)
    return [outputs[0].text if outputs else "" for outputs in nbest]


# ------------------------------------------------------------------------- files
def decode_lines(data: bytes, name: str) -> tuple[list[str], list[int]]:
    """Split bytes into lines on b"\\n" only (like files.read_lines) and decode them.

    Invalid UTF-8 is replaced by U+FFFD, with a warning naming the line (F9).
    Returns:
        The lines, and the 1-based numbers of the lines that had invalid UTF-8.
    """
    raw_lines = data.split(b"\n") if data else []
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()  # the final newline ends the last line, it does not start another
    if raw_lines and raw_lines[0].startswith(b"\xef\xbb\xbf"):
        raw_lines[0] = raw_lines[0][3:]  # a UTF-8 byte-order mark is not text
    lines, bad = [], []
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(lineno)
            if len(bad) <= MAX_LINE_WARNINGS:
                logger.warning(
                    "%s:%d: invalid UTF-8 at byte %d, replaced by U+FFFD", name, lineno, e.start
                )
            lines.append(raw.decode("utf-8", errors="replace"))
    return lines, bad


def read_input(path: str | Path | None) -> tuple[list[str], list[int]]:
    """Lines of a text file (plain or gzip), or of stdin when `path` is None; see decode_lines."""
    if path is None:
        return decode_lines(sys.stdin.buffer.read(), "<stdin>")
    return decode_lines(read_bytes(path), str(path))


def format_output(i: int, outputs: list[Translation], nbest: int) -> str:
    """Output lines of input line i (0-based).

    nbest == 1: the best translation. nbest > 1: Moses-style "i ||| text ||| score" lines
    (score: length-normalised log-probability), so that the file can be realigned; a
    blank input gives one line with empty text and score 0.
    """
    if nbest == 1:
        return (outputs[0].text if outputs else "") + "\n"
    outputs = outputs or [Translation("", 0.0)]
    return "".join(f"{i} ||| {t.text} ||| {t.score:.6f}\n" for t in outputs)


def prefix_constraint(
    tokenizer: SubwordTokenizer,
    prefixes: Sequence[str],
    vocab_size: int,
    device: str | torch.device = "cpu",
) -> Callable[[list[int]], Constraint]:
    """`translate_nbest`'s `constraint_for` that makes line i's output begin with
    `prefixes[i]` (target text, subword-encoded with the target side's model; a blank
    prefix leaves its line free): prefix-constrained decoding, as an interactive
    translator continues what its user accepted. The search then goes on freely; the
    score covers the whole output, prefix included. A prefix longer than the line's output
    cap is cut at the cap."""
    target = getattr(tokenizer, "target", tokenizer)
    ids = [target.encode(p) if p.strip() else [] for p in prefixes]

    def constraint_for(batch: list[int]) -> Constraint:
        return ForcedPrefix([ids[i] for i in batch], vocab_size, device)

    return constraint_for


def translate_file(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    input_path: str | Path | None,
    output_path: str | Path | None,
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    workers: int = 1,
    sampling: SamplingOptions | None = None,
    prefix_path: str | Path | None = None,
) -> dict[str, Any]:
    """Translate a file (or stdin) into a file (atomically, F13) or stdout; with
    `sampling`, draw `sampling.n` outputs a line (see `translate_nbest`); with
    `prefix_path`, a file of as many lines as the input, each output begins with its line
    of it (`prefix_constraint`).

    Returns:
        Summary: lines, empty, truncated, unk_tokens and unk_lines (source subwords
        that are <unk>, F8), bad_utf8 (line count), partial (True when some
        input had to be repaired: the CLI exits non-zero, F9), seconds, sentences_per_s.
    """
    cfg.validate()
    start = time.perf_counter()
    lines, bad = read_input(input_path)
    if not lines:
        logger.warning(
            "%s: empty input, writing no output lines",
            input_path if input_path is not None else "<stdin>",
        )
    constraint_for = None
    if prefix_path is not None:
        prefixes, bad_prefix = read_input(prefix_path)
        if len(prefixes) != len(lines):
            raise InputError(
                f"{prefix_path}: {len(prefixes)} prefix lines for the "
                f"{len(lines)} lines of {input_path if input_path is not None else '<stdin>'}"
            )
        bad += bad_prefix
        vocab = int(tokenizer.vocab_size)  # type: ignore[attr-defined]
        constraint_for = prefix_constraint(tokenizer, prefixes, vocab, device)
    with contextlib.ExitStack() as stack:
        # the output's temporary file exists before decoding starts: a path that cannot be
        # written fails now, not after minutes of work
        out = None if output_path is None else stack.enter_context(atomic_write(output_path, "w"))
        nbest, stats = translate_nbest(
            model,
            tokenizer,
            lines,
            cfg,
            device,
            progress,
            workers,
            sampling,
            constraint_for=constraint_for,
        )
        n = cfg.nbest if sampling is None else sampling.n
        text = "".join(format_output(i, outputs, n) for i, outputs in enumerate(nbest))
        if out is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            out.write(text)
    return summarize(stats, len(bad), time.perf_counter() - start)


def summarize(stats: TranslateStats, bad_utf8: int, seconds: float) -> dict[str, Any]:
    """translate's JSON summary (see `translate_file`); logs the <unk> count (F8)."""
    if stats.unk_tokens:
        logger.info(
            "%d source subwords in %d lines are <unk> (unseen characters)",
            stats.unk_tokens,
            stats.unk_lines,
        )
    return {
        "lines": stats.lines,
        "empty": stats.empty,
        "truncated": stats.truncated,
        "unk_tokens": stats.unk_tokens,
        "unk_lines": stats.unk_lines,
        "bad_utf8": bad_utf8,
        "partial": bool(bad_utf8),
        "seconds": seconds,
        "sentences_per_s": (stats.lines - stats.empty) / seconds if seconds > 0 else 0.0,
    }
