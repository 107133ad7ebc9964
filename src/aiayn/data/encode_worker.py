"""One chunk of raw line pairs -> cleaned, encoded, filtered id arrays: the work of one
`stream_prepare` worker process.

Kept apart from stream_prepare so that a worker process imports only numpy and
sentencepiece (not torch): each of the `--workers` processes then costs ~60 MB, not ~300.
The rules are those of `prepare` (RELIABILITY E2, E3, E5), applied in the same order, so
that both preparations keep and drop the same pairs:

1. a side that is not valid UTF-8: `bad_utf8` (or an error naming file, line and byte);
2. a side that is empty or whitespace only (str.strip()): `empty` (or an error);
3. training split only, after encoding: a side with no subword `empty`, a side over
   max_len subwords `too_long`, a length ratio over max_len_ratio `ratio`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import sentencepiece as spm

from aiayn.config import UNK_ID
from aiayn.files import InputError

#: Dropped pairs named (file:line) per chunk; the parent logs the first few of a split.
MAX_NAMED = 10
REASONS = ("bad_utf8", "empty", "too_long", "ratio")

_sp: Any = None  # the worker's sentencepiece model, loaded once by init()
_cache: dict[str, list[int]] = {}  # word -> its ids (see encode_texts)
_CACHE_MAX = 2_000_000  # words; the cache is emptied when full (~300 MB at most)
_CHECK_EVERY = 97  # every 97th sentence is also encoded whole, to check the cache
_use_cache = True


@dataclass
class Task:
    """A chunk of aligned raw lines: line `first_line + k` is (src[k], tgt[k])."""

    src_path: str
    tgt_path: str
    first_line: int
    src: list[bytes]
    tgt: list[bytes]
    length_filter: bool  # training split: apply the subword length and ratio filters
    max_len: int
    max_len_ratio: float
    on_empty: str
    on_bad_utf8: str


@dataclass
class Result:
    """The kept pairs of a chunk (flat ids, lengths, line numbers) and what was dropped."""

    src_ids: np.ndarray  # int32 (sum of src_lens,)
    tgt_ids: np.ndarray
    src_lens: np.ndarray  # int64 (kept,)
    tgt_lens: np.ndarray
    line_numbers: np.ndarray  # int64 (kept,)
    lines: int
    dropped: dict[str, int]
    named: list[tuple[str, str]]  # (reason, "file:line[, file:line]") of the first drops
    unk: tuple[int, int]  # <unk> subwords on each side


def init(model_bytes: bytes) -> None:
    """Pool initializer: load the vocabulary once per worker."""
    global _sp, _use_cache
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model_bytes)
    _sp = sp
    _cache.clear()
    _use_cache = True


def init_process(model_bytes: bytes) -> None:
    """Pool initializer of a worker process: dies with its parent, leaves Ctrl-C to it
    (aiayn.processes), then `init`."""
    from aiayn.processes import worker_init

    worker_init()
    init(model_bytes)


def encode_texts(texts: list[str]) -> list[list[int]]:
    """sentencepiece's ids of each text, through a cache of words.

    Sentencepiece's pieces never span a space (split_by_whitespace, on in every model
    Tokenizer trains), and each space-separated word is encoded as "▁word" whether alone
    or inside its sentence: so a sentence's ids are its words' ids end to end, and with
    Zipf-distributed words nearly every word is a cache hit. That makes encoding ~5x
    faster. Every 97th sentence is encoded whole as well; at the first difference (a
    model with other whitespace rules) the cache is turned off for good in this process
    and the texts are encoded whole, so the result is sentencepiece's in every case.
    """
    global _use_cache
    if not _use_cache:
        return [list(ids) for ids in _sp.encode(texts, num_threads=1)]
    if len(_cache) > _CACHE_MAX:
        _cache.clear()
    split = [t.split(" ") for t in texts]
    missing = list({w for words in split for w in words if w not in _cache})
    if missing:
        for w, ids in zip(missing, _sp.encode(missing, num_threads=1), strict=True):
            _cache[w] = list(ids)
    get = _cache.__getitem__
    out = [list(chain.from_iterable(map(get, words))) for words in split]
    check = list(range(0, len(texts), _CHECK_EVERY))
    whole = _sp.encode([texts[i] for i in check], num_threads=1)
    if any(out[i] != list(ids) for i, ids in zip(check, whole, strict=True)):
        _use_cache = False
        return encode_texts(texts)
    return out


def decode_line(raw: bytes, path: str, lineno: int) -> str | None:
    """The text of a raw line (b"\\n" and a first line's byte-order mark already removed by
    the reader or here); None if it is not UTF-8. Errors name file, line and byte as
    files.read_lines does."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if path:  # the caller wants an error
            raise InputError(
                f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line "
                f"({raw[e.start : e.start + 4]!r})"
            ) from None
        return None


