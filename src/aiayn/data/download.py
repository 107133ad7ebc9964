"""Fetch Multi30k task 1 (Elliott et al. 2016), the small En-De/Fr/Cs corpus we use in
place of WMT14 (section 5.1) for experiments that fit on one machine.

Every file is checked against a pinned sha256 where we know one; a mismatch is an error and
the bad file never reaches its final name (downloads go to a temporary file that is renamed
only after verification). Files without a pinned hash are accepted with a warning and their
hash is recorded in `out/SHA256SUMS`, so later runs detect a change. A local directory can
stand in for the network (`from_dir`), with the same checks.
"""

from __future__ import annotations

import hashlib
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.client import HTTPException
from pathlib import Path
from typing import IO

from aiayn.files import InputError, atomic_write, sha256_file, write_text_atomic

logger = logging.getLogger(__name__)

BASE_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
SPLITS = (
    "train",
    "val",
    "test_2016_flickr",
    "test_2017_flickr",
    "test_2017_mscoco",
    "test_2018_flickr",
)
LANGS = ("en", "de", "fr", "cs")
SUMS_FILE = "SHA256SUMS"

#: (split, lang) pairs the repository publishes: Czech was added later for fewer splits.
PUBLISHED: frozenset[tuple[str, str]] = frozenset(
    {(s, lang) for s in ("train", "val", "test_2016_flickr", "test_2018_flickr") for lang in LANGS}
    | {(s, lang) for s in ("test_2017_flickr", "test_2017_mscoco") for lang in ("en", "de", "fr")}
)

#: sha256 of the files whose contents we have verified (see shared/data/README.md).
PINNED_SHA256: dict[str, str] = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
}


class DownloadError(InputError):
    """A file could not be fetched; the message names it and its source."""


class ChecksumError(DownloadError):
    """A fetched file's sha256 differs from the pinned one."""


class _MissingError(Exception):
    """The source has no such file (HTTP 404 or absent from `from_dir`)."""


