"""A prepared data directory, read back: its manifest, vocabulary and the id tensors of each
split, each checked against the sha256 the manifest records (`aiayn.data.prepare` writes
them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.files import InputError, sha256_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
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