def clean(
    raw_src: bytes,
    raw_tgt: bytes,
    src_path: str,
    tgt_path: str,
    lineno: int,
    on_empty: str,
    on_bad_utf8: str,
) -> tuple[str | None, str | None, str, str]:
    """Rules 1-2 for one pair: (src, tgt, reason, where); reason "" when the pair is kept.

    `where` names the offending file(s) and line for the log.
    """
    raise_bad = on_bad_utf8 == "error"
    s = decode_line(_strip_nl(raw_src), src_path if raise_bad else "", lineno)
    t = decode_line(_strip_nl(raw_tgt), tgt_path if raise_bad else "", lineno)
    if s is None or t is None:
        return None, None, "bad_utf8", f"{src_path if s is None else tgt_path}:{lineno}"
    # str.strip() also removes U+2028, U+0085 and the like: invisible lines are empty.
    empty = [p for p, text in ((src_path, s), (tgt_path, t)) if not text.strip()]
    if empty:
        if on_empty == "error":
            raise InputError(
                f"{empty[0]}:{lineno}: empty or whitespace-only line "
                f"(on_empty='error'; 'skip' drops such pairs)"
            )
        return None, None, "empty", ", ".join(f"{p}:{lineno}" for p in empty)
    return s, t, "", ""


def _strip_nl(raw: bytes) -> bytes:
    return raw[:-1] if raw.endswith(b"\n") else raw


def encode_chunk(task: Task) -> Result:
    """Clean, encode and (training split) length-filter one chunk."""
    dropped = dict.fromkeys(REASONS, 0)
    named: list[tuple[str, str]] = []

    def drop(reason: str, where: str) -> None:
        dropped[reason] += 1
        if len(named) < MAX_NAMED:
            named.append((reason, where))

    texts_s: list[str] = []
    texts_t: list[str] = []
    lines: list[int] = []
    for k, (rs, rt) in enumerate(zip(task.src, task.tgt, strict=True)):
        lineno = task.first_line + k
        s, t, reason, where = clean(
            rs, rt, task.src_path, task.tgt_path, lineno, task.on_empty, task.on_bad_utf8
        )
        if reason or s is None or t is None:
            drop(reason, where)
            continue
        texts_s.append(s)
        texts_t.append(t)
        lines.append(lineno)
    enc_s = encode_texts(texts_s) if texts_s else []
    enc_t = encode_texts(texts_t) if texts_t else []
    keep_s, keep_t, keep_lines = [], [], []
    for s_ids, t_ids, lineno in zip(enc_s, enc_t, lines, strict=True):
        if task.length_filter:
            ls, lt = len(s_ids), len(t_ids)
            where = f"{task.src_path}:{lineno} / {task.tgt_path}:{lineno}"
            if not ls or not lt:
                drop("empty", where)
                continue
            if ls > task.max_len or lt > task.max_len:
                drop("too_long", f"{where} ({ls} / {lt} subwords > {task.max_len})")
                continue
            if max(ls, lt) > task.max_len_ratio * min(ls, lt):
                drop("ratio", f"{where} ({ls} / {lt} subwords)")
                continue
        keep_s.append(s_ids)
        keep_t.append(t_ids)
        keep_lines.append(lineno)
    src_lens = np.fromiter(map(len, keep_s), dtype=np.int64, count=len(keep_s))
    tgt_lens = np.fromiter(map(len, keep_t), dtype=np.int64, count=len(keep_t))
    src_ids = np.fromiter(chain.from_iterable(keep_s), dtype=np.int32, count=int(src_lens.sum()))
    tgt_ids = np.fromiter(chain.from_iterable(keep_t), dtype=np.int32, count=int(tgt_lens.sum()))
    return Result(
        src_ids=src_ids,
        tgt_ids=tgt_ids,
        src_lens=src_lens,
        tgt_lens=tgt_lens,
        line_numbers=np.asarray(keep_lines, dtype=np.int64),
        lines=len(task.src),
        dropped=dropped,
        named=named,
        unk=(int(np.count_nonzero(src_ids == UNK_ID)), int(np.count_nonzero(tgt_ids == UNK_ID))),
    )
