"""`prepare` for corpora of tens of millions of pairs (`aiayn prepare --streaming`).

The in-memory `prepare` holds every line in Python lists and trains sentencepiece on all
of them: fine for Multi30k's 29K pairs, hopeless for WMT14 En-Fr's 36M. This one keeps
memory bounded by its settings, not by the corpus:

1. **Count** each input's lines, 1 MiB at a time (RELIABILITY E1: misaligned sides are
   refused before any work), and hash it the same way for the manifest.
2. **Sample** `spm_sample` sentences for the vocabulary: spm_sample / 2 training pairs
   drawn uniformly without replacement (numpy, from `seed`), both sides of each, read in
   one pass; pairs that cleaning drops, or with more than `max_len` words (so more than
   max_len subwords: they are dropped anyway), are skipped. The sample is written to a
   temporary file, and sentencepiece (`spm_threads` threads) learns the vocabulary from
   it. When the corpus has no more pairs than spm_sample / 2, every pair is taken, in the
   order `prepare` uses, and the vocabulary is `prepare`'s.
3. **Encode** in `workers` processes: the parent reads both sides in lockstep and sends
   chunks of raw lines; each worker (data.encode_worker, vocabulary loaded once) cleans,
   encodes and filters with `prepare`'s rules and returns int32 arrays, which the parent
   appends, in order, to .npy files (data.mmap_corpus). At most 2 x workers chunks are in
   flight, so memory does not depend on the corpus.

Nothing in `out` is replaced until every split has passed its checks: the arrays are
written under temporary names, and the manifest (format 2) is removed first and written
last, as `prepare` does (RELIABILITY E8).

Memory, with the defaults: the peak is sentencepiece learning BPE from 2M sentences, in
the parent process: 1.3 GB at 37K pieces on WMT-like text, 1.47 GB for the whole process
tree, the same at 4.5M and 9M pairs (benchmarks/prepare_scale.py). Unigram's trainer
needs ~4x BPE's memory per sentence (3.4 GB for 1M sentences), hence its smaller default
sample. While encoding: the parent (~300 MB: torch is imported) and each worker (~100 MB).

Long because the three passes above share their readers, counters and the manifest they
fill; the workers' side is its own module (`data.encode_worker`).
"""

from __future__ import annotations

import gzip
import logging
import math
import multiprocessing as mp
import os
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from aiayn import files
from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data import encode_worker
from aiayn.data.corpus import MANIFEST_FILE, MMAP_FORMAT_VERSION, SPLITS, SPM_FILE
from aiayn.data.mmap_corpus import ARRAYS, DTYPES, NpyWriter, array_file
from aiayn.data.prepare import (
    _check_options,
    check_filtered,
    check_line_counts,
    find_inputs,
    inputs_manifest,
    warn_unknown,
    write_manifest,
)
from aiayn.data.tokenizer import Tokenizer
from aiayn.files import InputError, sha256_file
from aiayn.processes import sigint_ignored

logger = logging.getLogger(__name__)

#: Sentences sentencepiece learns from by default: 1M pairs, both sides. BPE at 37K pieces
#: on WMT-like text takes ~1 GB and ~1 minute on 2 cores for it; 10M (the size often
#: quoted) would need ~5-10 GB, beyond the 4 GB this prepare is meant to fit in.
DEFAULT_SPM_SAMPLE = 2_000_000
#: Unigram's trainer took 3.4 GB and 7 minutes for 1M WMT-like sentences (32K pieces),
#: BPE's 0.7 GB and 27 s: so a quarter of the sentences.
DEFAULT_SPM_SAMPLE_UNIGRAM = 500_000
CHUNK_LINES = 10_000  # pairs per worker task: ~3 MB pickled, ~50 ms of encoding
_BOM = b"\xef\xbb\xbf"
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


