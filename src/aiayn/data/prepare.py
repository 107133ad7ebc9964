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
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from aiayn import files
from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data.corpus import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SPLITS,
    SPM_FILE,
    Corpus,
    load_corpus,
    load_manifest,
    load_tokenizer,
)
from aiayn.data.tokenizer import PairTokenizer, Tokenizer, Vocabulary, side_tokenizers
from aiayn.files import InputError, read_lines, sha256_file

logger = logging.getLogger(__name__)


_MAX_LOGGED = 10  # dropped lines named individually in the log, per split
_BIG_INPUT = 1 << 30  # training text (bytes on disk) above which --streaming is suggested
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


def find_inputs(
    source_lang: str, target_lang: str, prefixes: dict[str, str | Path | None]
) -> dict[str, tuple[Path, Path]]:
    """(source, target) file of each split whose prefix is given (`find_input`)."""
    return {
        split: (find_input(p, source_lang), find_input(p, target_lang))
        for split, p in prefixes.items()
        if p is not None
    }


def inputs_manifest(
    inputs: dict[str, tuple[Path, Path]], counts: dict[str, int], hashes: dict[Path, str]
) -> dict[str, Any]:
    """The manifest's "inputs": each split's files with their sha256 and line count."""
    return {
        split: {
            side: {"path": str(path.resolve()), "sha256": hashes[path], "lines": counts[split]}
            for side, path in zip(("src", "tgt"), paths, strict=True)
        }
        for split, paths in inputs.items()
    }


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Write out/manifest.json, last: it vouches for the files written before it."""
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    files.write_text_atomic(out / MANIFEST_FILE, text)


def check_filtered(
    split: str, dropped: dict[str, int], lines: int, kept: int, max_fraction: float
) -> None:
    """Log a split's filter counts by reason; refuse a split that lost more than
    `max_fraction` of its pairs, or all of them (misaligned or wrong files, usually)."""
    n_dropped = sum(dropped.values())
    summary = (
        f"{split}: filtered {n_dropped} of {lines}: too long {dropped['too_long']}, "
        f"ratio {dropped['ratio']}, empty {dropped['empty']}, bad UTF-8 {dropped['bad_utf8']}"
    )
    logger.info(summary)
    if n_dropped > max_fraction * lines or not kept:
        raise InputError(
            f"{summary}; more than {max_fraction:.0%} of the pairs were dropped (misaligned "
            "or wrong files? raise max_filtered_fraction or max_len to accept)"
        )


def warn_unknown(split: str, unk_rate: dict[str, float]) -> None:
    """Warn where over 1% of a side's subwords are <unk>: a vocabulary that misses the
    text (another language, another script)."""
    for side, rate in unk_rate.items():
        if rate > 0.01:
            logger.warning("%s: %.2f%% of %s subwords are <unk>", split, 100 * rate, side)


def _encode_split(
    split: str, pairs: _Pairs, vocab: Vocabulary, opts: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Encode, filter (train only) and report one split: its tensors and manifest entry."""
    src_tok, tgt_tok = side_tokenizers(vocab)
    src, tgt = _encode(src_tok, pairs.src), _encode(tgt_tok, pairs.tgt)
    lines = len(pairs.src) + sum(pairs.dropped.values())
    dropped = dict(pairs.dropped, too_long=0, ratio=0)
    keep = list(range(len(src)))
    if split == "train":  # valid and test keep every non-empty line: they are scored whole
        keep, counts = _length_filter(src, tgt, opts["max_len"], opts["max_len_ratio"])
        dropped = {k: dropped[k] + counts.get(k, 0) for k in dropped}
    check_filtered(split, dropped, lines, len(keep), opts["max_filtered_fraction"])
    data: dict[str, torch.Tensor] = {}
    for side, seqs in (("src", src), ("tgt", tgt)):
        data[f"{side}_ids"], data[f"{side}_offsets"] = _pack([seqs[i] for i in keep])
    data["line_numbers"] = torch.tensor([pairs.line_numbers[i] for i in keep], dtype=torch.int64)
    unk = {side: _unk_rate(data[f"{side}_ids"]) for side in ("src", "tgt")}
    warn_unknown(split, unk)
    return data, {
        "lines": lines,
        "pairs": len(keep),
        "dropped": dropped,
        "unk_rate": unk,
        "src_tokens": data["src_ids"].numel(),
        "tgt_tokens": data["tgt_ids"].numel(),
    }


