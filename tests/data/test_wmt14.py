"""Tests for `aiayn data wmt14`: the paper's WMT14 corpora (section 5.1), verified by
published hashes, resumable, streamed out of their archives and aligned.

No network: each test builds a small mirror of fake archives with the published member
names (SGML test sets with entities and several documents included) and points the pinned
table at the fakes' hashes, so the code under test is the code a real run takes.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import re
import tarfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from aiayn.data import wmt14
from aiayn.data.download import ChecksumError, DownloadError
from aiayn.data.wmt14 import (
    ARCHIVES,
    PAIRS,
    STAMP_FILE,
    archives_for,
    download_wmt14,
    parse_sgml,
    unescape_entities,
)
from aiayn.files import InputError, UsageError, count_lines
from helpers import assert_one_line_error, cli

# ----------------------------------------------------------------------------- the fake mirror
Pin = Callable[[Path], None]

#: Per corpus, per language: the lines the fake archive holds (the last one of commoncrawl
#: en has no final newline; europarl has an empty line, as the real corpora do).
TRAIN = {
    "europarl-v7": {
        "en": ["Resumption of the session", "", "I declare resumed the session."],
        "x": ["Wiederaufnahme der Sitzungsperiode", "", "Ich erkläre die Sitzung für eröffnet."],
    },
    "commoncrawl": {
        "en": ["iron cement", "protective coating & paint"],
        "x": ["Eisenzement", "Schutzbeschichtung & Farbe"],
    },
    "un": {"en": ["UN one", "UN two"], "x": ["ONU un", "ONU deux"]},
    "news-commentary-v9": {"en": ["NC \u00e9t\u00e9"], "x": ["NC sommer"]},
    "giga-fren": {"en": ["giga a", "giga b", "giga c"], "x": ["giga A", "giga B", "giga C"]},
}

NEWSTEST2013 = {
    # two documents, entities, a raw &, two segments on one line, one across two lines
    "en": """<srcset setid="newstest2013" srclang="any">
<doc sysid="ref" docid="a" origlang="en">
<p>
<seg id="1">  Tom &amp; Jerry say &quot;hi&quot;  </seg>
<seg id="2">AT&T costs &lt;5&gt; &#36; and caf&#xE9;</seg>
</p>
</doc>
<doc sysid="ref" docid="b" origlang="de">
<seg id="1">second doc one</seg><seg id="2">second
doc two</seg>
</doc>
</srcset>
""",
    "x": """<srcset setid="newstest2013" srclang="any">
