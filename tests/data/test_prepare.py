"""Tests for data preparation (section 5.1; RELIABILITY E1-E5, E7, E8)."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data import prepare as data
from aiayn.data.corpus import Corpus, load_corpus, load_manifest, load_tokenizer
from aiayn.data.prepare import prepare
from aiayn.data.tokenizer import Tokenizer
from aiayn.files import InputError, count_lines, read_lines, sha256_file
from helpers import MULTI30K  # noqa: E402

N_TRAIN, N_VALID = 400, 50
VOCAB = 500


def _write(path: Path, lines: list[str], *, newline_at_end: bool = True) -> Path:
    text = "\n".join(lines) + ("\n" if newline_at_end and lines else "")
    path.write_bytes(text.encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def corpus_text() -> dict[str, list[str]]:
    """A few hundred real Multi30k pairs (en-de), read once per module."""
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.skip(f"Multi30k not found at {MULTI30K} (see shared/data/README.md)")
    n = N_TRAIN + N_VALID
    return {lang: list(read_lines(MULTI30K / f"train.{lang}.gz"))[:n] for lang in ("en", "de")}


@pytest.fixture
def raw(tmp_path: Path, corpus_text: dict[str, list[str]]) -> Path:
    """tmp/raw/{train,valid}.{en,de}: train gzipped, valid plain (both conventions)."""
    d = tmp_path / "raw"
    d.mkdir()
    for lang, lines in corpus_text.items():
        text = "".join(f"{x}\n" for x in lines[:N_TRAIN]).encode()
        (d / f"train.{lang}.gz").write_bytes(gzip.compress(text, mtime=0))
        _write(d / f"valid.{lang}", lines[N_TRAIN:])
    return d


def _prepare(raw: Path, out: Path, **kw: object) -> dict:
    kw.setdefault("vocab_size", VOCAB)
    return prepare("en", "de", raw / "train", raw / "valid", out=out, **kw)  # type: ignore


def test_manifest_and_outputs(raw: Path, tmp_path: Path, corpus_text: dict[str, list[str]]) -> None:
    """Section 5.1 data path: one shared vocabulary, id tensors loadable with
    weights_only=True, and a manifest recording inputs, vocabulary and counts (E8)."""
    out = tmp_path / "out"
    m = _prepare(raw, out)
    assert m == load_manifest(out)
    assert m["source_lang"] == "en" and m["target_lang"] == "de" and m["vocab_size"] == VOCAB
    assert m["special_ids"] == {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
    assert m["spm_model"]["sha256"] == sha256_file(out / "spm.model")
    for side, lang in (("src", "en"), ("tgt", "de")):
        info = m["inputs"]["train"][side]
        assert info == {
            "path": str((raw / f"train.{lang}.gz").resolve()),
            "sha256": sha256_file(raw / f"train.{lang}.gz"),
            "lines": N_TRAIN,
        }
    assert m["splits"]["train"]["pairs"] == N_TRAIN and m["splits"]["valid"]["pairs"] == N_VALID
    assert m["splits"]["valid"]["sha256"] == sha256_file(out / "valid.pt")
    assert "test" not in m["splits"] and not (out / "test.pt").exists()
    saved = torch.load(out / "train.pt", weights_only=True)
    assert saved["src_ids"].dtype == torch.int32 and saved["src_offsets"].dtype == torch.int64
    assert saved["src_offsets"].shape == (N_TRAIN + 1,)
    valid, tok = load_corpus(out, "valid"), load_tokenizer(out)
    assert len(valid) == N_VALID and valid.line_numbers.tolist() == list(range(1, 51))
    assert valid.src_lens.dtype == torch.int64 and int(valid.src_lens[3]) == len(valid.src(3))
    for i in (0, 17, N_VALID - 1):  # ids decode back to the text of the recorded line
        assert tok.decode(valid.src(i)) == tok.normalize(corpus_text["en"][N_TRAIN + i])
        assert tok.decode(valid.tgt(i)) == tok.normalize(corpus_text["de"][N_TRAIN + i])


@pytest.mark.rows("E1")
def test_mismatched_line_counts_rejected_before_work(tmp_path: Path) -> None:
    """E1: 1000 source lines vs 999 target lines is refused before anything is written,
    naming both files, both counts and the first line past the shorter file."""
    src = _write(tmp_path / "train.en", [f"line {i}" for i in range(1000)])
    tgt = _write(tmp_path / "train.de", [f"Zeile {i}" for i in range(999)])
    with pytest.raises(InputError) as e:
        prepare("en", "de", tmp_path / "train", out=tmp_path / "out")
    msg = str(e.value)
    assert all(s in msg for s in (str(src), str(tgt), "1000", "999", "line 1000"))
    assert not (tmp_path / "out").exists()


def test_missing_inputs_name_both_candidates(tmp_path: Path) -> None:
    """fairseq's PREFIX.LANG convention, with .gz accepted: an error names both names."""
    with pytest.raises(InputError, match=r"train\.en nor .*train\.en\.gz"):
        prepare("en", "de", tmp_path / "train", out=tmp_path / "out")


