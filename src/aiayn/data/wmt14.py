"""Fetch WMT14 English-German or English-French (section 5.1), verified, as aligned text.

The corpora are those section 5.1 names and the toolkits that reproduced it use:
En-De is Europarl v7 + Common Crawl + News Commentary v9 (~4.5M pairs; fairseq's
prepare-wmt14en2de.sh with --icml17, tensorflow_datasets' wmt14_translate/de-en);
En-Fr adds the UN corpus and the 10^9 French-English (Giga-fren) corpus (~40.8M lines
before cleaning, the paper's "36M sentences" after; fairseq's prepare-wmt14en2fr.sh,
tensorflow_datasets' wmt14_translate/fr-en). Dev is newstest2013 and test the full
newstest2014 (3003 sentences, sacreBLEU's `wmt14/full`), taken from the SGML files that
sacreBLEU scores against, so `sacrebleu -t wmt14/full -l en-de` and our test.de agree.

Every archive is checked against a hash published by one of those projects (the table
ARCHIVES names each source); a mismatch is an error and the archive is not kept. Downloads
go to NAME.part and continue from where they stopped (HTTP Range); `from_dir` reads the
archives from a local mirror instead, with the same checks. Members are streamed out of
the archives (nothing is unpacked to disk), each corpus's two sides are checked to have
the same number of lines, and the outputs are written atomically: OUT/train.{en,de|fr},
valid.* (newstest2013), test.* (newstest2014) and OUT/wmt14.json saying what came from
where, with counts.

Long because it is one concern end to end: the table of archives and their published
hashes, the resumable download, the SGML reader, the streaming extraction and the stamp
that makes a finished run a no-op; each part is used by the next alone.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import IO, Any

from aiayn.data.download import ChecksumError, DownloadError
from aiayn.files import (
    InputError,
    UsageError,
    atomic_write,
    fsync_dir,
    remove_stale_tmp,
    write_text_atomic,
)

logger = logging.getLogger(__name__)

STAMP_FILE = "wmt14.json"
DOWNLOAD_DIR = "downloads"
_CHUNK = 1 << 20

_TFDS = "tensorflow/datasets"
_SACREBLEU = "mjpost/sacrebleu"


@dataclass(frozen=True)
class Archive:
    """One published file and the hash a third party published for it.

    `algo` is "sha256" or "md5" (whichever the source publishes); `digest` None means no
    published hash was found: such a file is accepted with a warning and its sha256 is
    recorded in the stamp (none of the files below is in that state).
    """

    name: str
    url: str
    size: int | None
    algo: str
    digest: str | None
    source: str


#: The pinned table. Sizes and sha256 are tensorflow_datasets' url_checksums (its `wmt13`,
#: `wmt14` and `wmt15` builders download the same URLs); the test sets' md5 are sacreBLEU's
#: DATASETS table (`wmt13`, `wmt14/full`), whose sizes are not published.
ARCHIVES: dict[str, Archive] = {
    a.name: a
    for a in (
        Archive(
            "training-parallel-europarl-v7.tgz",
            "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
            657_632_379,
            "sha256",
            "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
            f"{_TFDS} tensorflow_datasets/url_checksums/wmt14_translate.txt "
            "(commit 90b66237ad09c9e5b9b1bc61b646db7b1fb0713c)",
        ),
        Archive(
            "training-parallel-commoncrawl.tgz",
            "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
            918_311_367,
            "sha256",
            "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
            f"{_TFDS} tensorflow_datasets/url_checksums/wmt14_translate.txt "
            "(commit 90b66237ad09c9e5b9b1bc61b646db7b1fb0713c)",
        ),
        Archive(
            "training-parallel-nc-v9.tgz",
            "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
            80_418_416,
            "sha256",
            "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
            f"{_TFDS} tensorflow_datasets/url_checksums/wmt14_translate.txt "
            "(commit 90b66237ad09c9e5b9b1bc61b646db7b1fb0713c)",
        ),
        Archive(
            "training-parallel-un.tgz",
            "http://www.statmt.org/wmt13/training-parallel-un.tgz",
            2_365_634_246,
            "sha256",
            "29141b5c1eba149a94f7a59d3b1a834b2e47fe0f8758d68dcd77a3d3f497ee47",
            f"{_TFDS} tensorflow_datasets/url_checksums/wmt13_translate.txt "
            "(commit 90b66237ad09c9e5b9b1bc61b646db7b1fb0713c; same in wmt15_translate.txt)",
        ),
        Archive(
            "training-giga-fren.tar",
            "http://www.statmt.org/wmt10/training-giga-fren.tar",
            2_595_102_720,
            "sha256",
            "3ff8319f6919393520559bfbc7ad6a747ec81b3abc7be9993b338d4b017b4d9a",
            f"{_TFDS} tensorflow_datasets/url_checksums/wmt13_translate.txt "
            "(commit 90b66237ad09c9e5b9b1bc61b646db7b1fb0713c; same in wmt15_translate.txt)",
        ),
        Archive(
            "test.tgz",
            "http://statmt.org/wmt13/test.tgz",
            None,
            "md5",
            "48eca5d02f637af44e85186847141f67",
            f"{_SACREBLEU} sacrebleu/dataset/__init__.py, DATASETS['wmt13'] "
            "(commit 5166cf77b880ddd6d677f9243bcc4b4cb233cc90)",
        ),
        Archive(
            "test-full.tgz",
            "http://statmt.org/wmt14/test-full.tgz",
            None,
            "md5",
            "a8cd784e006feb32ac6f3d9ec7eb389a",
            f"{_SACREBLEU} sacrebleu/dataset/__init__.py, DATASETS['wmt14/full'] "
            "(commit 5166cf77b880ddd6d677f9243bcc4b4cb233cc90)",
        ),
    )
}


@dataclass(frozen=True)
class Corpus:
    """One parallel text: the archive holding it and, per language, its member.

    kind: "text" (one sentence a line), "gz" (the same, gzipped inside the archive) or
    "sgml" (a WMT test set: one sentence per <seg>).
    """

    name: str
    archive: str
    members: dict[str, str]
    kind: str = "text"


@dataclass(frozen=True)
class PairSpec:
    train: tuple[Corpus, ...]
    valid: Corpus
    test: Corpus
    lang: str  # the non-English side
    expected_segments: dict[str, int] = field(default_factory=dict)


def _pair(lang: str) -> PairSpec:
    """The corpora for en-LANG, member names as in the statmt.org archives (the same paths
    fairseq's scripts and tensorflow_datasets' wmt.py read)."""
    x = f"{lang}-en"
    train = [
        Corpus(
            "europarl-v7",
            "training-parallel-europarl-v7.tgz",
            {"en": f"training/europarl-v7.{x}.en", lang: f"training/europarl-v7.{x}.{lang}"},
        ),
        Corpus(
            "commoncrawl",
            "training-parallel-commoncrawl.tgz",
            {"en": f"commoncrawl.{x}.en", lang: f"commoncrawl.{x}.{lang}"},
        ),
    ]
    if lang == "fr":
        train.append(
            Corpus(
                "un",
                "training-parallel-un.tgz",
                {"en": f"un/undoc.2000.{x}.en", lang: f"un/undoc.2000.{x}.{lang}"},
            )
        )
    train.append(
        Corpus(
            "news-commentary-v9",
            "training-parallel-nc-v9.tgz",
            {
                "en": f"training/news-commentary-v9.{x}.en",
                lang: f"training/news-commentary-v9.{x}.{lang}",
            },
        )
    )
    if lang == "fr":
        train.append(
            Corpus(
                "giga-fren",
                "training-giga-fren.tar",
                {"en": "giga-fren.release2.fixed.en.gz", "fr": "giga-fren.release2.fixed.fr.gz"},
                kind="gz",
            )
        )
    code = f"{lang}en"
    return PairSpec(
        train=tuple(train),
        valid=Corpus(
            "newstest2013",
            "test.tgz",
            {"en": "test/newstest2013-src.en.sgm", lang: f"test/newstest2013-src.{lang}.sgm"},
            kind="sgml",
        ),
        test=Corpus(
            "newstest2014",
            "test-full.tgz",
            {
                "en": f"test-full/newstest2014-{code}-src.en.sgm",
                lang: f"test-full/newstest2014-{code}-ref.{lang}.sgm",
            },
            kind="sgml",
        ),
        lang=lang,
        # sacreBLEU's and tensorflow_datasets' published counts; a different count is a
        # warning (the hash already vouches for the bytes, so it would be our parser).
        expected_segments={"newstest2013": 3000, "newstest2014": 3003},
    )


PAIRS: dict[str, PairSpec] = {"en-de": _pair("de"), "en-fr": _pair("fr")}

#: Rough sizes for --help and the disk check: archives to fetch, text written (bytes).
SIZES: dict[str, tuple[int, int]] = {
    "en-de": (1_660_000_000, 1_400_000_000),
    "en-fr": (6_620_000_000, 13_000_000_000),
}


def archives_for(pair: str) -> list[Archive]:
    """The archives a pair needs, in the order they are used."""
    spec = PAIRS[pair]
    names = dict.fromkeys(c.archive for c in (*spec.train, spec.valid, spec.test))
    return [ARCHIVES[n] for n in names]


# --------------------------------------------------------------------------- SGML test sets
_SEG_OPEN = re.compile(r"<seg\b[^>]*>", re.I)
_SEG_CLOSE = re.compile(r"</seg\s*>", re.I)
_DOC_OPEN = re.compile(r"<doc\b", re.I)
_ENTITY = re.compile(r"&(?:(amp|lt|gt|quot|apos)|#([0-9]+)|#[xX]([0-9a-fA-F]+));")
_EMPTY_LINE = re.compile(rb"\n(?=\n)")  # a newline that starts an empty line
_NAMED = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


@dataclass
class SgmlText:
    segments: list[str]
    docs: int
    entities: int  # entity references replaced by their characters


def unescape_entities(text: str) -> tuple[str, int]:
    """Replace XML's five named entities and numeric character references; return the text
    and how many were replaced.

    Stricter than html.unescape on purpose: WMT's SGML files mostly hold raw `&` (sacreBLEU
    and Moses' input-from-sgm.perl unescape nothing), so only a complete reference ending in
    `;` is taken for one; `AT&T` or `&copy` stay as written.
    """
    count = 0

    def sub(m: re.Match[str]) -> str:
        nonlocal count
        if m.group(1):
            count += 1
            return _NAMED[m.group(1)]
        code = int(m.group(2)) if m.group(2) else int(m.group(3), 16)
        if not 0 < code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            return m.group(0)
        count += 1
        return chr(code)

    return _ENTITY.sub(sub, text), count


def parse_sgml(text: str, where: str) -> SgmlText:
    """The <seg> contents of a WMT SGML file in file order, one sentence each.

    Whitespace is trimmed and runs of it collapsed to one space, as sacreBLEU and Moses do.
    Not an XML parser: the WMT files are not well formed (raw `&`), so segments are found
    by their tags, which also handles several per line or one across lines. A <seg> with
    no </seg> before the next <seg> is an InputError naming the file and line.
    """
    opens = list(_SEG_OPEN.finditer(text))
    segments, entities = [], 0
    for i, m in enumerate(opens):
        limit = opens[i + 1].start() if i + 1 < len(opens) else len(text)
        close = _SEG_CLOSE.search(text, m.end(), limit)
        if close is None:
            line = text.count("\n", 0, m.start()) + 1
            raise InputError(f"{where}:{line}: {m.group(0)} has no </seg>")
        body, k = unescape_entities(text[m.end() : close.start()])
        entities += k
        segments.append(" ".join(body.split()))
    return SgmlText(segments, len(_DOC_OPEN.findall(text)), entities)


# --------------------------------------------------------------------------- hashing and fetching
def _progress(total: int | None, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, dynamic_ncols=True)


def _hashes(path: Path) -> tuple[str, str]:
    """(sha256, md5) of a file, in one read."""
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f, _progress(path.stat().st_size, f"verify {path.name}") as bar:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            sha.update(chunk)
            md5.update(chunk)
            bar.update(len(chunk))
    return sha.hexdigest(), md5.hexdigest()


def verify(path: Path, archive: Archive, where: str) -> str:
    """Check `path` against the archive's pinned hash; return its sha256.

    Raises ChecksumError naming the file, where it came from, the expected and the found
    digest. A file without a pinned hash passes with a warning.
    """
    sha, md5 = _hashes(path)
    if archive.digest is None:
        logger.warning(
            "%s: no published hash to verify it against (UNVERIFIED); sha256 %s recorded in %s",
            path,
            sha,
            STAMP_FILE,
        )
        return sha
    found = sha if archive.algo == "sha256" else md5
    if found != archive.digest:
        raise ChecksumError(
            f"{archive.name} from {where}: {archive.algo} mismatch: expected {archive.digest} "
            f"(published in {archive.source}), found {found}; not used"
        )
    return sha


def _download(url: str, part: Path, size: int | None, timeout: float) -> None:
    """Fetch `url` into `part`, continuing a partial `part` with an HTTP Range request.

    A server that ignores the Range (200 instead of 206) is read from the start. A stream
    that ends early raises DownloadError and leaves `part` for the next run to continue.
    """
    have = part.stat().st_size if part.is_file() else 0
    if size is not None and have > size:
        logger.warning("%s: %d bytes, more than the %d published; starting over", part, have, size)
        part.unlink()
        have = 0
    if size is not None and have == size:
        return  # complete; the hash decides whether it is right
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing after `have`: the part is whole (or too long)
            return
        if e.code == 404:
            raise DownloadError(f"{url}: not found (HTTP 404)") from None
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as e:
        raise DownloadError(
            f"{url}: {getattr(e, 'reason', e)} (offline? give --from with a local mirror)"
        ) from None
    with response:
        resumed = have > 0 and response.status == 206
        if have and not resumed:
            logger.warning("%s: the server ignored the range request; fetching it whole", url)
            have = 0
        elif resumed:
            answered = response.headers.get("Content-Range", "")
            if not answered.startswith(f"bytes {have}-"):
                part.unlink()
                raise DownloadError(
                    f"{url}: asked for bytes from {have}, the server sent {answered!r}; "
                    f"removed {part}: run again to fetch it whole"
                )
            logger.info("%s: continuing from byte %d", url, have)
        length = response.headers.get("Content-Length")
        expected = have + int(length) if length is not None else size
        got = have
        try:
            with (
                open(part, "ab" if resumed else "wb") as f,
                _progress(expected, f"fetch {part.name.removesuffix('.part')}") as bar,
            ):
                bar.update(have)
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    f.write(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        except (TimeoutError, ConnectionError, HTTPException) as e:
            raise DownloadError(
                f"{url}: connection lost after {got} bytes ({e}); run again to continue from {part}"
            ) from None
    if expected is not None and got != expected:
        raise DownloadError(
            f"{url}: truncated, {got} of {expected} bytes; run again to continue from {part}"
        )


def fetch(
    archive: Archive,
    downloads: Path,
    *,
    url: str | None = None,
    timeout: float = 60.0,
) -> tuple[Path, str]:
    """Make downloads/NAME a verified copy of the archive; return it and its sha256.

    A verified copy already there is kept. The bytes arrive in NAME.part, which a later
    call continues; the part becomes NAME only once its hash matches. A part whose hash
    does not match is deleted (resuming it could never succeed) and ChecksumError raised.
    """
    url = url or archive.url
    final, part = downloads / archive.name, downloads / f"{archive.name}.part"
    if final.is_file():
        try:
            return final, verify(final, archive, str(final))
        except ChecksumError as e:
            logger.warning("%s; fetching it again", e)
            final.unlink()
    downloads.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s", url)
    _download(url, part, archive.size, timeout)
    try:
        sha = verify(part, archive, url)
    except ChecksumError:
        part.unlink()
        raise
    os.replace(part, final)
    fsync_dir(downloads)
    return final, sha


def locate(archive: Archive, from_dir: Path) -> tuple[Path, str]:
    """The archive in a local mirror, verified in place (not copied); return it and its sha256."""
    path = from_dir / archive.name
    if not path.is_file():
        raise DownloadError(
            f"{path}: not in the mirror (fetch {archive.url} into {from_dir}, or drop --from)"
        )
    return path, verify(path, archive, str(path))


# --------------------------------------------------------------------------- extraction
class _Counting:
    """A read-only stream that advances a progress bar by the bytes read through it."""

    def __init__(self, f: IO[bytes], bar: Any) -> None:
        self.f, self.bar = f, bar

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bar.update(len(data))
        return data


@contextlib.contextmanager
def _members(path: Path, wanted: set[str]) -> Iterator[Iterator[tuple[str, IO[bytes]]]]:
    """Stream the wanted members of a tar/tgz in archive order, one pass, nothing on disk.

    Member names are compared without a leading "./". After the pass, a wanted member
    that the archive lacks is an InputError naming the archive and the member.
    """
    with (
        open(path, "rb") as raw,
        _progress(path.stat().st_size, f"read {path.name}") as bar,
    ):
        try:
            # "r|*": one forward pass over a gzip or a plain tar; closed after the pass
            tar = tarfile.open(  # type: ignore[call-overload]  # noqa: SIM115
                fileobj=_Counting(raw, bar), mode="r|*"
            )
        except tarfile.TarError as e:
            raise InputError(f"{path}: not a tar archive ({e})") from None

        def gen() -> Iterator[tuple[str, IO[bytes]]]:
            seen: set[str] = set()
            try:
                for info in tar:
                    name = info.name.removeprefix("./")
                    if name in wanted and info.isfile():
                        f = tar.extractfile(info)
                        assert f is not None
                        seen.add(name)
                        yield name, f
            except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
                raise InputError(f"{path}: truncated or corrupt archive ({e})") from None
            missing = sorted(wanted - seen)
            if missing:
                raise InputError(f"{path}: has no member {', '.join(missing)}")

        with tar:
            yield gen()


def _copy_lines(src: IO[bytes], out: IO[bytes]) -> tuple[int, int]:
    """Append a text stream to `out`, ending it with a newline; return (lines, empty lines).

    Lines are split on b"\\n" only, as `wc -l` and aiayn.files count them.
    """
    lines = empty = 0
    last = b"\n"  # as if a line had just ended: a first byte b"\n" is an empty line
    for chunk in iter(lambda: src.read(_CHUNK), b""):
        out.write(chunk)
        lines += chunk.count(b"\n")
        empty += sum(1 for _ in _EMPTY_LINE.finditer(chunk))
        empty += last == b"\n" and chunk[:1] == b"\n"
        last = chunk[-1:]
    if last != b"\n":
        out.write(b"\n")
        lines += 1
    return lines, empty


def _extract_train(corpus: Corpus, archive: Path, outs: dict[str, IO[bytes]]) -> dict[str, Any]:
    """Append one training corpus's sides to `outs`; refuse it unless they align."""
    by_member = {m: lang for lang, m in corpus.members.items()}
    counts: dict[str, tuple[int, int]] = {}
    with _members(archive, set(by_member)) as members:
        for name, f in members:
            lang = by_member[name]
            logger.info("%s: %s", archive.name, name)
            stream: IO[bytes] = f
            if corpus.kind == "gz":
                stream = gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[assignment]
            try:
                counts[lang] = _copy_lines(stream, outs[lang])
            except (EOFError, OSError, tarfile.TarError, zlib.error) as e:
                raise InputError(f"{archive}: {name}: truncated or corrupt ({e})") from None
    langs = list(corpus.members)
    a, b = langs
    if counts[a][0] != counts[b][0]:
        raise InputError(
            f"{archive}: the {corpus.name} sides differ in length: {corpus.members[a]} has "
            f"{counts[a][0]} lines, {corpus.members[b]} has {counts[b][0]}; not aligned"
        )
    return {
        "name": corpus.name,
        "archive": corpus.archive,
        "members": corpus.members,
        "lines": counts[a][0],
        "empty_lines": {lang: counts[lang][1] for lang in langs},
    }