<doc sysid="ref" docid="a" origlang="en">
<seg id="1">Tom &amp; Jerry sagen &#8222;hallo&#8220;</seg>
<seg id="2">AT&T kostet &lt;5&gt; &#36;</seg>
</doc>
<doc sysid="ref" docid="b" origlang="de">
<seg id="1">zweites Dokument eins</seg>
<seg id="2">zweites Dokument zwei</seg>
</doc>
</srcset>
""",
}
VALID = {
    "en": [
        'Tom & Jerry say "hi"',
        "AT&T costs <5> $ and caf\u00e9",
        "second doc one",
        "second doc two",
    ],
    "x": [
        "Tom & Jerry sagen \u201ehallo\u201c",
        "AT&T kostet <5> $",
        "zweites Dokument eins",
        "zweites Dokument zwei",
    ],
}
NEWSTEST2014 = {
    "en": '<refset><doc docid="z"><seg id="1">test one</seg>\n<seg id="2">test &apos;two&apos;'
    "</seg></doc></refset>\n",
    "x": '<refset><doc docid="z"><seg id="1">Test eins</seg>\n<seg id="2">Test zwei</seg>'
    "</doc></refset>\n",
}
TEST = {"en": ["test one", "test 'two'"], "x": ["Test eins", "Test zwei"]}


def _text(lines: list[str], final_newline: bool = True) -> bytes:
    body = "\n".join(lines) + ("\n" if final_newline else "")
    return body.encode("utf-8")


def _tar(path: Path, members: dict[str, bytes], mode: str = "w:gz") -> None:
    with tarfile.open(path, mode) as tar:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _corpus(pair: str, name: str) -> wmt14.Corpus:
    spec = PAIRS[pair]
    return next(c for c in (*spec.train, spec.valid, spec.test) if c.name == name)


def build_mirror(root: Path, pair: str = "en-de", **override: dict[str, bytes]) -> Path:
    """Fake archives for `pair` under their published names; `override[archive_key]`
    replaces a member's bytes (keys: corpus name + "." + lang)."""
    root.mkdir(parents=True, exist_ok=True)
    content: dict[str, dict[str, bytes]] = {}  # archive -> member -> bytes
    spec = PAIRS[pair]
    for corpus in spec.train:
        for side, member in corpus.members.items():
            lines = TRAIN[corpus.name]["en" if side == "en" else "x"]
            data = _text(lines, final_newline=not (corpus.name == "commoncrawl" and side == "en"))
            if corpus.kind == "gz":
                data = gzip.compress(data)
            content.setdefault(corpus.archive, {})[member] = data
    for corpus, sgml in ((spec.valid, NEWSTEST2013), (spec.test, NEWSTEST2014)):
        for side, member in corpus.members.items():
            text = sgml["en" if side == "en" else "x"]
            content.setdefault(corpus.archive, {})[member] = text.encode("utf-8")
    # what a real archive also holds: other pairs, and a "./" prefix on some names
    europarl = content["training-parallel-europarl-v7.tgz"]
    europarl["training/europarl-v7.cs-en.cs"] = b"nothing to see\n"
    cc = content["training-parallel-commoncrawl.tgz"]
    for member in list(cc):
        cc["./" + member] = cc.pop(member)
    for key, data in override.items():
        corpus_name, side = key.rsplit(".", 1)
        corpus = _corpus(pair, corpus_name)
        member = corpus.members[side]
        members = content[corpus.archive]
        members[("./" + member) if ("./" + member) in members else member] = data
    for archive, members in content.items():
        _tar(root / archive, members, "w" if archive.endswith(".tar") else "w:gz")
    assert {a.name for a in archives_for(pair)} == set(content)
    return root


@pytest.fixture
def pin(monkeypatch: pytest.MonkeyPatch) -> Pin:
    """pin(mirror): point the pinned table at the mirror's files (sha256 or md5, as the
    real entry publishes), with their sizes where the real entry has one."""

    def apply(mirror: Path) -> None:
        for path in mirror.iterdir():
            if path.name not in ARCHIVES:
                continue
            real = ARCHIVES[path.name]
            data = path.read_bytes()
            digest = getattr(hashlib, real.algo)(data).hexdigest()
            size = len(data) if real.size is not None else None
            monkeypatch.setitem(
                ARCHIVES, path.name, dataclasses.replace(real, digest=digest, size=size)
            )
        # the fakes are not the published test sets: no published segment counts
        for pair in PAIRS:
            monkeypatch.setitem(PAIRS, pair, dataclasses.replace(PAIRS[pair], expected_segments={}))

    return apply


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _expected_train(pair: str, side: str) -> list[str]:
    return [
        line
        for corpus in PAIRS[pair].train
        for line in TRAIN[corpus.name]["en" if side == "en" else "x"]
    ]


# ----------------------------------------------------------------------------- the pinned table
def test_the_pinned_table_is_well_formed() -> None:
    """Every archive has a URL ending in its name, a hash of the right length for its
    algorithm, and a citation naming a repository, a file and a commit; every corpus of
    both pairs refers to an archive in the table."""
    for name, a in ARCHIVES.items():
        assert a.name == name and a.url.startswith("http") and a.url.endswith("/" + name)
        assert a.algo in ("sha256", "md5")
        assert a.digest is not None, name
        assert re.fullmatch(r"[0-9a-f]{64}" if a.algo == "sha256" else r"[0-9a-f]{32}", a.digest)
        assert re.search(r"^\S+/\S+ \S+\.(py|txt|tsv)\b", a.source), a.source
        assert re.search(r"commit [0-9a-f]{40}", a.source), a.source
        assert a.size is None or a.size > 0
    used = {c.archive for spec in PAIRS.values() for c in (*spec.train, spec.valid, spec.test)}
    assert used == set(ARCHIVES)
    # section 5.1: three corpora for En-De; En-Fr adds UN and Giga-fren
    assert [c.name for c in PAIRS["en-de"].train] == [
        "europarl-v7",
        "commoncrawl",
        "news-commentary-v9",
    ]
    assert {c.name for c in PAIRS["en-fr"].train} == {
        "europarl-v7",
        "commoncrawl",
        "un",
        "news-commentary-v9",
        "giga-fren",
    }


