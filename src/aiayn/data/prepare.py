"""Prepare parallel text for training (section 5.1): clean it, encode it with the shared
BPE vocabulary, store id tensors and a manifest.

`prepare` turns PREFIX.LANG[.gz] files (fairseq's convention) into `out/`: `spm.model`,
`train.pt`, `valid.pt`, `test.pt` (plain tensors, loadable with
``torch.load(weights_only=True)``) and `manifest.json`, which records the inputs' hashes
and line counts, the vocabulary's hash, the outputs' hashes and every count of dropped
pairs. The manifest is deleted first and written last, so a killed `prepare` never leaves
a manifest pointing at half-written or stale files (RELIABILITY E8). Checks name the file
and line: line counts before any work (E1), empty lines (E2), invalid UTF-8 (E3), lines
split on b"\\n" only (E4), length filtering with per-reason counts (E5), <unk> rates (E7).
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from aiayn import files
from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data.tokenizer import Tokenizer
from aiayn.fast import native
from aiayn.files import InputError, read_lines, sha256_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPM_FILE = "spm.model"
SPLITS = ("train", "valid", "test")
_MAX_LOGGED = 10  # dropped lines named individually in the log, per split
_ENCODE_CHUNK = 10_000  # lines per sentencepiece call: fast, with bounded temporary lists


def find_input(prefix: str | Path, lang: str) -> Path:
    """PREFIX.LANG or PREFIX.LANG.gz, whichever exists; an error names both if neither."""
    candidates = [Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")]
    for path in candidates:
        if path.is_file():
            return path
    raise InputError(
        f"no {lang} input for prefix {prefix}: neither {candidates[0]} nor {candidates[1]} exists"
    )


def check_line_counts(src: Path, tgt: Path) -> int:
    """Refuse misaligned sides before any work (RELIABILITY E1); return the shared count.

    Tools that `zip` the two sides truncate silently to the shorter file; every pair after
    a missing line would then be misaligned.
    """
    n_src, n_tgt = files.count_lines(src), files.count_lines(tgt)
    if n_src != n_tgt:
        longer, shorter = (src, tgt) if n_src > n_tgt else (tgt, src)
        raise InputError(
            f"line counts differ: {src} has {n_src} lines, {tgt} has {n_tgt}; "
            f"line {min(n_src, n_tgt) + 1} of {longer} has no partner in "
            f"{shorter}"
        )
    return n_src


@dataclass
class _Pairs:
    """Cleaned text of one split, with each pair's 1-based line number and drop counts."""

    src: list[str] = field(default_factory=list)
    tgt: list[str] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: {"bad_utf8": 0, "empty": 0})


def _read_side(path: Path, on_bad_utf8: str) -> list[str | None]:
    """Lines of one side; with on_bad_utf8="skip", None marks an undecodable line.

    files.read_lines can only raise or replace, so undecodable lines are found in the raw
    bytes, split on b"\\n" exactly as read_lines splits them.
    """
    if on_bad_utf8 == "error":
        return list(read_lines(path))
    lines: list[str | None] = list(read_lines(path, on_bad_utf8="replace"))
    with files.open_bytes(path) as f:
        for i, raw in enumerate(f.read().split(b"\n")[: len(lines)]):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                lines[i] = None
    return lines


def _drop(pairs: _Pairs, reason: str, where: str) -> None:
    pairs.dropped[reason] += 1
    if pairs.dropped["bad_utf8"] + pairs.dropped["empty"] <= _MAX_LOGGED:
        logger.warning("dropped pair (%s): %s", reason.replace("_", " "), where)


def _read_pairs(src: Path, tgt: Path, on_empty: str, on_bad_utf8: str) -> _Pairs:
    """Read aligned lines, dropping (and logging) pairs with an empty or undecodable side."""
    src_lines, tgt_lines = _read_side(src, on_bad_utf8), _read_side(tgt, on_bad_utf8)
    if len(src_lines) != len(tgt_lines):  # a file changed since check_line_counts
        raise InputError(f"{src} has {len(src_lines)} lines, {tgt} has {len(tgt_lines)}")
    pairs = _Pairs()
    for lineno, (s, t) in enumerate(zip(src_lines, tgt_lines, strict=True), start=1):
        if s is None or t is None:
            _drop(pairs, "bad_utf8", f"{src if s is None else tgt}:{lineno}")
            continue
        # str.strip() also removes U+2028, U+0085 and the like: invisible lines are empty.
        empty = [path for path, text in ((src, s), (tgt, t)) if not text.strip()]
        if empty:
            if on_empty == "error":
                raise InputError(
                    f"{empty[0]}:{lineno}: empty or whitespace-only line "
                    f"(on_empty='error'; 'skip' drops such pairs)"
                )
            _drop(pairs, "empty", ", ".join(f"{p}:{lineno}" for p in empty))
            continue
        pairs.src.append(s)
        pairs.tgt.append(t)
        pairs.line_numbers.append(lineno)
    extra = pairs.dropped["bad_utf8"] + pairs.dropped["empty"] - _MAX_LOGGED
    if extra > 0:
        logger.warning("... and %d more dropped pairs in %s / %s", extra, src, tgt)
    return pairs