def raw_lines(path: Path) -> Iterator[bytes]:
    """The lines of a plain or gzip file as bytes, each with its b"\\n" (split on b"\\n"
    only, as files.read_lines splits them), without a first line's byte-order mark.
    A truncated gzip stream is an InputError naming the file."""
    try:
        with files.open_bytes(path) as f:
            first = f.readline()
            if not first:
                return
            yield first[3:] if first.startswith(_BOM) else first
            yield from f
    except _GZIP_ERRORS as e:
        raise InputError(f"{path}: truncated or corrupt gzip file ({e})") from None


def _chunks(src: Path, tgt: Path, chunk: int) -> Iterator[tuple[int, list[bytes], list[bytes]]]:
    """(first line number, src lines, tgt lines) of `chunk` aligned pairs at a time."""
    it_s, it_t = raw_lines(src), raw_lines(tgt)
    first = 1
    while True:
        bs, bt = list(islice(it_s, chunk)), list(islice(it_t, chunk))
        if len(bs) != len(bt):  # a file changed since the count
            longer, shorter = (src, tgt) if len(bs) > len(bt) else (tgt, src)
            raise InputError(
                f"line {first + min(len(bs), len(bt))} of {longer} has no partner in "
                f"{shorter} (the file changed during prepare?)"
            )
        if not bs:
            return
        yield first, bs, bt
        first += len(bs)


def sample_for_vocabulary(
    src: Path,
    tgt: Path,
    n_lines: int,
    sentences: int,
    seed: int,
    max_words: int,
    on_empty: str,
    on_bad_utf8: str,
    workdir: Path,
) -> tuple[list[Path], dict[str, int]]:
    """Draw the vocabulary's training sentences (see the module's step 2).

    Returns the two files (sources, then targets: `prepare`'s order) and the counts.
    Memory: the drawn line numbers (8 bytes each), never the sentences.
    """
    k = min(n_lines, math.ceil(sentences / 2))
    if k < n_lines:
        chosen = np.sort(np.random.default_rng(seed).choice(n_lines, size=k, replace=False)) + 1
    else:
        chosen = np.arange(1, n_lines + 1)
    paths = [workdir / "sample.src", workdir / "sample.tgt"]
    taken = skipped = 0
    with open(paths[0], "wb") as fs, open(paths[1], "wb") as ft:
        pos = 0
        for first, bs, bt in _chunks(src, tgt, CHUNK_LINES):
            last = first + len(bs)
            while pos < k and chosen[pos] < last:
                i = int(chosen[pos]) - first
                lineno = int(chosen[pos])
                pos += 1
                s, t, reason, _ = encode_worker.clean(
                    bs[i], bt[i], str(src), str(tgt), lineno, on_empty, on_bad_utf8
                )
                if reason or s is None or t is None:
                    skipped += 1
                    continue
                if len(s.split()) > max_words or len(t.split()) > max_words:
                    skipped += 1
                    continue
                fs.write(s.encode("utf-8") + b"\n")
                ft.write(t.encode("utf-8") + b"\n")
                taken += 1
            if pos >= k:
                break
    return paths, {"pairs_drawn": k, "pairs_taken": taken, "pairs_skipped": skipped}


def _sentences(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, "rb") as f:
            for raw in f:
                yield raw[:-1].decode("utf-8")