# ----------------------------------------------------------------------------- SGML
def test_sgml_segments_in_file_order_with_entities_unescaped() -> None:
    parsed = parse_sgml(NEWSTEST2013["en"], "x.sgm")
    assert parsed.segments == VALID["en"]
    assert parsed.docs == 2
    # &amp; &quot; &quot; &lt; &gt; &#36; &#xE9; (AT&T's raw & is not one)
    assert parsed.entities == 7


def test_unescape_takes_only_complete_references() -> None:
    assert unescape_entities("a &amp;amp; b") == ("a &amp; b", 1)
    assert unescape_entities("R&D &copy &amp &#0; &#xD800; &#65;") == (
        "R&D &copy &amp &#0; &#xD800; A",
        1,
    )


def test_a_seg_without_its_close_tag_is_named_with_its_line() -> None:
    text = '<doc>\n<seg id="1">one</seg>\n<seg id="2">two\n<seg id="3">three</seg>\n</doc>\n'
    with pytest.raises(InputError, match=r"t\.sgm:3: <seg id=\"2\"> has no </seg>"):
        parse_sgml(text, "t.sgm")


# ----------------------------------------------------------------------------- from a mirror
def test_en_de_from_a_mirror(tmp_path: Path, pin: Pin) -> None:
    """The three corpora are concatenated in order, side by side; the test sets become
    aligned plain text; the stamp says what came from where; nothing is copied."""
    mirror = build_mirror(tmp_path / "mirror")
    pin(mirror)
    out = tmp_path / "out"
    stamp = download_wmt14("en-de", out, mirror)

    assert _lines(out / "train.en") == _expected_train("en-de", "en")
    assert _lines(out / "train.de") == _expected_train("en-de", "de")
    assert count_lines(out / "train.en") == count_lines(out / "train.de") == 6
    assert _lines(out / "valid.en") == VALID["en"] and _lines(out / "valid.de") == VALID["x"]
    assert _lines(out / "test.en") == TEST["en"] and _lines(out / "test.de") == TEST["x"]
    assert not (out / "downloads").exists()  # a mirror is read in place

    assert stamp == json.loads((out / STAMP_FILE).read_text())
    train = stamp["splits"]["train"]
    assert [(c["name"], c["lines"]) for c in train["corpora"]] == [
        ("europarl-v7", 3),
        ("commoncrawl", 2),
        ("news-commentary-v9", 1),
    ]
    assert train["lines"] == 6
    assert train["corpora"][0]["empty_lines"] == {"en": 1, "de": 1}
    assert stamp["splits"]["valid"]["docs"] == {"en": 2, "de": 2}
    assert stamp["splits"]["valid"]["entities_unescaped"] == {"en": 7, "de": 6}
    for name, info in stamp["archives"].items():
        assert info["verified"] and info["path"] == str(mirror / name)
        assert info["sha256"] == hashlib.sha256((mirror / name).read_bytes()).hexdigest()
        assert info["source"] == ARCHIVES[name].source
    assert list(out.glob(".*.tmp")) == []


def test_en_fr_takes_the_un_corpus_and_ungzips_giga_fren(
    tmp_path: Path,
    pin: Pin,
) -> None:
    mirror = build_mirror(tmp_path / "mirror", "en-fr")
    pin(mirror)
    out = tmp_path / "out"
    stamp = download_wmt14("en-fr", out, mirror)
    assert _lines(out / "train.en") == _expected_train("en-fr", "en")
    assert _lines(out / "train.fr") == _expected_train("en-fr", "fr")
    assert _lines(out / "train.fr")[-3:] == ["giga A", "giga B", "giga C"]
    assert [c["name"] for c in stamp["splits"]["train"]["corpora"]] == [
        "europarl-v7",
        "commoncrawl",
        "un",
        "news-commentary-v9",
        "giga-fren",
    ]
    assert _lines(out / "valid.fr") == VALID["x"] and _lines(out / "test.fr") == TEST["x"]