def _read_sums(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    sums = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        if name:
            sums[name] = digest
    return sums


def _copy(src: IO[bytes], out: IO[bytes]) -> tuple[str, int]:
    """Copy a stream, hashing it on the way; return the sha256 and the size."""
    h, size = hashlib.sha256(), 0
    for chunk in iter(lambda: src.read(1 << 20), b""):
        h.update(chunk)
        out.write(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def _copy_from(source: str, out: IO[bytes], from_dir: Path | None, timeout: float) -> str:
    """Copy `source` (a file name under from_dir, or a URL) into `out`; return its sha256."""
    if from_dir is not None:
        path = from_dir / source
        if not path.is_file():
            raise _MissingError(str(path))
        with open(path, "rb") as f:
            return _copy(f, out)[0]
    try:
        with urllib.request.urlopen(source, timeout=timeout) as response:
            digest, size = _copy(response, out)
            expected_size = response.headers.get("Content-Length")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise _MissingError(source) from None
        raise DownloadError(f"{source}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as e:
        raise DownloadError(
            f"{source}: {getattr(e, 'reason', e)} (offline? give a local copy with --from DIR)"
        ) from None
    # A dropped connection can look like a clean end of stream; the length catches it
    # even for files without a pinned hash.
    if expected_size is not None and int(expected_size) != size:
        raise DownloadError(f"{source}: truncated download, {size} of {expected_size} bytes")
    return digest


def _fetch(
    name: str,
    dest: Path,
    expected: str | None,
    from_dir: Path | None,
    base_url: str,
    timeout: float,
) -> str:
    """Fetch one file to `dest` via a temporary file; return its sha256.

    The hash is checked inside `atomic_write`, so on a mismatch the temporary file is
    removed and the final name is never bound to unverified bytes.
    """
    source = name if from_dir is not None else base_url + name
    with atomic_write(dest) as f:
        digest = _copy_from(source, f, from_dir, timeout)
        if expected is not None and digest != expected:
            pinned = "pinned" if name in PINNED_SHA256 else f"recorded in {SUMS_FILE}"
            raise ChecksumError(
                f"{name} from {from_dir or base_url}: sha256 mismatch: "
                f"expected {expected} ({pinned}), found {digest}; not kept"
            )
    return digest


def _wanted(splits: Sequence[str] | None, langs: Sequence[str] | None) -> list[tuple[str, bool]]:
    """File names to fetch, each with whether its absence is an error.

    Only a file named by both an explicit split and an explicit language is required;
    with defaults we skip what the repository does not publish.
    """
    explicit = splits is not None and langs is not None
    wanted = []
    for split in splits if splits is not None else SPLITS:
        for lang in langs if langs is not None else LANGS:
            if explicit or (split, lang) in PUBLISHED:
                wanted.append((f"{split}.{lang}.gz", explicit))
    return wanted


def _fetch_one(
    name: str,
    required: bool,
    out: Path,
    sums: dict[str, str],
    from_dir: Path | None,
    base_url: str,
    timeout: float,
) -> Path | None:
    """Make `out/name` a verified copy; None if the source lacks an optional file."""
    path = out / name
    # A hash recorded on first download acts as a pin afterwards (trust on first use).
    expected = PINNED_SHA256.get(name, sums.get(name))
    if path.is_file() and expected is not None:
        if sha256_file(path) == expected:
            logger.info("%s: present and verified", path)
            return path
        logger.warning("%s: present but its sha256 differs; fetching it again", path)
    try:
        logger.info("fetching %s", name)
        sums[name] = _fetch(name, path, expected, from_dir, base_url, timeout)
        logger.info("%s: %d bytes, sha256 %s", path, path.stat().st_size, sums[name])
    except _MissingError as e:
        if required:
            raise DownloadError(f"{name}: requested but not found at {e}") from None
        logger.warning("%s: not found at %s; skipped", name, e)
        return None
    if expected is None:
        logger.warning(
            "%s: no pinned sha256 to verify it against; recorded %s in %s",
            name,
            sums[name],
            out / SUMS_FILE,
        )
    return path


def download_multi30k(
    out: str | Path,
    from_dir: str | Path | None = None,
    splits: Sequence[str] | None = None,
    langs: Sequence[str] | None = None,
    *,
    base_url: str = BASE_URL,
    timeout: float = 60.0,
) -> list[Path]:
    """Download (or copy) Multi30k task-1 raw files into `out`, verified.

    Args:
        out: destination directory (created).
        from_dir: copy from this directory instead of the network.
        splits: subset of SPLITS; None means all.
        langs: subset of LANGS; None means all the repository publishes for each split.
        base_url: where the files live (tests point it at a local server).
        timeout: seconds before a stalled connection is abandoned.

    Returns:
        Paths of the files present and verified in `out`, in request order.

    Raises:
        ChecksumError: a file differs from its pinned hash (it is not left in `out`).
        DownloadError: a network failure, or a file requested by split and language
            that the source does not have.
    """
    out, source_dir = Path(out), None if from_dir is None else Path(from_dir)
    unknown = sorted(set(splits or ()) - set(SPLITS)) + sorted(set(langs or ()) - set(LANGS))
    if unknown:
        raise ValueError(f"unknown Multi30k split/lang {unknown}; splits: {SPLITS}, langs: {LANGS}")
    if source_dir is not None and source_dir.exists() and not source_dir.is_dir():
        raise InputError(f"{source_dir}: not a directory: give the one that holds the corpus")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: is a file; give a directory to write the corpus into")
    out.mkdir(parents=True, exist_ok=True)
    sums = _read_sums(out / SUMS_FILE)
    done = []
    try:
        for name, required in _wanted(splits, langs):
            path = _fetch_one(name, required, out, sums, source_dir, base_url, timeout)
            if path is not None:
                sums[name] = PINNED_SHA256.get(name, sums.get(name, ""))
                done.append(path)
    finally:  # keep the hashes of what did arrive, even if a later file failed
        write_text_atomic(out / SUMS_FILE, "".join(f"{sums[n]}  {n}\n" for n in sorted(sums)))
    if not done:
        where = source_dir if source_dir is not None else base_url
        raise DownloadError(f"{where}: none of the requested Multi30k files is there")
    return done


#: NLTK's Penn Treebank sample (WSJ files 0001-0199, ~3,900 trees; non-commercial, fair use:
#: see the README inside the zip), the treebank the parsing recipe trains on here.
PTB_SAMPLE_URL = (
    "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/corpora/treebank.zip"
)
PTB_SAMPLE_NAME = "treebank.zip"
PTB_SAMPLE_SHA256 = "9da92d76c3666cfb6cddeaed0f7e86b344cce0f0928a286d439e555f19c37399"


def download_ptb_sample(
    out: str | Path, *, url: str = PTB_SAMPLE_URL, timeout: float = 60.0
) -> Path:
    """Download NLTK's Penn Treebank sample to `out/treebank.zip`, verified by its sha256.

    A verified copy already there is kept. Users with the LDC release pass its directory
    to `aiayn data ptb --from` instead.

    Raises:
        ChecksumError: the download differs from the pinned hash (it is not kept).
        DownloadError: a network failure.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: is a file; give a directory to write the treebank into")
    out.mkdir(parents=True, exist_ok=True)
    path = out / PTB_SAMPLE_NAME
    if path.is_file() and sha256_file(path) == PTB_SAMPLE_SHA256:
        logger.info("%s: present and verified", path)
        return path
    logger.info("fetching %s", url)
    with atomic_write(path) as f:
        try:
            digest = _copy_from(url, f, None, timeout)
        except _MissingError:
            raise DownloadError(f"{url}: not found (HTTP 404)") from None
        if digest != PTB_SAMPLE_SHA256:
            raise ChecksumError(
                f"{url}: sha256 mismatch: expected {PTB_SAMPLE_SHA256} (pinned), "
                f"found {digest}; not kept"
            )
    return path