def _encode(tok: Tokenizer, lines: list[str]) -> list[list[int]]:
    return [
        ids
        for i in range(0, len(lines), _ENCODE_CHUNK)
        for ids in tok.encode_batch(lines[i : i + _ENCODE_CHUNK])
    ]


def _length_filter(
    src: list[list[int]], tgt: list[list[int]], max_len: int, max_len_ratio: float
) -> tuple[list[int], dict[str, int]]:
    """Indices of training pairs to keep, and the per-reason counts of the others (E5).

    Each pair is counted under its first failing reason: empty after encoding (e.g. only
    control characters), a side over max_len subwords, then a length ratio over
    max_len_ratio (the Moses clean-corpus rule, whose usual ratio is 9).
    """
    keep, counts = [], {"empty": 0, "too_long": 0, "ratio": 0}
    for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
        if not s or not t:
            counts["empty"] += 1
        elif len(s) > max_len or len(t) > max_len:
            counts["too_long"] += 1
        elif max(len(s), len(t)) > max_len_ratio * min(len(s), len(t)):
            counts["ratio"] += 1
        else:
            keep.append(i)
    return keep, counts


def _pack(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate sequences: (ids int32 (total,), offsets int64 (n+1,)); seq i is
    ids[offsets[i]:offsets[i+1]]. `array` keeps the flat list compact for large corpora."""
    flat, offsets = array("i"), array("q", [0])
    for s in seqs:
        flat.extend(s)
        offsets.append(len(flat))
    ids = (
        torch.frombuffer(flat, dtype=torch.int32).clone()
        if flat
        else torch.zeros(0, dtype=torch.int32)
    )
    return ids, torch.frombuffer(offsets, dtype=torch.int64).clone()


def _unk_rate(ids: torch.Tensor) -> float:
    return float((ids == UNK_ID).sum()) / max(1, ids.numel())


def _encode_split(
    split: str, pairs: _Pairs, tok: Tokenizer, opts: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encode, filter (train only) and report one split: its tensors and manifest entry."""
    src, tgt = _encode(tok, pairs.src), _encode(tok, pairs.tgt)
    lines = len(pairs.src) + sum(pairs.dropped.values())
    dropped = dict(pairs.dropped, too_long=0, ratio=0)
    keep = list(range(len(src)))
    if split == "train":  # valid and test keep every non-empty line: they are scored whole
        keep, counts = _length_filter(src, tgt, opts["max_len"], opts["max_len_ratio"])
        dropped = {k: dropped[k] + counts.get(k, 0) for k in dropped}
    n_dropped = sum(dropped.values())
    summary = (
        f"{split}: filtered {n_dropped} of {lines}: too long {dropped['too_long']}, "
        f"ratio {dropped['ratio']}, empty {dropped['empty']}, "
        f"bad UTF-8 {dropped['bad_utf8']}"
    )
    logger.info(summary)
    if n_dropped > opts["max_filtered_fraction"] * lines or not keep:
        raise InputError(
            f"{summary}; more than {opts['max_filtered_fraction']:.0%} of the "
            "pairs were dropped (misaligned or wrong files? raise "
            "max_filtered_fraction or max_len to accept)"
        )
    data: dict[str, torch.Tensor] = {}
    for side, seqs in (("src", src), ("tgt", tgt)):
        data[f"{side}_ids"], data[f"{side}_offsets"] = _pack([seqs[i] for i in keep])
    data["line_numbers"] = torch.tensor([pairs.line_numbers[i] for i in keep], dtype=torch.int64)
    unk = {side: _unk_rate(data[f"{side}_ids"]) for side in ("src", "tgt")}
    for side, rate in unk.items():
        if rate > 0.01:
            logger.warning("%s: %.2f%% of %s subwords are <unk>", split, 100 * rate, side)
    return data, {
        "lines": lines,
        "pairs": len(keep),
        "dropped": dropped,
        "unk_rate": unk,
        "src_tokens": data["src_ids"].numel(),
        "tgt_tokens": data["tgt_ids"].numel(),
    }


def _write_outputs(
    out: Path, tok: Tokenizer, encoded: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]
) -> dict[str, Any]:
    """Write the vocabulary and the splits atomically; return the splits' manifest entries.

    Files a previous run left and this one does not replace are removed, the manifest
    first, so that no manifest ever describes a mix of old and new files.
    """
    out.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST_FILE, *(f"{s}.pt" for s in SPLITS)):
        (out / name).unlink(missing_ok=True)
    files.remove_stale_tmp(out)
    tok.save(out / SPM_FILE)
    entries = {}
    for split, (tensors, entry) in encoded.items():
        path = out / f"{split}.pt"
        with files.atomic_write(path) as f:
            torch.save(tensors, f)
        entries[split] = dict(entry, path=path.name, sha256=sha256_file(path))
    return entries