class _SplitWriter:
    """The five arrays of one split, under temporary names in `out` until `commit`."""

    def __init__(self, out: Path, split: str) -> None:
        self.out, self.split = out, split
        self.final = {key: out / array_file(split, key) for key in ARRAYS}
        self.tmp = {
            key: p.with_name(f".{p.name}.{os.getpid()}.tmp") for key, p in self.final.items()
        }
        self.handles = {key: open(self.tmp[key], "wb") for key in ARRAYS}  # noqa: SIM115
        self.w = {key: NpyWriter(self.handles[key], DTYPES[key]) for key in ARRAYS}
        self.w["src_offsets"].append(np.zeros(1, dtype=np.int64))
        self.w["tgt_offsets"].append(np.zeros(1, dtype=np.int64))

    def add(self, r: encode_worker.Result) -> None:
        for side in ("src", "tgt"):
            ids, lens = getattr(r, f"{side}_ids"), getattr(r, f"{side}_lens")
            base = self.w[f"{side}_ids"].n
            self.w[f"{side}_ids"].append(ids)
            self.w[f"{side}_offsets"].append(np.cumsum(lens) + base)
        self.w["line_numbers"].append(r.line_numbers)

    def close(self) -> dict[str, dict[str, Any]]:
        """Finish the headers, fsync, and return each file's manifest entry."""
        entries = {}
        for key in ARRAYS:
            self.w[key].close()
            f = self.handles[key]
            f.flush()
            os.fsync(f.fileno())
            f.close()
            entries[key] = {
                "path": self.final[key].name,
                "sha256": sha256_file(self.tmp[key]),  # streamed, 1 MiB at a time
                "bytes": self.tmp[key].stat().st_size,
            }
        return entries

    def commit(self) -> None:
        for key in ARRAYS:
            os.replace(self.tmp[key], self.final[key])

    def discard(self) -> None:
        for key in ARRAYS:
            if not self.handles[key].closed:
                self.handles[key].close()
            self.tmp[key].unlink(missing_ok=True)


def _encode_split(
    split: str,
    src: Path,
    tgt: Path,
    n_lines: int,
    writer: _SplitWriter,
    submit: Any,
    in_flight: int,
    opts: dict[str, Any],
) -> dict[str, Any]:
    """Stream one split through the workers into `writer`; return its manifest entry."""
    from tqdm import tqdm

    dropped = dict.fromkeys(encode_worker.REASONS, 0)
    named = 0
    unk = [0, 0]
    pending: deque[Any] = deque()
    bar = tqdm(total=n_lines, unit=" lines", desc=f"encoding {split}", disable=None)

    def collect(r: encode_worker.Result) -> None:
        nonlocal named
        writer.add(r)
        for key, v in r.dropped.items():
            dropped[key] += v
        for reason, where in r.named:
            if named < encode_worker.MAX_NAMED:
                logger.warning("%s: dropped pair (%s): %s", split, reason.replace("_", " "), where)
            named += 1
        unk[0] += r.unk[0]
        unk[1] += r.unk[1]
        bar.update(r.lines)

    try:
        for first, bs, bt in _chunks(src, tgt, CHUNK_LINES):
            task = encode_worker.Task(
                src_path=str(src),
                tgt_path=str(tgt),
                first_line=first,
                src=bs,
                tgt=bt,
                length_filter=split == "train",
                max_len=opts["max_len"],
                max_len_ratio=opts["max_len_ratio"],
                on_empty=opts["on_empty"],
                on_bad_utf8=opts["on_bad_utf8"],
            )
            pending.append(submit(task))
            while len(pending) >= in_flight:
                collect(pending.popleft()())
        while pending:
            collect(pending.popleft()())
    finally:
        bar.close()
    n_drop = sum(dropped.values())
    if n_drop > named:
        logger.warning(
            "%s: ... and %d more dropped pairs in %s / %s", split, n_drop - named, src, tgt
        )
    pairs = writer.w["line_numbers"].n
    src_tokens, tgt_tokens = writer.w["src_ids"].n, writer.w["tgt_ids"].n
    check_filtered(split, dropped, n_lines, pairs, opts["max_filtered_fraction"])
    rates = {"src": unk[0] / max(1, src_tokens), "tgt": unk[1] / max(1, tgt_tokens)}
    warn_unknown(split, rates)
    return {
        "lines": n_lines,
        "pairs": pairs,
        "dropped": dropped,
        "unk_rate": rates,
        "src_tokens": src_tokens,
        "tgt_tokens": tgt_tokens,
    }