def _write_outputs(
    out: Path, tok: Vocabulary, encoded: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]
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
    split_by_script: bool = True,
    model_type: str = "bpe",
    vocab: str = "shared",
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
        split_by_script: False lets a subword span a bracket and letters (see
            Tokenizer.train): the parsing task's linearized trees need it.
        model_type: "bpe", or "unigram" (see Tokenizer.train_from_sentences).
        vocab: "shared", the paper's one vocabulary learned on both sides; "separate", a
            vocabulary of `vocab_size` pieces for each language, learned on its own side
            (`PairTokenizer`, stored as one spm.model), for pairs in different scripts.

    Every line is held in memory: for WMT-sized corpora use
    data.stream_prepare.prepare_streaming (`aiayn prepare --streaming`).

    Returns:
        The manifest, as written to `out/manifest.json`.
    """
    if out is None:
        raise TypeError("prepare() needs an output directory `out`")
    if vocab not in ("shared", "separate"):
        raise ValueError(f"vocab must be 'shared' or 'separate', got {vocab!r}")
    if vocab == "separate" and tokenizer is not None:
        raise ValueError("a given tokenizer is one shared vocabulary: vocab must be 'shared'")
    _check_options(on_empty, on_bad_utf8, max_len, max_len_ratio, max_filtered_fraction)
    prefixes = {"train": trainpref, "valid": validpref, "test": testpref}
    inputs = find_inputs(source_lang, target_lang, prefixes)
    big = sum(p.stat().st_size for p in inputs["train"])
    if big > _BIG_INPUT:
        logger.warning(
            "%s and %s hold %.1f GB: this prepare keeps every line in memory; "
            "`aiayn prepare --streaming` (data.stream_prepare) works in bounded memory",
            *inputs["train"],
            big / 1e9,
        )
    counts = {split: check_line_counts(*paths) for split, paths in inputs.items()}
    pairs = {split: _read_pairs(*paths, on_empty, on_bad_utf8) for split, paths in inputs.items()}
    trained = tokenizer is None
    vocabulary: Vocabulary | None = tokenizer
    if vocabulary is None:  # one vocabulary for both languages, learned on training text only
        train = pairs["train"]
        if not any(line is not None and line.strip() for line in chain(train.src, train.tgt)):
            src, tgt = inputs["train"]
            raise InputError(
                f"{src} and {tgt}: no training text ({counts['train']} lines, none with a "
                "word): nothing to learn a vocabulary from"
            )
        learn = partial(
            Tokenizer.train_from_sentences,
            vocab_size=vocab_size,
            out_path=None,
            seed=seed,
            lowercase=lowercase,
            split_by_script=split_by_script,
            model_type=model_type,
        )
        if vocab == "separate":  # one per language, each on its own side
            vocabulary = PairTokenizer(learn(train.src), learn(train.tgt))
        else:
            vocabulary = learn(chain(train.src, train.tgt))
    opts = {
        "max_len": max_len,
        "max_len_ratio": max_len_ratio,
        "max_filtered_fraction": max_filtered_fraction,
    }
    assert vocabulary is not None
    encoded = {split: _encode_split(split, p, vocabulary, opts) for split, p in pairs.items()}
    # Every check has passed: only now is `out` touched, so a rejected input leaves a
    # previous preparation intact.
    out = Path(out)
    splits = _write_outputs(out, vocabulary, encoded)
    manifest = {
        "format": FORMAT_VERSION,
        "source_lang": source_lang,
        "target_lang": target_lang,
        "vocab_size": vocabulary.vocab_size,
        # only when separate, so that shared manifests (and their hashes) stay as they were
        **({"vocab": "separate"} if vocab == "separate" else {}),
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "spm_model": {"path": SPM_FILE, "sha256": vocabulary.sha256, "trained": trained},
        "settings": dict(
            opts,
            on_empty=on_empty,
            on_bad_utf8=on_bad_utf8,
            seed=seed,
            lowercase=lowercase,
            # only when set, so that translation's manifests (and their hashes) stay as they were
            **({} if split_by_script else {"split_by_script": False}),
            **({} if model_type == "bpe" else {"model_type": model_type}),
        ),
        "inputs": inputs_manifest(
            inputs, counts, {path: sha256_file(path) for ps in inputs.values() for path in ps}
        ),
        "splits": splits,
    }
    write_manifest(out, manifest)
    return manifest


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "SPLITS",
    "SPM_FILE",
    "Corpus",
    "check_line_counts",
    "find_input",
    "load_corpus",
    "load_manifest",
    "load_tokenizer",
    "prepare",
]