@pytest.mark.rows("E2")
def test_empty_lines_dropped_counted_and_logged(
    raw: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """E2: empty or whitespace-only lines on either side drop the pair, are counted, and
    the first 10 are logged as file:line; on_empty="error" makes the first one fatal."""
    src, tgt = (list(read_lines(raw / f"valid.{lang}")) for lang in ("en", "de"))
    blanks = {2: ("", None), 5: (None, "   \t"), 9: ("\u2028", None), 12: (" ", "")}
    for n in range(20, 32):  # 12 more, beyond the 10 named in the log
        blanks[n] = ("", None)
    for n, (s, t) in blanks.items():
        src[n - 1] = src[n - 1] if s is None else s
        tgt[n - 1] = tgt[n - 1] if t is None else t
    _write(raw / "valid.en", src)
    _write(raw / "valid.de", tgt)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.prepare"):
        m = _prepare(raw, tmp_path / "out")
    assert m["splits"]["valid"]["dropped"]["empty"] == len(blanks)
    assert m["splits"]["valid"]["pairs"] == N_VALID - len(blanks)
    assert set(load_corpus(tmp_path / "out", "valid").line_numbers.tolist()).isdisjoint(blanks)
    log = caplog.text
    assert f"{raw / 'valid.en'}:2" in log and f"{raw / 'valid.de'}:5" in log
    assert f"{raw / 'valid.en'}:12, {raw / 'valid.de'}:12" in log
    assert f"{raw / 'valid.en'}:31" not in log and "6 more" in log
    with pytest.raises(InputError, match=r"valid\.en:2: empty"):
        _prepare(raw, tmp_path / "out2", on_empty="error")


@pytest.mark.rows("E3")
def test_invalid_utf8_names_file_line_and_byte(raw: Path, tmp_path: Path) -> None:
    """E3: a Latin-1 byte (\\xe9) at line 7 is an error naming the file, line and byte;
    on_bad_utf8="skip" drops and counts that pair instead."""
    path = raw / "valid.de"
    lines = path.read_bytes().split(b"\n")
    lines[6] = b"Caf\xe9 " + lines[6]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(InputError) as e:
        _prepare(raw, tmp_path / "out")
    assert f"{path}:7:" in str(e.value) and "byte 3" in str(e.value)
    m = _prepare(raw, tmp_path / "out", on_bad_utf8="skip")
    assert m["splits"]["valid"]["dropped"]["bad_utf8"] == 1
    assert 7 not in load_corpus(tmp_path / "out", "valid").line_numbers.tolist()


@pytest.mark.rows("E4")
def test_line_counting_agrees_with_wc(raw: Path, tmp_path: Path) -> None:
    """E4: stray \\r, U+2028, U+0085, NUL, a BOM and no final newline: lines are split on
    \\n only, so counts agree with `wc -l` (plus the unterminated last line)."""
    odd = ["\ufeffa b\rc d", "\u2028e f", "x\u0085y", "\x00g h", "crlf end\r", "last"]
    for lang in ("en", "de"):
        _write(raw / f"valid.{lang}", odd, newline_at_end=False)
    path = raw / "valid.en"
    if shutil.which("wc"):
        wc = int(
            subprocess.run(
                ["wc", "-l", str(path)], capture_output=True, text=True, check=True
            ).stdout.split()[0]
        )
        assert wc == len(odd) - 1  # wc counts newlines; the last line has none
    assert count_lines(path) == len(odd) == len(list(read_lines(path)))
    m = _prepare(raw, tmp_path / "out")
    assert m["inputs"]["valid"]["src"]["lines"] == len(odd)
    valid, tok = load_corpus(tmp_path / "out", "valid"), load_tokenizer(tmp_path / "out")
    assert valid.line_numbers.tolist() == [1, 2, 3, 4, 5, 6]
    assert tok.decode(valid.src(0)) == "a b c d"  # BOM gone, \r inside the line kept as space


@pytest.mark.rows("E5")
def test_length_filter_counts_and_failure(
    raw: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """E5: training pairs over max_len or over the length ratio are dropped with
    per-reason counts; valid is never length-filtered; > 50% filtered is an error."""
    src, tgt = (list(read_lines(raw / f"train.{lang}.gz")) for lang in ("en", "de"))
    src += ["a " * 150] * 3 + ["Hund"] * 5 + ["  "] * 2
    tgt += ["b " * 150] * 3 + ["ein Hund " * 20] * 5 + ["x"] * 2
    _write(raw / "train.en", src)
    _write(raw / "train.de", tgt)
    for lang in ("en", "de"):
        (raw / f"train.{lang}.gz").unlink()
    _write(raw / "valid.en", ["a " * 150])  # as long as the filtered training pairs
    _write(raw / "valid.de", ["b " * 150])
    with caplog.at_level(logging.INFO, logger="aiayn.data.prepare"):
        m = _prepare(raw, tmp_path / "out", max_len=120)
    assert m["splits"]["train"]["dropped"] == {"too_long": 3, "ratio": 5, "empty": 2, "bad_utf8": 0}
    assert "filtered 10 of 410: too long 3, ratio 5, empty 2" in caplog.text
    assert m["splits"]["valid"]["pairs"] == 1
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(InputError, match=r"filtered \d+ of 410.*50%"):
        _prepare(raw, tmp_path / "out", max_len=8)
    # Rejected before writing: the previous preparation is intact and still loads.
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert len(load_corpus(tmp_path / "out", "train")) == 400


@pytest.mark.rows("E7")
def test_unk_rate_reported_and_warned(
    raw: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """E7: the <unk> rate is recorded per side and warned about above 1%."""
    _write(raw / "valid.en", ["\u2603\u2604\u2605 \u2606"] * 3)  # symbols never seen
    _write(raw / "valid.de", ["Ein Hund."] * 3)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.prepare"):
        m = _prepare(raw, tmp_path / "out")
    unk = m["splits"]["valid"]["unk_rate"]
    assert unk["src"] > 0.3 and unk["tgt"] == 0.0  # a run of unknown characters: one <unk>
    assert m["splits"]["train"]["unk_rate"] == {"src": 0.0, "tgt": 0.0}
    assert "<unk>" in caplog.text and "src" in caplog.text


@pytest.mark.rows("E8")
def test_rerun_is_byte_identical_and_kill_leaves_no_manifest(
    raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E8: re-running gives byte-identical outputs; a run killed while writing leaves no
    manifest (so nothing half-written is consumed), and the rerun repairs it exactly."""
    first, second = tmp_path / "a", tmp_path / "b"
    _prepare(raw, first)
    _prepare(raw, second)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["manifest.json", "spm.model", "train.pt", "valid.pt"]
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    real_save = torch.save

    def dying_save(obj: object, f: object) -> None:
        if str(getattr(f, "name", "")).startswith(str(second / ".valid.pt")):
            real_save(obj, f)
            raise KeyboardInterrupt("killed while writing valid.pt")
        real_save(obj, f)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _prepare(raw, second)
    assert not (second / "manifest.json").exists() and not (second / "valid.pt").exists()
    assert list(second.glob(".*.tmp")) == []
    with pytest.raises(InputError, match="run `aiayn prepare` first"):
        load_corpus(second, "train")
    monkeypatch.setattr(torch, "save", real_save)
    _prepare(raw, second)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.rows("F10", "F11")
def test_loading_checks_hashes(raw: Path, tmp_path: Path) -> None:
    """RELIABILITY F10/F11: a vocabulary or split changed after prepare is refused with
    the expected and found sha256; a split never prepared is named."""
    out = tmp_path / "out"
    _prepare(raw, out)
    with pytest.raises(InputError, match="split 'test' was not prepared"):
        load_corpus(out, "test")
    other = Tokenizer.train_from_sentences(["ein zwei drei vier"] * 10, 20, None)
    other.save(out / "spm.model")
    with pytest.raises(InputError, match="spm.model: sha256 .* manifest expects"):
        load_corpus(out, "train")
    with pytest.raises(InputError, match="spm.model: sha256"):
        load_tokenizer(out)


def test_given_tokenizer_is_used(raw: Path, tmp_path: Path) -> None:
    """A vocabulary can be reused across preparations (e.g. for new test sets)."""
    tok = Tokenizer.train_from_sentences(
        [x for lang in ("en", "de") for x in read_lines(raw / f"valid.{lang}")], 300, None
    )
    m = _prepare(raw, tmp_path / "out", tokenizer=tok)
    assert m["spm_model"]["sha256"] == tok.sha256 and m["vocab_size"] == 300
    assert m["spm_model"]["trained"] is False


def test_corpus_rejects_inconsistent_tensors() -> None:
    """A truncated or mismatched tensor file is refused rather than misread."""
    good = {
        "src_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
        "src_offsets": torch.tensor([0, 2, 3]),
        "tgt_ids": torch.tensor([8], dtype=torch.int32),
        "tgt_offsets": torch.tensor([0, 0, 1]),
        "line_numbers": torch.tensor([1, 2]),
    }
    c = Corpus(good)
    assert len(c) == 2 and c.src(0) == [5, 6] and c.tgt(0) == [] and c.tgt_lens.tolist() == [0, 1]
    with pytest.raises(InputError, match="src ids/offsets"):
        Corpus(dict(good, src_offsets=torch.tensor([0, 2, 4])))


def test_option_validation(tmp_path: Path) -> None:
    """Bad options fail before any work."""
    with pytest.raises(ValueError, match="on_empty"):
        prepare("en", "de", tmp_path / "x", out=tmp_path / "o", on_empty="drop")
    with pytest.raises(TypeError, match="out"):
        prepare("en", "de", tmp_path / "x")
    assert data.find_input  # public helper used by the CLI
    manifest = tmp_path / "o2" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"format": 999}))
    with pytest.raises(InputError, match="format 999"):
        load_manifest(manifest.parent)