def prepare_streaming(
    source_lang: str,
    target_lang: str,
    trainpref: str | Path,
    validpref: str | Path | None = None,
    testpref: str | Path | None = None,
    out: str | Path | None = None,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    max_len: int = 256,
    max_len_ratio: float = 9.0,
    on_empty: str = "skip",
    on_bad_utf8: str = "error",
    max_filtered_fraction: float = 0.5,
    tokenizer: Tokenizer | None = None,
    seed: int = 1,
    lowercase: bool = False,
    split_by_script: bool = True,
    workers: int | None = None,
    spm_sample: int | None = None,
    spm_threads: int | None = None,
) -> dict[str, Any]:
    """`prepare` (same arguments, same cleaning and filters) in bounded memory, writing
    memory-mapped arrays that `load_corpus` opens as an `MmapCorpus`.

    Args (beyond prepare's):
        model_type: "bpe" (the paper's En-De) or "unigram" (word-piece-like, En-Fr).
        workers: encoding processes; 0 encodes in this process (default: CPU count).
        spm_sample: sentences (both sides) sentencepiece learns from; see the module doc.
        spm_threads: sentencepiece's trainer threads (default: CPU count).

    Workers are started with multiprocessing's "spawn", which imports the main module
    anew: a script that calls this with workers > 0 needs the usual
    ``if __name__ == "__main__":`` guard (the `aiayn` command has it).

    Returns:
        The manifest (format 2), as written to `out/manifest.json`.
    """
    if out is None:
        raise TypeError("prepare_streaming() needs an output directory `out`")
    _check_options(on_empty, on_bad_utf8, max_len, max_len_ratio, max_filtered_fraction)
    cpus = os.cpu_count() or 1
    workers = cpus if workers is None else workers
    spm_threads = cpus if spm_threads is None else spm_threads
    if spm_sample is None:
        spm_sample = DEFAULT_SPM_SAMPLE if model_type == "bpe" else DEFAULT_SPM_SAMPLE_UNIGRAM
    if workers < 0 or spm_threads < 1 or spm_sample < 2:
        raise ValueError(
            f"need workers >= 0, spm_threads >= 1, spm_sample >= 2; got {workers}, "
            f"{spm_threads}, {spm_sample}"
        )
    t0 = time.monotonic()
    prefixes = {"train": trainpref, "valid": validpref, "test": testpref}
    inputs = find_inputs(source_lang, target_lang, prefixes)
    counts = {split: check_line_counts(*paths) for split, paths in inputs.items()}
    input_hashes = {path: sha256_file(path) for paths in inputs.values() for path in paths}
    seconds = {"count": round(time.monotonic() - t0, 1)}
    logger.info(
        "counted and hashed the inputs: %s lines (%.0f s)",
        ", ".join(f"{s} {n}" for s, n in counts.items()),
        seconds["count"],
    )
    trained = tokenizer is None
    sample_info: dict[str, Any] = {}
    if tokenizer is None:
        tokenizer, sample_info = _learn_vocabulary(
            inputs["train"],
            counts["train"],
            vocab_size=vocab_size,
            model_type=model_type,
            spm_sample=spm_sample,
            spm_threads=spm_threads,
            seed=seed,
            max_len=max_len,
            on_empty=on_empty,
            on_bad_utf8=on_bad_utf8,
            lowercase=lowercase,
            split_by_script=split_by_script,
        )
        seconds["vocabulary"] = sample_info["seconds"]
    opts = {
        "max_len": max_len,
        "max_len_ratio": max_len_ratio,
        "max_filtered_fraction": max_filtered_fraction,
        "on_empty": on_empty,
        "on_bad_utf8": on_bad_utf8,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files.remove_stale_tmp(out)
    writers: dict[str, _SplitWriter] = {}
    splits: dict[str, Any] = {}
    t1 = time.monotonic()
    try:
        with _Encoder(tokenizer, workers) as (submit, in_flight):
            for split, (src, tgt) in inputs.items():
                writers[split] = _SplitWriter(out, split)
                splits[split] = _encode_split(
                    split, src, tgt, counts[split], writers[split], submit, in_flight, opts
                )
                splits[split]["files"] = writers[split].close()
        # Every check has passed: only now is what `out` held replaced.
        (out / MANIFEST_FILE).unlink(missing_ok=True)
        for s in SPLITS:
            (out / f"{s}.pt").unlink(missing_ok=True)
            for key in ARRAYS:
                (out / array_file(s, key)).unlink(missing_ok=True)
        for w in writers.values():
            w.commit()
    finally:
        for w in writers.values():
            w.discard()
    tokenizer.save(out / SPM_FILE)
    seconds["encode"] = round(time.monotonic() - t1, 1)
    seconds["total"] = round(time.monotonic() - t0, 1)
    logger.info("encoded in %.0f s with %d worker(s)", seconds["encode"], workers)
    manifest = {
        "format": MMAP_FORMAT_VERSION,
        "source_lang": source_lang,
        "target_lang": target_lang,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "spm_model": {
            "path": SPM_FILE,
            "sha256": tokenizer.sha256,
            "trained": trained,
            **({"model_type": model_type, "sample": sample_info} if trained else {}),
        },
        "settings": dict(
            {k: opts[k] for k in ("max_len", "max_len_ratio", "max_filtered_fraction")},
            on_empty=on_empty,
            on_bad_utf8=on_bad_utf8,
            seed=seed,
            lowercase=lowercase,
            **({} if split_by_script else {"split_by_script": False}),
            streaming={"workers": workers, "spm_sample": spm_sample, "spm_threads": spm_threads},
        ),
        "inputs": inputs_manifest(inputs, counts, input_hashes),
        "splits": splits,
        "seconds": seconds,
    }
    write_manifest(out, manifest)
    return manifest


def _learn_vocabulary(
    train: tuple[Path, Path],
    n_lines: int,
    *,
    vocab_size: int,
    model_type: str,
    spm_sample: int,
    spm_threads: int,
    seed: int,
    max_len: int,
    on_empty: str,
    on_bad_utf8: str,
    lowercase: bool,
    split_by_script: bool,
) -> tuple[Tokenizer, dict[str, Any]]:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aiayn-spm-") as tmp:
        paths, info = sample_for_vocabulary(
            *train, n_lines, spm_sample, seed, max_len, on_empty, on_bad_utf8, Path(tmp)
        )
        if not info["pairs_taken"]:
            raise InputError(
                f"{train[0]} and {train[1]}: no training text among the {info['pairs_drawn']} "
                f"pairs drawn of {n_lines} lines: nothing to learn a vocabulary from"
            )
        logger.info(
            "learning a %d-piece %s vocabulary from %d sentences (%d pairs drawn of %d, "
            "%d skipped), %d threads",
            vocab_size,
            model_type,
            2 * info["pairs_taken"],
            info["pairs_drawn"],
            n_lines,
            info["pairs_skipped"],
            spm_threads,
        )
        tok = Tokenizer.train_from_sentences(
            _sentences(paths),
            vocab_size,
            None,
            seed=seed,
            num_threads=spm_threads,
            lowercase=lowercase,
            split_by_script=split_by_script,
            model_type=model_type,
        )
    summary: dict[str, Any] = dict(info, sentences=2 * info["pairs_taken"])
    summary["seconds"] = round(time.monotonic() - t0, 1)
    return tok, summary


class _Encoder:
    """`submit(task)` returning a zero-argument function that waits for the result: a
    pool of `workers` spawned processes, or this process when workers is 0.

    Spawned, not forked, so that a worker holds numpy and sentencepiece only, never a copy
    of the parent's memory (torch included)."""

    def __init__(self, tokenizer: Tokenizer, workers: int) -> None:
        self.model, self.workers = tokenizer.to_bytes(), workers
        self.pool: Any = None

    def __enter__(self) -> tuple[Any, int]:
        if self.workers == 0:
            encode_worker.init(self.model)

            def serial(task: encode_worker.Task) -> Any:
                result = encode_worker.encode_chunk(task)
                return lambda: result

            return serial, 1
        ctx = mp.get_context("spawn")
        with sigint_ignored():  # spawned workers start immune to Ctrl-C (aiayn.processes)
            self.pool = ctx.Pool(
                self.workers, initializer=encode_worker.init_process, initargs=(self.model,)
            )

        def submit(task: encode_worker.Task) -> Any:
            return self.pool.apply_async(encode_worker.encode_chunk, (task,)).get

        return submit, 2 * self.workers

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            if exc[0] is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()