def test_sides_of_different_length_are_refused_naming_the_files(
    tmp_path: Path,
    pin: Pin,
) -> None:
    extra = _text([*TRAIN["commoncrawl"]["x"], "one line too many"])
    mirror = build_mirror(tmp_path / "mirror", **{"commoncrawl.de": extra})
    pin(mirror)
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        download_wmt14("en-de", out, mirror)
    msg = str(e.value)
    assert "training-parallel-commoncrawl.tgz" in msg
    assert "commoncrawl.de-en.en has 2 lines" in msg and "commoncrawl.de-en.de has 3" in msg
    assert not (out / "train.en").exists() and not (out / STAMP_FILE).exists()
    assert list(out.glob(".*.tmp")) == []


def test_test_sets_of_different_length_are_refused(tmp_path: Path, pin: Pin) -> None:
    short = b'<doc><seg id="1">Test eins</seg></doc>\n'
    mirror = build_mirror(tmp_path / "mirror", **{"newstest2014.de": short})
    pin(mirror)
    with pytest.raises(InputError, match=r"newstest2014-deen-src\.en\.sgm has 2 segments, "):
        download_wmt14("en-de", tmp_path / "out", mirror)


@pytest.mark.parametrize("name", ["training-parallel-nc-v9.tgz", "test-full.tgz"])
def test_a_corrupted_archive_is_refused_naming_both_hashes(
    tmp_path: Path,
    pin: Pin,
    name: str,
) -> None:
    """sha256-pinned (nc-v9) and md5-pinned (test-full) archives alike."""
    mirror = build_mirror(tmp_path / "mirror")
    pin(mirror)
    data = bytearray((mirror / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (mirror / name).write_bytes(bytes(data))
    algo = ARCHIVES[name].algo
    found = getattr(hashlib, algo)(bytes(data)).hexdigest()
    with pytest.raises(ChecksumError) as e:
        download_wmt14("en-de", tmp_path / "out", mirror)
    msg = str(e.value)
    assert name in msg and f"{algo} mismatch" in msg
    assert f"expected {ARCHIVES[name].digest}" in msg and f"found {found}" in msg
    assert not (tmp_path / "out" / "train.en").exists()


def test_an_archive_missing_a_member_is_named(tmp_path: Path, pin: Pin) -> None:
    mirror = build_mirror(tmp_path / "mirror")
    _tar(mirror / "training-parallel-nc-v9.tgz", {"training/news-commentary-v9.de-en.en": b"x\n"})
    pin(mirror)
    with pytest.raises(InputError, match=r"has no member training/news-commentary-v9\.de-en\.de"):
        download_wmt14("en-de", tmp_path / "out", mirror)


def test_a_missing_archive_says_where_to_fetch_it(tmp_path: Path, pin: Pin) -> None:
    mirror = build_mirror(tmp_path / "mirror")
    pin(mirror)
    (mirror / "test.tgz").unlink()
    with pytest.raises(DownloadError, match=r"test\.tgz: not in the mirror \(fetch http://"):
        download_wmt14("en-de", tmp_path / "out", mirror)


def test_a_finished_run_is_not_redone_and_another_pair_is_refused(
    tmp_path: Path,
    pin: Pin,
) -> None:
    mirror = build_mirror(tmp_path / "mirror")
    pin(mirror)
    out = tmp_path / "out"
    first = download_wmt14("en-de", out, mirror)
    for path in mirror.iterdir():  # the archives are gone: a rerun must not need them
        path.unlink()
    assert download_wmt14("en-de", out, mirror) == first
    (out / "train.de").write_text("changed\n")  # an output changed: the run is redone
    with pytest.raises(DownloadError, match="not in the mirror"):
        download_wmt14("en-de", out, mirror)
    with pytest.raises(UsageError, match="already holds WMT14 en-de"):
        download_wmt14("en-fr", out, mirror)


# ----------------------------------------------------------------------------- over HTTP
class _Server:
    """A local HTTP server over a directory that honours Range, can drop a response after
    N bytes (a connection that breaks) and records the Range header of each request."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str | None]] = []
        self.drop_after: dict[str, int] = {}
        self.ignore_range = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                path = server.root / name
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                start = 0
                if rng and not server.ignore_range:
                    start = int(rng.removeprefix("bytes=").rstrip("-"))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                cut = server.drop_after.pop(name, None)
                self.wfile.write(body if cut is None else body[:cut])
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served(tmp_path: Path, pin: Pin) -> Iterator[_Server]:
    mirror = build_mirror(tmp_path / "www")
    pin(mirror)
    server = _Server(mirror)
    try:
        yield server
    finally:
        server.close()


def test_a_broken_download_continues_from_its_part_file(tmp_path: Path, served: _Server) -> None:
    name = "training-parallel-europarl-v7.tgz"
    total = (served.root / name).stat().st_size
    served.drop_after[name] = total // 2
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match=r"truncated, \d+ of \d+ bytes; run again"):
        download_wmt14("en-de", out, base_url=served.url, timeout=10)
    part = out / "downloads" / f"{name}.part"
    assert part.stat().st_size == total // 2 and not (out / "downloads" / name).exists()

    served.requests.clear()
    download_wmt14("en-de", out, base_url=served.url, timeout=10)
    assert (name, f"bytes={total // 2}-") in served.requests  # continued, not restarted
    assert not part.exists()
    assert (out / "downloads" / name).read_bytes() == (served.root / name).read_bytes()
    assert _lines(out / "train.de") == _expected_train("en-de", "de")
    # every archive now in downloads/ and verified: a rerun fetches nothing
    served.requests.clear()
    (out / STAMP_FILE).unlink()
    download_wmt14("en-de", out, base_url=served.url, timeout=10)
    assert served.requests == []


def test_a_part_that_does_not_verify_is_deleted_not_resumed(
    tmp_path: Path, served: _Server
) -> None:
    name = "training-parallel-nc-v9.tgz"
    data = (served.root / name).read_bytes()
    downloads = tmp_path / "out" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"{name}.part").write_bytes(b"\0" * 10)  # a bad prefix
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        download_wmt14("en-de", tmp_path / "out", base_url=served.url, timeout=10)
    assert not (downloads / f"{name}.part").exists()
    download_wmt14("en-de", tmp_path / "out", base_url=served.url, timeout=10)
    assert (downloads / name).read_bytes() == data


def test_a_server_that_ignores_range_is_read_from_the_start(
    tmp_path: Path, served: _Server
) -> None:
    name = "test.tgz"
    data = (served.root / name).read_bytes()
    downloads = tmp_path / "out" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"{name}.part").write_bytes(data[:7])
    served.ignore_range = True
    download_wmt14("en-de", tmp_path / "out", base_url=served.url, timeout=10)
    assert (downloads / name).read_bytes() == data


def test_a_missing_url_is_a_clear_error(tmp_path: Path, served: _Server) -> None:
    (served.root / "test-full.tgz").unlink()
    with pytest.raises(DownloadError, match=r"test-full\.tgz: not found \(HTTP 404\)"):
        download_wmt14("en-de", tmp_path / "out", base_url=served.url, timeout=10)


# ----------------------------------------------------------------------------- the command line
def test_cli_end_to_end(tmp_path: Path, pin: Pin) -> None:
    mirror = build_mirror(tmp_path / "mirror")
    pin(mirror)
    out = tmp_path / "out"
    code, stdout, err = cli("data", "wmt14", "--pair", "en-de", "--from", mirror, "--out", out)
    assert code == 0, err
    assert "train: 6 pairs" in stdout and "valid: 4 pairs" in stdout and "test: 2 pairs" in stdout
    assert _lines(out / "test.de") == TEST["x"]
    assert json.loads((out / STAMP_FILE).read_text())["pair"] == "en-de"

    code, _, err = cli("data", "wmt14", "--from", mirror, "--out", tmp_path / "o2")
    assert code == 2
    assert_one_line_error(err, "--pair en-de or --pair en-fr")

    (mirror / "test.tgz").write_bytes(b"not the archive")
    code, _, err = cli(
        "data", "wmt14", "--pair", "en-de", "--from", mirror, "--out", tmp_path / "o3"
    )
    assert code == 1
    assert_one_line_error(err, "test.tgz", "md5 mismatch", "expected", "found")


def test_cli_help_names_the_pairs_and_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from aiayn.cli import main

    with pytest.raises(SystemExit) as e:
        main(["data", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for fragment in (
        "wmt14",
        "--pair {en-de,en-fr}",
        "~4.5M pairs",
        "GB to download",
        "newstest2013",
    ):
        assert fragment in text, fragment