def _extract_sgml(
    corpus: Corpus, archive: Path, out: Path, split: str, expected: int | None
) -> dict[str, Any]:
    """Turn a test set's two SGML files into aligned OUT/SPLIT.LANG plain text."""
    by_member = {m: lang for lang, m in corpus.members.items()}
    parsed: dict[str, SgmlText] = {}
    with _members(archive, set(by_member)) as members:
        for name, f in members:
            where = f"{archive}:{name}"
            data = f.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                raise InputError(f"{where}:{line}: invalid UTF-8 at byte {e.start}") from None
            parsed[by_member[name]] = parse_sgml(text, where)
    a, b = corpus.members
    if len(parsed[a].segments) != len(parsed[b].segments):
        raise InputError(
            f"{archive}: {corpus.members[a]} has {len(parsed[a].segments)} segments, "
            f"{corpus.members[b]} has {len(parsed[b].segments)}; not aligned"
        )
    n = len(parsed[a].segments)
    if expected is not None and n != expected:
        logger.warning("%s: %d segments, %d published", corpus.name, n, expected)
    for lang, p in parsed.items():
        write_text_atomic(out / f"{split}.{lang}", "".join(f"{s}\n" for s in p.segments))
    return {
        "name": corpus.name,
        "archive": corpus.archive,
        "members": corpus.members,
        "lines": n,
        "docs": {lang: p.docs for lang, p in parsed.items()},
        "entities_unescaped": {lang: p.entities for lang, p in parsed.items()},
    }