def _check_options(
    on_empty: str,
    on_bad_utf8: str,
    max_len: int,
    max_len_ratio: float,
    max_filtered_fraction: float,
) -> None:
    if on_empty not in ("skip", "error"):
        raise ValueError(f"on_empty must be 'skip' or 'error', got {on_empty!r}")
    if on_bad_utf8 not in ("skip", "error"):
        raise ValueError(f"on_bad_utf8 must be 'skip' or 'error', got {on_bad_utf8!r}")
    if max_len < 1 or max_len_ratio < 1 or not 0 <= max_filtered_fraction <= 1:
        raise ValueError(
            "need max_len >= 1, max_len_ratio >= 1, 0 <= max_filtered_fraction "
            f"<= 1; got {max_len}, {max_len_ratio}, {max_filtered_fraction}"
        )


def prepare(
    source_lang: str,
    target_lang: str,
    trainpref: str | Path,
    validpref: str | Path | None = None,
    testpref: str | Path | None = None,
    out: str | Path | None = None,
    *,
    vocab_size: int = 8000,
    max_len: int = 256,
    max_len_ratio: float = 9.0,
    on_empty: str = "skip",
    on_bad_utf8: str = "error",
    max_filtered_fraction: float = 0.5,
    tokenizer: Tokenizer | None = None,
    seed: int = 1,
    lowercase: bool = False,
) -> dict[str, Any]:
    """Turn raw parallel text into the id tensors, vocabulary and manifest training reads.

    Args:
        source_lang, target_lang: file suffixes, e.g. "en" and "de".
        trainpref, validpref, testpref: prefixes of PREFIX.LANG or PREFIX.LANG.gz files.
        out: output directory (created); required (it has a default only to keep the
            fairseq order of arguments).
        vocab_size: subword vocabulary size, special pieces included (ignored if
            `tokenizer` is given).
        max_len, max_len_ratio: training pairs with a side longer than max_len subwords,
            or a length ratio above max_len_ratio, are dropped. Valid and test never are.
        on_empty: "skip" drops pairs with an empty or whitespace-only side; "error" fails.
        on_bad_utf8: "error" fails naming file, line and byte; "skip" drops the pair.
        max_filtered_fraction: fail if a split loses more than this fraction of its pairs.
        tokenizer: reuse this vocabulary instead of training one on the training text.
        seed: passed to the tokenizer trainer.
        lowercase: train a vocabulary that lowercases what it encodes (see
            Tokenizer.train); the checkpoint then lowercases any input it translates.

    Returns:
        The manifest, as written to `out/manifest.json`.
    """
    if out is None:
        raise TypeError("prepare() needs an output directory `out`")
    _check_options(on_empty, on_bad_utf8, max_len, max_len_ratio, max_filtered_fraction)
    prefixes = {"train": trainpref, "valid": validpref, "test": testpref}
    inputs = {
        split: (find_input(p, source_lang), find_input(p, target_lang))
        for split, p in prefixes.items()
        if p is not None
    }
    counts = {split: check_line_counts(*paths) for split, paths in inputs.items()}
    pairs = {split: _read_pairs(*paths, on_empty, on_bad_utf8) for split, paths in inputs.items()}
    trained = tokenizer is None
    if tokenizer is None:  # one vocabulary for both languages, learned on training text only
        train = pairs["train"]
        tokenizer = Tokenizer.train_from_sentences(
            chain(train.src, train.tgt), vocab_size, None, seed=seed, lowercase=lowercase
        )
    opts = {
        "max_len": max_len,
        "max_len_ratio": max_len_ratio,
        "max_filtered_fraction": max_filtered_fraction,
    }
    encoded = {split: _encode_split(split, p, tokenizer, opts) for split, p in pairs.items()}
    # Every check has passed: only now is `out` touched, so a rejected input leaves a
    # previous preparation intact.
    out = Path(out)
    splits = _write_outputs(out, tokenizer, encoded)
    manifest = {
        "format": FORMAT_VERSION,
        "source_lang": source_lang,
        "target_lang": target_lang,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "spm_model": {"path": SPM_FILE, "sha256": tokenizer.sha256, "trained": trained},
        "settings": dict(
            opts, on_empty=on_empty, on_bad_utf8=on_bad_utf8, seed=seed, lowercase=lowercase
        ),
        "inputs": {
            split: {
                side: {
                    "path": str(path.resolve()),
                    "sha256": sha256_file(path),
                    "lines": counts[split],
                }
                for side, path in zip(("src", "tgt"), paths, strict=True)
            }
            for split, paths in inputs.items()
        },
        "splits": splits,
    }
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    files.write_text_atomic(out / MANIFEST_FILE, text)  # last: it vouches for the rest
    return manifest


