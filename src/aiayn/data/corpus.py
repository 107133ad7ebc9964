"""A prepared data directory, read back: its manifest, vocabulary and the id tensors of each
split, each checked against the sha256 the manifest records (`aiayn.data.prepare` writes
them)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from aiayn.data.pairs import Corpus
from aiayn.data.tokenizer import Vocabulary, load_vocabulary
from aiayn.files import InputError, sha256_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: `prepare --streaming`: each split as memory-mapped .npy arrays (data.mmap_corpus).
MMAP_FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
SPM_FILE = "spm.model"
SPLITS = ("train", "valid", "test")


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
    if manifest.get("format") not in (FORMAT_VERSION, MMAP_FORMAT_VERSION):
        raise InputError(
            f"{path}: format {manifest.get('format')!r}, expected "
            f"{FORMAT_VERSION} or {MMAP_FORMAT_VERSION}; re-run `aiayn prepare`"
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


def load_tokenizer(data_dir: str | Path) -> Vocabulary:
    """The vocabulary `prepare` wrote (one shared, or a separate pair), checked against
    the manifest's hash."""
    entry = load_manifest(data_dir)["spm_model"]
    return load_vocabulary(_verified(Path(data_dir), entry["path"], entry["sha256"]))


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
    if manifest["format"] == MMAP_FORMAT_VERSION:
        from aiayn.data.mmap_corpus import MmapCorpus

        for f in entry["files"].values():  # sizes first: a truncated file says so
            p = data_dir / f["path"]
            if p.is_file() and p.stat().st_size != f["bytes"]:
                raise InputError(
                    f"{p}: {p.stat().st_size} bytes, the manifest expects {f['bytes']}: "
                    "truncated or replaced; re-run `aiayn prepare --streaming`"
                )
            _verified(data_dir, f["path"], f["sha256"])  # streamed, 1 MiB at a time
        return MmapCorpus(data_dir, split)
    path = _verified(data_dir, entry["path"], entry["sha256"])
    return Corpus(torch.load(path, weights_only=True), name=str(path))


def has_split(data_dir: str | Path, split: str) -> bool:
    """Whether `prepare` wrote `split` (its file, for the .pt format, as trainers checked)."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest["format"] == MMAP_FORMAT_VERSION:
        return split in manifest["splits"]
    return (data_dir / f"{split}.pt").exists()


def split_sha256(data_dir: str | Path, split: str) -> str:
    """The identity of a prepared split that checkpoints record: the sha256 of SPLIT.pt,
    or for memory-mapped splits the sha256 of their files' hashes (from the manifest,
    which load_corpus has checked them against), so nothing is read twice."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest["format"] == MMAP_FORMAT_VERSION:
        files = manifest["splits"][split]["files"]
        joined = "\n".join(f"{k} {files[k]['sha256']}" for k in sorted(files))
        return hashlib.sha256(joined.encode()).hexdigest()
    return sha256_file(data_dir / f"{split}.pt")