# --------------------------------------------------------------------------- the whole job
def _outputs(pair: str) -> list[str]:
    lang = PAIRS[pair].lang
    return [f"{split}.{x}" for split in ("train", "valid", "test") for x in ("en", lang)]


def _complete(out: Path, pair: str) -> dict[str, Any] | None:
    """The stamp of a finished run for this pair whose outputs are all still there."""
    try:
        stamp = json.loads((out / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    outputs = stamp.get("outputs", {})
    for name in _outputs(pair):
        path = out / name
        if name not in outputs or not path.is_file() or path.stat().st_size != outputs[name]:
            return None
    return stamp


def _check_disk(out: Path, pair: str, fetching: bool) -> None:
    archives, text = SIZES[pair]
    need = text + (archives if fetching else 0)
    free = shutil.disk_usage(out).free
    if free < need:
        logger.warning(
            "%s: %.1f GB free, about %.1f GB needed (%s); it may run out",
            out,
            free / 1e9,
            need / 1e9,
            "archives and text" if fetching else "text",
        )


def download_wmt14(
    pair: str,
    out: str | Path,
    from_dir: str | Path | None = None,
    *,
    base_url: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Fetch (or read from a mirror) WMT14 `pair`, verify it and write aligned text to `out`.

    Args:
        pair: "en-de" or "en-fr".
        out: destination directory (created): train/valid/test .en and .de|.fr, wmt14.json,
            and downloads/ with the archives unless `from_dir` is given.
        from_dir: a directory holding the archives under their published names; read
            there, verified, not copied.
        base_url: fetch NAME from base_url + NAME instead of its published URL (a mirror
            over HTTP; the tests' local server).
        timeout: seconds before a stalled connection is abandoned.

    Returns:
        The stamp written to out/wmt14.json.

    Raises:
        ChecksumError: an archive differs from its published hash (it is not kept).
        DownloadError: a network failure (a partial download is kept as NAME.part and
            continued by the next call), or an archive absent from `from_dir`.
        InputError: an archive lacks a member, is corrupt, or a corpus's sides differ in
            line count (the message names the archive and the members).
    """
    if pair not in PAIRS:
        raise UsageError(f"unknown WMT14 pair {pair!r}; choose one of {', '.join(PAIRS)}")
    out = Path(out)
    source = None if from_dir is None else Path(from_dir)
    if source is not None and not source.is_dir():
        raise UsageError(f"--from {source}: not a directory holding the archives")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    previous = _stamp_pair(out)
    if previous is not None and previous != pair:
        raise UsageError(
            f"--out {out} already holds WMT14 {previous} ({out / STAMP_FILE}); its train.en "
            "would be replaced: choose another directory"
        )
    done = _complete(out, pair)
    if done is not None:
        logger.info("%s: WMT14 %s already complete (%s)", out, pair, out / STAMP_FILE)
        return done
    for stale in remove_stale_tmp(out):  # a killed run's half-written outputs
        logger.info("removed %s", stale)
    _check_disk(out, pair, fetching=source is None)
    spec = PAIRS[pair]

    archives: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for archive in archives_for(pair):
        if source is not None:
            path, sha = locate(archive, source)
        else:
            url = base_url + archive.name if base_url else None
            path, sha = fetch(archive, out / DOWNLOAD_DIR, url=url, timeout=timeout)
        paths[archive.name] = path
        archives[archive.name] = {
            "url": archive.url,
            "path": str(path),
            "bytes": path.stat().st_size,
            "published": {"algo": archive.algo, "digest": archive.digest, "size": archive.size},
            "source": archive.source,
            "verified": archive.digest is not None,
            "sha256": sha,
        }

    langs = ("en", spec.lang)
    corpora = []
    with contextlib.ExitStack() as stack:
        outs = {x: stack.enter_context(atomic_write(out / f"train.{x}")) for x in langs}
        for corpus in spec.train:
            corpora.append(_extract_train(corpus, paths[corpus.archive], outs))
            logger.info("%s: %d pairs", corpus.name, corpora[-1]["lines"])
    splits: dict[str, Any] = {
        "train": {"lines": sum(c["lines"] for c in corpora), "corpora": corpora}
    }
    for split, corpus in (("valid", spec.valid), ("test", spec.test)):
        expected = spec.expected_segments.get(corpus.name)
        splits[split] = _extract_sgml(corpus, paths[corpus.archive], out, split, expected)

    stamp = {
        "dataset": "wmt14",
        "pair": pair,
        "langs": list(langs),
        "splits": splits,
        "archives": archives,
        "outputs": {name: (out / name).stat().st_size for name in _outputs(pair)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "aiayn": _version(),
    }
    write_text_atomic(out / STAMP_FILE, json.dumps(stamp, indent=2, ensure_ascii=False) + "\n")
    return stamp


def _stamp_pair(out: Path) -> str | None:
    try:
        return str(json.loads((out / STAMP_FILE).read_text(encoding="utf-8"))["pair"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _version() -> str:
    from aiayn import __version__

    return __version__