def load_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Read `data_dir/manifest.json`; a clear error if `prepare` has not (fully) run."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise InputError(
            f"{path}: no manifest; run `aiayn prepare` first (a prepare that "
            "was interrupted leaves none)"
        )
    try:
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable manifest ({e}); re-run `aiayn prepare`") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise InputError(
            f"{path}: format {manifest.get('format')!r}, expected "
            f"{FORMAT_VERSION}; re-run `aiayn prepare`"
        )
    return manifest


def _verified(data_dir: Path, name: str, expected: str) -> Path:
    path = data_dir / name
    if not path.is_file():
        raise InputError(f"{path}: missing; re-run `aiayn prepare`")
    found = sha256_file(path)
    if found != expected:
        raise InputError(
            f"{path}: sha256 {found} but the manifest expects {expected}; the "
            "file changed after `aiayn prepare`, re-run it"
        )
    return path


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The vocabulary `prepare` wrote, checked against the manifest's hash."""
    entry = load_manifest(data_dir)["spm_model"]
    return Tokenizer.load(_verified(Path(data_dir), entry["path"], entry["sha256"]))


class Corpus:
    """One prepared split: pair i is (src(i), tgt(i)), subword ids without BOS or EOS.

    Attributes:
        src_lens, tgt_lens: int64 (n,) lengths in subwords, without BOS/EOS.
        line_numbers: int64 (n,) the pair's 1-based line in the raw input files.
    """

    def __init__(self, data: dict[str, torch.Tensor], name: str = "<corpus>") -> None:
        n = data["line_numbers"].numel()
        for side in ("src", "tgt"):
            ids, off = data[f"{side}_ids"], data[f"{side}_offsets"]
            if (
                ids.dtype != torch.int32
                or off.dtype != torch.int64
                or off.numel() != n + 1
                or int(off[0]) != 0
                or int(off[-1]) != ids.numel()
                or bool((off[1:] < off[:-1]).any())
            ):
                raise InputError(f"{name}: inconsistent {side} ids/offsets; re-run prepare")
        self._src_ids, self._src_off = data["src_ids"], data["src_offsets"]
        self._tgt_ids, self._tgt_off = data["tgt_ids"], data["tgt_offsets"]
        self.line_numbers = data["line_numbers"]
        self.src_lens = self._src_off[1:] - self._src_off[:-1]
        self.tgt_lens = self._tgt_off[1:] - self._tgt_off[:-1]

    def __len__(self) -> int:
        return int(self.line_numbers.numel())

    def src(self, i: int) -> list[int]:
        return self._src_ids[self._src_off[i] : self._src_off[i + 1]].tolist()

    def tgt(self, i: int) -> list[int]:
        return self._tgt_ids[self._tgt_off[i] : self._tgt_off[i + 1]].tolist()

    def both_directions(self) -> Corpus:
        """Every pair twice, as (src, tgt) and then as (tgt, src): bidirectional training's
        data (Ding et al., 2021). Needs one vocabulary for both languages, as
        `prepare` builds; pair n + i is pair i reversed, with its line number."""

        def joined(first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
            ids_a, off_a = getattr(self, f"_{first}_ids"), getattr(self, f"_{first}_off")
            ids_b, off_b = getattr(self, f"_{second}_ids"), getattr(self, f"_{second}_off")
            return torch.cat([ids_a, ids_b]), torch.cat([off_a, off_b[1:] + ids_a.numel()])

        src_ids, src_off = joined("src", "tgt")
        tgt_ids, tgt_off = joined("tgt", "src")
        return Corpus(
            {
                "src_ids": src_ids,
                "src_offsets": src_off,
                "tgt_ids": tgt_ids,
                "tgt_offsets": tgt_off,
                "line_numbers": torch.cat([self.line_numbers, self.line_numbers]),
            },
            name="<both directions>",
        )


def load_corpus(data_dir: str | Path, split: str) -> Corpus:
    """Load a prepared split after checking it and spm.model against the manifest's hashes.

    A vocabulary swapped after `prepare` would silently give every id another meaning
    (RELIABILITY F10/F11), so the check is not optional.
    """
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if split not in manifest["splits"]:
        raise InputError(
            f"{data_dir}: split {split!r} was not prepared (have: {', '.join(manifest['splits'])})"
        )
    spm_entry, entry = manifest["spm_model"], manifest["splits"][split]
    _verified(data_dir, spm_entry["path"], spm_entry["sha256"])
    path = _verified(data_dir, entry["path"], entry["sha256"])
    return Corpus(torch.load(path, weights_only=True), name=str(path))


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _bpe_dropout_words(
    sym: torch.Tensor,
    off: torch.Tensor,
    merges: dict[tuple[int, int], tuple[int, float]],
    seed: int,
    threshold: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/bpe_dropout.c in Python, draw for draw (see there): the fallback without a
    compiler, and the second implementation the tests hold the C code to."""
    flat, starts = sym.tolist(), off.tolist()
    out = list(flat)
    count = []
    for w in range(len(starts) - 1):
        s = flat[starts[w] : starts[w + 1]]
        stream, j = _splitmix64(seed + w * _GOLDEN), 0
        while True:
            best, best_merge = -1, (0, 0.0)
            for i in range(len(s) - 1):
                m = merges.get((s[i], s[i + 1]))
                if m is None:
                    continue
                if threshold > 0:
                    j += 1
                    if _splitmix64(stream + j * _GOLDEN) >> 11 < threshold:
                        continue
                if best < 0 or m[1] > best_merge[1]:
                    best, best_merge = i, m
            if best < 0:
                break
            s[best : best + 2] = [best_merge[0]]
        out[starts[w] : starts[w] + len(s)] = s
        count.append(len(s))
    return torch.tensor(out, dtype=torch.int32), torch.tensor(count, dtype=torch.int64)


class BPEDropout:
    """Training pairs under BPE-dropout (Provilkov et al., 2020): every epoch a fresh
    segmentation of each sentence, each possible BPE merge left out of each merge step
    with probability p (the paper's Algorithm 1; csrc/bpe_dropout.c).

    A departure from the paper (which segments once), for small corpora such as Multi30k:
    the same word seen under several segmentations teaches the model how its pieces
    compose. The draws depend on (seed, word) alone (csrc/bpe_dropout.c), so reruns and
    resumed runs see the same epochs. Each word of the prepared pairs is re-merged from its
    characters with the vocabulary's own merges (`Tokenizer.bpe_merges`); at p = 0 that
    gives back the prepared ids, which the constructor checks: a pair for which it does not
    (e.g. it holds <unk>), or whose new segmentation of a side is longer than `max_len`,
    keeps its prepared segmentation in that epoch.
    """

    def __init__(self, corpus: Corpus, tok: Tokenizer, p: float, max_len: int) -> None:
        if not 0.0 < p < 1.0:
            raise ValueError(f"BPE-dropout p must be in (0, 1), got {p}")
        self.p, self.max_len, self.n = p, max_len, len(corpus)
        self._line_numbers = corpus.line_numbers
        self._merges = tok.bpe_merges()
        order = sorted(self._merges)
        v = tok.vocab_size
        self._v = v
        self._keys = torch.tensor([a * v + b for a, b in order], dtype=torch.int64)
        self._merged = torch.tensor([self._merges[k][0] for k in order], dtype=torch.int32)
        self._score = torch.tensor([self._merges[k][1] for k in order], dtype=torch.float64)
        pieces = tok.pieces()
        text = [tok.id_to_piece(i) for i in range(v)]
        # every pair's both sides as one list of sentences: sources, then targets
        self._prepared = torch.cat([corpus._src_ids, corpus._tgt_ids])
        self._prepared_off = torch.cat(
            [corpus._src_off, corpus._tgt_off[1:] + corpus._src_ids.numel()]
        )
        starts: dict[tuple[int, ...], list[int]] = {}
        sym, word_off, sent_words = array("i"), array("q", [0]), array("q", [0])
        prepared, off = self._prepared.tolist(), self._prepared_off.tolist()
        for s in range(2 * self.n):
            ids = prepared[off[s] : off[s + 1]]
            cut = [0] + [k for k in range(1, len(ids)) if text[ids[k]].startswith("\u2581")]
            for a, b in zip(cut, cut[1:] + [len(ids)], strict=True):
                word = tuple(ids[a:b])
                start = starts.get(word)
                if start is None:
                    chars = "".join(text[i] for i in word)
                    start = (
                        [pieces[c] for c in chars]
                        if all(c in pieces for c in chars)
                        else list(word)
                    )
                    starts[word] = start
                sym.extend(start)
                word_off.append(len(sym))
            sent_words.append(len(word_off) - 1)
        self._sym = torch.frombuffer(sym, dtype=torch.int32).clone()
        self._word_off = torch.frombuffer(word_off, dtype=torch.int64).clone()
        self._sent_words = torch.frombuffer(sent_words, dtype=torch.int64).clone()
        flat, sent_off = self._segment(seed=0, threshold=0)
        if torch.equal(sent_off, self._prepared_off):
            # one comparison of everything; a differing id marks its sentence
            wrong = torch.nonzero(flat != self._prepared).flatten()
            same = torch.ones(2 * self.n, dtype=torch.bool)
            same[torch.searchsorted(sent_off, wrong, right=True) - 1] = False
        else:
            same = torch.tensor(
                [
                    torch.equal(
                        flat[sent_off[s] : sent_off[s + 1]], self._prepared[off[s] : off[s + 1]]
                    )
                    for s in range(2 * self.n)
                ]
            )
        self._fixed = ~(same[: self.n] & same[self.n :])
        if bool(self._fixed.any()):
            logger.warning(
                "BPE-dropout: %d of %d training pairs are not rebuilt by the "
                "vocabulary's merges and keep their prepared segmentation",
                int(self._fixed.sum()),
                self.n,
            )

    def _segment(self, seed: int, threshold: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sentence's new ids, concatenated, and their offsets."""
        done = native.bpe_dropout(
            self._sym,
            self._word_off,
            self._keys,
            self._merged,
            self._score,
            self._v,
            seed,
            threshold,
        )
        if done is None:
            done = _bpe_dropout_words(self._sym, self._word_off, self._merges, seed, threshold)
        out, count = done
        word_len = self._word_off[1:] - self._word_off[:-1]
        pos = torch.arange(out.numel()) - torch.repeat_interleave(self._word_off[:-1], word_len)
        flat = out[pos < torch.repeat_interleave(count, word_len)]
        words_end = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(count, 0)])
        return flat, words_end[self._sent_words]

    def epoch(self, seed: int) -> Corpus:
        """The training pairs of one epoch; `seed` should depend on the run's seed and the
        epoch number."""
        flat, sent_off = self._segment(seed, round(self.p * 2**53))
        lens = sent_off[1:] - sent_off[:-1]
        n = self.n
        keep = self._fixed | (lens[:n] > self.max_len) | (lens[n:] > self.max_len)
        keep2 = torch.cat([keep, keep])
        prep_lens = self._prepared_off[1:] - self._prepared_off[:-1]
        new_lens = torch.where(keep2, prep_lens, lens)
        src = torch.where(keep2, self._prepared_off[:-1] + flat.numel(), sent_off[:-1])
        new_off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(new_lens, 0)])
        pos = torch.arange(int(new_off[-1])) - torch.repeat_interleave(new_off[:-1], new_lens)
        ids = torch.cat([flat, self._prepared])[torch.repeat_interleave(src, new_lens) + pos]
        n_src = int(new_off[n])
        return Corpus(
            {
                "src_ids": ids[:n_src].clone(),
                "src_offsets": new_off[: n + 1].clone(),
                "tgt_ids": ids[n_src:].clone(),
                "tgt_offsets": new_off[n:] - n_src,
                "line_numbers": self._line_numbers,
            },
            name=f"BPE-dropout p={self.p}",
        )
