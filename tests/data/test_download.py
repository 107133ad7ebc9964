"""Tests for fetching Multi30k with pinned checksums (the section 5.1 stand-in corpus;
RELIABILITY E8: nothing unverified or half-written at a final name)."""

from __future__ import annotations

import functools
import logging
import shutil
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from aiayn.data.download import (
    PINNED_SHA256,
    PTB_SAMPLE_SHA256,
    SUMS_FILE,
    ChecksumError,
    DownloadError,
    download_multi30k,
    download_ptb_sample,
)
from aiayn.files import sha256_file
from helpers import MULTI30K  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (MULTI30K / "val.en.gz").is_file(),
    reason=f"Multi30k not found at {MULTI30K} (see shared/data/README.md)",
)


def _sums(out: Path) -> dict[str, str]:
    lines = (out / SUMS_FILE).read_text().splitlines()
    return {name: digest for digest, name in (line.split("  ") for line in lines)}


@pytest.fixture
def server() -> Iterator[str]:
    """A local HTTP server over the shared Multi30k copy: the network path, offline."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(MULTI30K)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_from_dir_verifies_pinned_hashes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every file we ship a hash for is checked; with default splits and languages the
    files the source lacks are skipped with a warning, not an error."""
    with caplog.at_level(logging.WARNING, logger="aiayn.data.download"):
        paths = download_multi30k(tmp_path / "out", MULTI30K)
    assert sorted(p.name for p in paths) == sorted(PINNED_SHA256)
    for p in paths:
        assert sha256_file(p) == PINNED_SHA256[p.name]
    assert _sums(tmp_path / "out") == PINNED_SHA256
    assert "test_2017_mscoco.en.gz: not found" in caplog.text
    assert list((tmp_path / "out").glob(".*.tmp")) == []


def test_tampered_copy_is_rejected(tmp_path: Path) -> None:
    """A file whose bytes differ from the pinned hash is an error naming the file, the
    expected and the found hash, and it never appears under its final name."""
    src = tmp_path / "src"
    src.mkdir()
    data = bytearray((MULTI30K / "val.en.gz").read_bytes())
    data[len(data) // 2] ^= 0x01
    (src / "val.en.gz").write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(ChecksumError) as e:
        download_multi30k(out, src, splits=["val"], langs=["en"])
    msg = str(e.value)
    assert "val.en.gz" in msg and PINNED_SHA256["val.en.gz"] in msg
    assert sha256_file(src / "val.en.gz") in msg
    assert not (out / "val.en.gz").exists() and list(out.glob(".*.tmp")) == []


def test_present_files_are_not_fetched_again(tmp_path: Path) -> None:
    """A verified file already in `out` is kept as is; a corrupted one is replaced."""
    out = tmp_path / "out"
    (path,) = download_multi30k(out, MULTI30K, splits=["val"], langs=["de"])
    before = path.stat().st_ino, path.stat().st_mtime_ns
    download_multi30k(out, tmp_path / "empty", splits=["val"], langs=["de"])  # no source
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == before
    path.write_bytes(b"truncated")
    download_multi30k(out, MULTI30K, splits=["val"], langs=["de"])
    assert sha256_file(path) == PINNED_SHA256["val.de.gz"]


def test_unpinned_file_warns_and_records_hash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file with no pinned hash is accepted with a warning and its hash recorded in
    SHA256SUMS; later copies must match the recorded hash."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "test_2018_flickr.cs.gz").write_bytes(b"first version")
    with caplog.at_level(logging.WARNING, logger="aiayn.data.download"):
        download_multi30k(out, src, splits=["test_2018_flickr"], langs=["cs"])
    assert "no pinned sha256" in caplog.text
    recorded = _sums(out)["test_2018_flickr.cs.gz"]
    assert recorded == sha256_file(out / "test_2018_flickr.cs.gz")
    (out / "test_2018_flickr.cs.gz").unlink()
    (src / "test_2018_flickr.cs.gz").write_bytes(b"second version")
    with pytest.raises(ChecksumError, match=recorded):
        download_multi30k(out, src, splits=["test_2018_flickr"], langs=["cs"])


def test_explicit_request_for_missing_file_fails(tmp_path: Path) -> None:
    """A file named by split and language that the source lacks is an error; unknown
    names are refused before any work."""
    with pytest.raises(DownloadError, match="test_2017_mscoco.cs.gz"):
        download_multi30k(tmp_path / "out", MULTI30K, splits=["test_2017_mscoco"], langs=["cs"])
    with pytest.raises(ValueError, match="test_2019"):
        download_multi30k(tmp_path / "out", MULTI30K, splits=["test_2019"])


def test_http_download(tmp_path: Path, server: str) -> None:
    """The network path (urllib, temp file, verify, rename) against a local server,
    including an HTTP 404 for an explicitly requested file."""
    out = tmp_path / "out"
    paths = download_multi30k(
        out, splits=["val", "test_2016_flickr"], langs=["en"], base_url=server, timeout=10
    )
    assert [p.name for p in paths] == ["val.en.gz", "test_2016_flickr.en.gz"]
    assert sha256_file(out / "val.en.gz") == PINNED_SHA256["val.en.gz"]
    with pytest.raises(DownloadError, match="test_2017_flickr.en.gz.*not found"):
        download_multi30k(out, splits=["test_2017_flickr"], langs=["en"], base_url=server)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(MULTI30K / "val.fr.gz", bad / "val.de.gz")  # the wrong file under a name
    with pytest.raises(ChecksumError):
        download_multi30k(out, bad, splits=["val"], langs=["de"])


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    """No network (or a dead host) is a DownloadError naming the URL, not a traceback."""
    with pytest.raises(DownloadError, match="127.0.0.1:9/val.en.gz"):
        download_multi30k(
            tmp_path, splits=["val"], langs=["en"], base_url="http://127.0.0.1:9/", timeout=5
        )


PTB_SAMPLE = MULTI30K.parent / "ptb-sample"


@pytest.fixture
def ptb_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local HTTP server over a folder holding the treebank sample (and, for the
    tampered case, a changed copy of it)."""
    root = tmp_path / "www"
    root.mkdir()
    shutil.copy(PTB_SAMPLE / "treebank.zip", root / "treebank.zip")
    (root / "tampered.zip").write_bytes(b"X" + (root / "treebank.zip").read_bytes()[1:])

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", root
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.skipif(not (PTB_SAMPLE / "treebank.zip").is_file(), reason="no treebank sample")
def test_the_treebank_sample_downloads_verified_and_a_changed_one_is_not_kept(
    tmp_path: Path, ptb_server: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = ptb_server
    out = tmp_path / "raw"
    path = download_ptb_sample(out, url=url + "treebank.zip", timeout=10)
    assert path == out / "treebank.zip" and sha256_file(path) == PTB_SAMPLE_SHA256
    with caplog.at_level(logging.INFO):  # a verified copy is kept, not fetched again
        download_ptb_sample(out, url=url + "missing.zip", timeout=10)
    assert "present and verified" in caplog.text
    other = tmp_path / "other"
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        download_ptb_sample(other, url=url + "tampered.zip", timeout=10)
    assert not (other / "treebank.zip").exists()
    with pytest.raises(DownloadError, match="not found"):
        download_ptb_sample(other, url=url + "missing.zip", timeout=10)
