"""The Wall Street Journal part of the Penn Treebank as translation pairs (section 6.3).

`prepare_treebank` reads the treebank (NLTK's sample zip, that zip unpacked, or the LDC
release's `wsj/SS/wsj_SSNN.mrg`), cleans every tree (`trees.clean`) and writes, for each
split S of train, dev and test:

    S.trees   the cleaned gold tree, one per line (what EVALB scores against)
    S.words   its words, space-separated (the source side)
    S.lin     its linearized tree (the target side): `(S (NP XX XX )NP ... )S`
    S.linw    the same with the words in their places: `(S (NP The cat )NP ... )S`

and `manifest.json`, written last. The splits go by file:

- the LDC release: the standard sections 02-21 train, 22 dev, 23 test (00, 01 and 24
  unused), as the paper's WSJ-only setting (40K training sentences);
- NLTK's sample (files wsj_0001 .. wsj_0199, sections 00 and 01 only, ~3,900 trees), which
  has none of those sections: files 0001-0159 train, 0160-0179 dev, 0180-0199 test.

`split="auto"` takes the sample's split when every file id is in 0001-0199, the LDC one
otherwise. `read_silver` and `tree_file_to_pairs` read the one-tree-per-line files of the
semi-supervised setting (parser output) the same way.
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiayn.files import (
    InputError,
    UsageError,
    atomic_write,
    check_output_file,
    remove_stale_tmp,
    sha256_file,
    write_text_atomic,
)
from aiayn.parsing.linearize import linearize
from aiayn.parsing.trees import (
    Tree,
    clean,
    decode_lines,
    read_tree_lines,
    read_trees,
    trees_from_lines,
)

logger = logging.getLogger(__name__)

SPLITS = ("train", "dev", "test")
#: Bumped whenever the cleaning or the linearization changes what is written.
PREPROCESSING_VERSION = 1
MANIFEST_FILE = "manifest.json"
#: The target files: GAFL's linearization (XX for each word) and the variant with the words.
TARGETS = {"gafl": "lin", "words": "linw"}
OUTPUT_FILES = frozenset(
    {MANIFEST_FILE}
    | {f"{s}.{ext}" for s in SPLITS for ext in ("trees", "words", *TARGETS.values())}
)
#: Where `aiayn data ptb` keeps the treebank it downloaded (NLTK's sample), inside `out`.
DOWNLOAD_DIR = "raw"

#: Inclusive ranges per split: of file numbers (wsj_NNNN) for the sample, of sections
#: (the number's first two digits) for the LDC release.
SPLIT_SCHEMES: dict[str, dict[str, tuple[int, int]]] = {
    "sample": {"train": (1, 159), "dev": (160, 179), "test": (180, 199)},
    "ldc": {"train": (2, 21), "dev": (22, 22), "test": (23, 23)},
}
_MRG = re.compile(r"(?:^|/)(wsj_(\d{4}))\.mrg$", re.IGNORECASE)
_EXPECTED = "treebank/combined/wsj_NNNN.mrg (NLTK's sample) or wsj/SS/wsj_SSNN.mrg (LDC)"


# --------------------------------------------------------------------------- reading
def _listing(source: Path) -> list[tuple[str, str]]:
    """(file id, zip member or path) of every wsj_NNNN.mrg in `source`, by file id."""
    if source.is_dir():
        found = [str(p) for p in source.rglob("*") if _MRG.search(p.as_posix()) and p.is_file()]
    elif source.is_file():
        if not zipfile.is_zipfile(source):
            raise InputError(f"{source}: not a zip archive; give the treebank zip or a directory")
        try:
            with zipfile.ZipFile(source) as z:
                found = [m for m in z.namelist() if _MRG.search(m)]
        except (zipfile.BadZipFile, OSError) as e:
            raise InputError(f"{source}: unreadable zip archive ({e})") from None
    else:
        raise InputError(f"{source}: no such file or directory")
    files: dict[str, str] = {}
    for name in found:
        m = _MRG.search(name.replace("\\", "/"))
        assert m is not None
        file_id = m.group(1).lower()
        if file_id in files:
            raise InputError(f"{source}: {file_id} found twice: {files[file_id]} and {name}")
        files[file_id] = name
    if not files:
        raise InputError(f"{source}: no treebank files in it (expected {_EXPECTED})")
    return sorted(files.items())


def read_treebank(source: str | Path) -> Iterator[tuple[str, int, Tree]]:
    """(file id like "wsj_0001", line, tree as read) for every tree of the treebank.

    Args:
        source: NLTK's treebank.zip, a directory holding it unpacked, or the LDC layout
            (its `wsj` directory or any directory above it).

    Raises:
        InputError: a malformed tree (naming the file, or zip member, and the line it
            starts on), no treebank file, or no tree in any.
    """
    source = Path(source)
    listing, n = _listing(source), 0
    if source.is_dir():
        for file_id, path in listing:
            for line, tree in read_trees(path):
                n += 1
                yield file_id, line, tree
    else:
        with zipfile.ZipFile(source) as z:
            for file_id, member in listing:
                name = f"{source}/{member}"
                try:
                    with z.open(member) as f:
                        for line, tree in trees_from_lines(decode_lines(f, name), name):
                            n += 1
                            yield file_id, line, tree
                except (zipfile.BadZipFile, OSError, zlib.error, EOFError) as e:
                    # zlib.error: the member's deflate stream is corrupt; EOFError: cut short
                    raise InputError(f"{name}: unreadable zip member, corrupt ({e})") from None
    if n == 0:
        raise InputError(f"{source}: no trees found in its {len(listing)} treebank files")


def detect_split(file_ids: list[str]) -> str:
    """ "sample" when every file is wsj_0001 .. wsj_0199 (sections 00 and 01), else "ldc"."""
    return "sample" if all(1 <= int(f[4:]) <= 199 for f in file_ids) else "ldc"


def split_of(file_id: str, scheme: str) -> str | None:
    """The split of a file under `scheme` ("sample" or "ldc"); None if unused."""
    number = int(file_id[4:])
    key = number if scheme == "sample" else number // 100
    for split, (lo, hi) in SPLIT_SCHEMES[scheme].items():
        if lo <= key <= hi:
            return split
    return None


def read_silver(path: str | Path) -> Iterator[tuple[int, Tree]]:
    """(line, cleaned tree) for a file of one tree per line (e.g. parser output for the
    semi-supervised setting), cleaned as the gold trees are; trees left with no word are
    skipped (and counted in a warning)."""
    dropped = 0
    for line, tree in read_tree_lines(path):
        cleaned = clean(tree)
        if cleaned is None:
            dropped += 1
        else:
            yield line, cleaned
    if dropped:
        logger.warning("%s: %d trees with no word after cleaning skipped", path, dropped)


def tree_file_to_pairs(
    trees_path: str | Path, words_out: str | Path, lin_out: str | Path, *, with_words: bool = False
) -> dict[str, int]:
    """Write the source (words) and target (linearized tree) files of a one-tree-per-line
    file, cleaning each tree (`read_silver`); both outputs are written atomically.
    `with_words`: the target with the words in their places (`linearize`'s `words`).

    Returns:
        {"pairs": lines written, "words": words in them}.

    Raises:
        InputError: a malformed line (FILE:LINE), or no tree at all.
        UsageError: an output that is the input, or that is the other output.
    """
    words_out = check_output_file(words_out, inputs=(trees_path,), what="words output")
    lin_out = check_output_file(lin_out, inputs=(trees_path,), what="lin output")
    if lin_out.resolve() == words_out.resolve():
        raise UsageError(f"words and lin outputs are the same file: {lin_out}")
    pairs = n_words = 0
    with atomic_write(words_out, "w") as words_f, atomic_write(lin_out, "w") as lin_f:
        for _, tree in read_silver(trees_path):
            words = tree.leaves()
            words_f.write(" ".join(words) + "\n")
            lin_f.write(linearize(tree, words=with_words) + "\n")
            pairs, n_words = pairs + 1, n_words + len(words)
        if pairs == 0:
            raise InputError(f"{trees_path}: no trees")
    return {"pairs": pairs, "words": n_words}


# --------------------------------------------------------------------------- preparing
def _check_out(out: Path) -> None:
    """Refuse, before any work, an output that is a file or a directory holding files
    this function does not write (a previous preparation is replaced)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file; give a directory to write the treebank into")
    if out.is_dir():
        foreign = sorted(
            p.name
            for p in out.iterdir()
            if p.name not in OUTPUT_FILES
            and not (p.name == DOWNLOAD_DIR and p.is_dir())
            and not (p.name.startswith(".") and p.name.endswith(".tmp"))
        )
        if foreign:
            raise UsageError(
                f"{out} holds files prepare_treebank did not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}): give a new or empty directory"
            )


def _new_split() -> dict[str, Any]:
    return {"files": set(), "lines": {"trees": [], "words": [], "lin": [], "linw": []}, "stats": {
        "trees": 0, "words": 0, "constituents": 0, "max_words": 0, "max_lin_tokens": 0,
        "dropped_empty": 0,
    }}  # fmt: skip


def _add(split: dict[str, Any], file_id: str, tree: Tree | None) -> None:
    stats = split["stats"]
    split["files"].add(file_id)
    if tree is None:
        stats["dropped_empty"] += 1
        return
    words, lin = tree.leaves(), linearize(tree)
    split["lines"]["trees"].append(tree.to_string())
    split["lines"]["words"].append(" ".join(words))
    split["lines"]["lin"].append(lin)
    split["lines"]["linw"].append(linearize(tree, words=True))
    stats["trees"] += 1
    stats["words"] += len(words)
    stats["constituents"] += tree.constituents()
    stats["max_words"] = max(stats["max_words"], len(words))
    stats["max_lin_tokens"] = max(stats["max_lin_tokens"], len(lin.split()))


def _describe(scheme: str, requested: str) -> str:
    ranges = SPLIT_SCHEMES[scheme]
    if scheme == "sample":
        parts = [f"{s} wsj_{lo:04d}-wsj_{hi:04d}" for s, (lo, hi) in ranges.items()]
        what = "NLTK's WSJ sample (files wsj_0001-wsj_0199 only), split by file"
    else:
        parts = [f"{s} sections {lo:02d}-{hi:02d}" for s, (lo, hi) in ranges.items()]
        what = "the LDC release, standard sections"
    how = "detected" if requested == "auto" else "as requested"
    return f"{what} ({how}): {', '.join(parts)}"


#: One-tree-per-line files as constituency parsers ship the WSJ (Stern et al.'s and Kitaev
#: and Klein's `02-21.10way.clean`, `22.auto.clean`, `23.auto.clean`, each tree with or
#: without an outer `(TOP ...)` or `( ...)`), found by name in a --from directory.
LINE_FILES: dict[str, tuple[str, ...]] = {
    "train": ("02-21.10way.clean", "02-21.clean", "train.clean"),
    "dev": ("22.auto.clean", "22.clean", "dev.clean"),
    "test": ("23.auto.clean", "23.clean", "test.clean"),
}


def line_files(source: Path) -> dict[str, Path]:
    """The one-tree-per-line split files of a directory, by `LINE_FILES`' names ({} if it
    holds none); an InputError if it holds some splits' files but not all."""
    found = {}
    for name, candidates in LINE_FILES.items():
        for candidate in candidates:
            if (source / candidate).is_file():
                found[name] = source / candidate
                break
    if found and len(found) < len(SPLITS):
        missing = [s for s in SPLITS if s not in found]
        raise InputError(
            f"{source}: no {' or '.join(missing)} file among the one-tree-per-line files "
            f"({', '.join(p.name for p in found.values())}); expected "
            + "; ".join(f"{s}: {' or '.join(LINE_FILES[s])}" for s in missing)
            + " (or name each split's file with --train, --dev and --test)"
        )
    return found


def _prepare_lines(files: dict[str, Path], out: Path, source: Path | None) -> dict:
    """`prepare_treebank` for one-tree-per-line files, one per split."""
    splits = {s: _new_split() for s in SPLITS}
    for name in SPLITS:
        path = files[name]
        if not path.is_file():
            raise InputError(f"{path}: no such file (the {name} split)")
        for _, tree in read_tree_lines(path):
            _add(splits[name], path.name, clean(tree))
        if splits[name]["stats"]["trees"] == 0:
            raise InputError(f"{path}: no tree with a word (the {name} split)")
    summary = "one tree a line: " + ", ".join(f"{s} {files[s].name}" for s in SPLITS)
    source_info = {
        "path": None if source is None else str(source.resolve()),
        "kind": "lines",
        "files": {s: str(files[s].resolve()) for s in SPLITS},
        "sha256": {s: sha256_file(files[s]) for s in SPLITS},
    }
    return _write(splits, out, source_info, {"scheme": "files", "summary": summary}, None)


def prepare_treebank(
    source: str | Path | None,
    out: str | Path,
    *,
    split: str = "auto",
    files: dict[str, Path] | None = None,
) -> dict:
    """Write the cleaned, split and linearized treebank into `out` (see the module
    docstring); files a previous run wrote there are replaced, the manifest last.

    Args:
        source: as for `read_treebank`; or a directory of one-tree-per-line files named as
            `LINE_FILES` says (`02-21.10way.clean`, `22.auto.clean`, `23.auto.clean`).
        out: the output directory (created); it may hold only files this function writes.
        split: "auto", "sample" or "ldc" (see SPLIT_SCHEMES), for .mrg files.
        files: one-tree-per-line files by split ("train", "dev", "test"), instead.

    Returns:
        The manifest, as written to `out/manifest.json`.

    Raises:
        UsageError: `out` is a file or holds other files (before any work).
        InputError: a malformed tree (file and line), no trees, or an empty split.
    """
    out = Path(out)
    if split not in ("auto", *SPLIT_SCHEMES):
        raise ValueError(f"split must be 'auto', 'sample' or 'ldc', got {split!r}")
    _check_out(out)
    has_mrg = (
        source is not None
        and Path(source).is_dir()
        and any(_MRG.search(p.as_posix()) for p in Path(source).rglob("*.mrg"))
    )
    if files is None and source is not None and Path(source).is_dir() and not has_mrg:
        files = line_files(Path(source)) or None
    if files is not None:
        return _prepare_lines(files, out, None if source is None else Path(source))
    if source is None:
        raise ValueError("prepare_treebank needs a source or split files")
    source = Path(source)
    if source.is_file() and not zipfile.is_zipfile(source):
        raise InputError(
            f"{source}: not a zip archive; a file of one tree a line is one split: give "
            "the directory holding the three (02-21.10way.clean, 22.auto.clean, "
            "23.auto.clean), or name each with --train, --dev and --test"
        )
    file_ids = [file_id for file_id, _ in _listing(source)]
    scheme = detect_split(file_ids) if split == "auto" else split
    splits = {s: _new_split() for s in SPLITS}
    unused = _new_split()
    for file_id, _, tree in read_treebank(source):
        name = split_of(file_id, scheme)
        _add(splits[name] if name else unused, file_id, clean(tree))
    for name, data in splits.items():
        if data["stats"]["trees"] == 0:
            raise InputError(
                f"{source}: the {name} split is empty under the {scheme} split "
                f"({_describe(scheme, split)})"
            )
    source_info = {
        "path": str(source.resolve()),
        "kind": "directory" if source.is_dir() else "zip",
        "sha256": None if source.is_dir() else sha256_file(source),
        "treebank_files": len(file_ids),
    }
    split_info = {"scheme": scheme, "requested": split, "summary": _describe(scheme, split)}
    return _write(splits, out, source_info, split_info, unused)


def _write(
    splits: dict[str, dict[str, Any]],
    out: Path,
    source_info: dict[str, Any],
    split_info: dict[str, Any],
    unused: dict[str, Any] | None,
) -> dict:
    """The split files, then the manifest (last: it vouches for the rest)."""
    # Every check has passed: only now is `out` touched.
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # no manifest over a mix of old and new
    remove_stale_tmp(out)
    hashes = {}
    for name, data in splits.items():
        for ext, lines in data["lines"].items():
            path = out / f"{name}.{ext}"
            write_text_atomic(path, "".join(line + "\n" for line in lines))
            hashes[path.name] = sha256_file(path)
    summary = split_info["summary"]
    manifest = {
        "preprocessing_version": PREPROCESSING_VERSION,
        "source": source_info,
        "split": split_info,
        "splits": {
            name: dict(data["stats"], files=len(data["files"])) for name, data in splits.items()
        },
        "unused": {
            "files": 0 if unused is None else len(unused["files"]),
            "trees": 0 if unused is None else unused["stats"]["trees"],
        },
        "files": hashes,
    }
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    write_text_atomic(out / MANIFEST_FILE, text)  # last: it vouches for the rest
    logger.info("%s: %s", out, summary)
    return manifest
