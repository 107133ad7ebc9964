"""`prepare --streaming` (data.stream_prepare) against the in-memory `prepare`, and the
memory-mapped corpus it writes (data.mmap_corpus)."""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data.corpus import load_corpus, load_manifest, load_tokenizer
from aiayn.data.mmap_corpus import ARRAYS, MmapCorpus, NpyWriter, array_file
from aiayn.data.prepare import prepare
from aiayn.data.stream_prepare import prepare_streaming
from aiayn.data.synthetic import SyntheticPairs, write_corpus
from aiayn.files import InputError
from helpers import assert_one_line_error, cli, tiny_config

SETTINGS = {"vocab_size": 500, "max_len": 200, "max_len_ratio": 3.0}


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,500 synthetic pairs (train, gzip) and 100 (valid, plain), with a line of each
    cleaning reason: PREFIX train / valid under the returned directory."""
    root = tmp_path_factory.mktemp("stream")
    write_corpus(root / "train", 1500, seed=3)
    write_corpus(root / "valid", 100, seed=4, gz=False)
    return root


def _crafted(root: Path) -> tuple[Path, dict[str, int]]:
    """A training text with every cleaning reason, and the counts expected with
    on_bad_utf8='skip' and SETTINGS: 200 synthetic pairs of under 20 words (far from the
    limits) and, at 0-based positions 10, 20, ..., 80, one pair per case."""
    src, tgt = SyntheticPairs(seed=5).block(400)
    short = [
        (s, t) for s, t in zip(src, tgt, strict=True) if max(len(s.split()), len(t.split())) < 20
    ]
    lines = [(s.encode(), t.encode()) for s, t in short[:200]]
    long = b" ".join([b"kalimera"] * 250)
    specials = [
        (b"bad \xff utf8", b"fine words here", "bad_utf8"),
        (b"fine words here", b"bad \xc3\x28 utf8", "bad_utf8"),
        (b"", b"fine words here", "empty"),
        (b"fine words here", b"   \t ", "empty"),
        ("\u2028".encode(), b"fine words", "empty"),  # str.strip() removes it too
        (long, long, "too_long"),
        (b"one", b"one two three four five six seven eight nine ten eleven", "ratio"),
        (b"fine words here", b"fine words there", ""),  # kept
    ]
    expected = {"bad_utf8": 0, "empty": 0, "too_long": 0, "ratio": 0}
    for pos, (s, t, reason) in zip(range(10, 90, 10), specials, strict=True):
        lines.insert(pos, (s, t))
        if reason:
            expected[reason] += 1
    _write(root / "crafted.en", [s for s, _ in lines])
    _write(root / "crafted.de", [t for _, t in lines])
    return root / "crafted", expected


def _pairs(c: object) -> list[tuple[list[int], list[int], int]]:
    return [(c.src(i), c.tgt(i), int(c.line_numbers[i])) for i in range(len(c))]  # type: ignore[attr-defined]


def test_streamed_equals_in_memory_prepare(corpus: Path, tmp_path: Path) -> None:
    """Same vocabulary bytes (sample = the whole corpus, one thread), same pairs, same
    line numbers, same drop counts as the in-memory prepare; a second implementation
    (sentencepiece on the raw lines) agrees on the ids."""
    mem = prepare(
        "en", "de", corpus / "train", corpus / "valid", None, tmp_path / "mem", **SETTINGS
    )
    streamed = prepare_streaming(
        "en",
        "de",
        corpus / "train",
        corpus / "valid",
        None,
        tmp_path / "str",
        workers=0,
        spm_threads=1,
        spm_sample=10_000,
        **SETTINGS,
    )
    assert streamed["format"] == 2 and mem["format"] == 1
    assert streamed["spm_model"]["sha256"] == mem["spm_model"]["sha256"]
    for split in ("train", "valid"):
        a, b = load_corpus(tmp_path / "mem", split), load_corpus(tmp_path / "str", split)
        assert isinstance(b, MmapCorpus) and not isinstance(a, MmapCorpus)
        assert _pairs(a) == _pairs(b)
        assert torch.equal(a.src_lens, b.src_lens.long())
        assert torch.equal(a.tgt_lens, b.tgt_lens.long())
        for key in ("lines", "pairs", "dropped", "src_tokens", "tgt_tokens"):
            assert mem["splits"][split][key] == streamed["splits"][split][key], key
    assert mem["splits"]["train"]["dropped"]["too_long"] > 0  # the filter was exercised
    tok = load_tokenizer(tmp_path / "str")
    raw = gzip.decompress((corpus / "train.en.gz").read_bytes()).decode().split("\n")
    c = load_corpus(tmp_path / "str", "train")
    for i in range(0, len(c), 97):
        assert c.src(i) == tok.encode(raw[int(c.line_numbers[i]) - 1])


def test_cleaning_counts_every_reason(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each reason counted once per crafted line, logged with file and line, and the same
    counts as the in-memory prepare's."""
    prefix, expected = _crafted(tmp_path)
    tok = load_tokenizer(_prepared(corpus, tmp_path / "vocab"))
    opts = dict(SETTINGS, on_bad_utf8="skip", tokenizer=tok)
    with caplog.at_level(logging.WARNING):
        m = prepare_streaming("en", "de", prefix, None, None, tmp_path / "s", workers=0, **opts)
    mem = prepare("en", "de", prefix, None, None, tmp_path / "m", **opts)
    assert m["splits"]["train"]["dropped"] == expected
    assert mem["splits"]["train"]["dropped"] == expected
    logged = caplog.text
    for lineno in (11, 21, 31, 41, 51, 61, 71):  # 1-based lines of the dropped specials
        assert f"crafted.en:{lineno}" in logged or f"crafted.de:{lineno}" in logged, lineno
    for words in ("bad utf8", "empty", "too long", "ratio"):
        assert f"dropped pair ({words})" in logged
    assert _pairs(load_corpus(tmp_path / "s", "train")) == _pairs(
        load_corpus(tmp_path / "m", "train")
    )


def _prepared(corpus: Path, out: Path, **kw: object) -> Path:
    if not (out / "manifest.json").exists():
        prepare_streaming(
            "en", "de", corpus / "train", corpus / "valid", None, out, workers=0, **SETTINGS, **kw
        )  # type: ignore[arg-type]
    return out


def test_parallel_encoding_equals_serial(corpus: Path, tmp_path: Path) -> None:
    """Two worker processes write byte-identical arrays to one process's (chunks of 10,000
    lines: a corpus of 25,000 pairs makes three chunks, so order across workers matters)."""
    write_corpus(tmp_path / "big", 25_000, seed=7)
    tok = load_tokenizer(_prepared(corpus, tmp_path / "vocab"))
    hashes = []
    for workers in (0, 2):
        m = prepare_streaming(
            "en", "de", tmp_path / "big", None, None, tmp_path / f"w{workers}",
            workers=workers, tokenizer=tok, **SETTINGS,
        )  # fmt: skip
        hashes.append({k: f["sha256"] for k, f in m["splits"]["train"]["files"].items()})
        assert m["splits"]["train"]["lines"] == 25_000
    assert hashes[0] == hashes[1]


def _rss_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise AssertionError(key)


def test_mmap_corpus_maps_instead_of_loading(tmp_path: Path) -> None:
    """A split of 400 MB of ids: the arrays are np.memmap and the torch tensors views of
    them; opening it grows the resident memory by the lengths (~1 MB), not the 400 MB;
    reading pairs grows the anonymous memory (the process's own) by the pairs only.

    What reading does add is file-backed RSS: the page-cache pages mapped around each
    pair read (on this kernel, whole large folios of up to 2 MB). Those are shared by
    every process mapping the file and dropped by the kernel under pressure, so they are
    not the process's memory, and are left out of the second check."""
    n, per = 100_000, 500
    rng = np.random.default_rng(0)
    for key in ARRAYS:
        with open(tmp_path / array_file("train", key), "wb") as f:
            w = NpyWriter(f, np.int64 if "ids" not in key else np.int32)
            if key.endswith("_ids"):
                for _ in range(10):
                    w.append(rng.integers(4, 30_000, size=n * per // 10, dtype=np.int32))
            elif key.endswith("_offsets"):
                w.append(np.arange(n + 1, dtype=np.int64) * per)
            else:
                w.append(np.arange(1, n + 1))
            w.close()
    ids_kib = 2 * n * per * 4 // 1024
    anon, total = _rss_kib("RssAnon:"), _rss_kib("RssAnon:") + _rss_kib("RssFile:")
    c = MmapCorpus(tmp_path, "train")
    opened = _rss_kib("RssAnon:") + _rss_kib("RssFile:") - total
    assert opened < ids_kib // 100, (opened, ids_kib)
    pairs = [c.src(i) for i in range(0, n, 1000)] + [c.tgt(i) for i in range(0, n, 1000)]
    assert _rss_kib("RssAnon:") - anon < ids_kib // 50
    assert isinstance(c.arrays["src_ids"], np.memmap)
    assert np.shares_memory(c._src_ids.numpy(), c.arrays["src_ids"])
    assert c.src_lens.dtype == torch.int32 and len(c) == n
    assert all(len(p) == per for p in pairs)
    whole = np.load(tmp_path / "train.src_ids.npy", mmap_mode="r")
    assert pairs[1] == whole[1000 * per : 1001 * per].tolist()


def test_both_directions_stays_mapped(corpus: Path, tmp_path: Path) -> None:
    c = load_corpus(_prepared(corpus, tmp_path / "p"), "train")
    both = c.both_directions()
    n = len(c)
    assert len(both) == 2 * n
    assert both.src(n + 3) == c.tgt(3) and both.tgt(n + 3) == c.src(3)
    assert both.src(3) == c.src(3)
    assert torch.equal(both.src_lens[n:], c.tgt_lens)


def test_truncated_or_corrupt_array_refused(corpus: Path, tmp_path: Path) -> None:
    out = _prepared(corpus, tmp_path / "p")
    ids = out / "train.src_ids.npy"
    good = ids.read_bytes()
    ids.write_bytes(good[:-40])
    with pytest.raises(InputError, match=r"train\.src_ids\.npy: \d+ bytes, the manifest expects"):
        load_corpus(out, "train")
    with pytest.raises(InputError, match="truncated or corrupt"):  # without the manifest
        MmapCorpus(out, "train")
    ids.write_bytes(good[:-4] + bytes([good[-4] ^ 1]) + good[-3:])  # same size, one bit
    with pytest.raises(InputError, match=r"train\.src_ids\.npy: sha256 .* manifest expects"):
        load_corpus(out, "train")
    ids.write_bytes(good)
    (out / "train.tgt_offsets.npy").unlink()
    with pytest.raises(InputError, match=r"train\.tgt_offsets\.npy: missing"):
        load_corpus(out, "train")


def test_bad_inputs_refused_before_out_is_touched(tmp_path: Path) -> None:
    _write(tmp_path / "a.en", [b"one", b"two"])
    _write(tmp_path / "a.de", [b"eins"])
    with pytest.raises(InputError, match=r"line counts differ: .*a\.en has 2 lines"):
        prepare_streaming("en", "de", tmp_path / "a", out=tmp_path / "o", workers=0)
    data = gzip.compress(b"".join(b"line %d\n" % i for i in range(5000)))
    (tmp_path / "b.en.gz").write_bytes(data[: len(data) // 2])
    _write(tmp_path / "b.de", [b"x"] * 5000)
    with pytest.raises(InputError, match=r"b\.en\.gz: truncated or corrupt gzip"):
        prepare_streaming("en", "de", tmp_path / "b", out=tmp_path / "o", workers=0)
    _write(tmp_path / "c.en", [b"fine", b"bad \xff"])
    _write(tmp_path / "c.de", [b"gut", b"auch"])
    with pytest.raises(InputError, match=r"c\.en:2: invalid UTF-8 at byte 4"):
        prepare_streaming("en", "de", tmp_path / "c", out=tmp_path / "o", workers=0)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_cli_streaming_then_train_tiny(corpus: Path, tmp_path: Path) -> None:
    """`aiayn prepare --streaming` then three training steps of the tiny preset on the
    mapped arrays, with validation; streaming flags without --streaming are refused."""
    code, _, err = cli(
        "prepare", "-s", "en", "-t", "de", "--trainpref", corpus / "train",
        "--out", tmp_path / "x", "--workers", "2",
    )  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "--workers need --streaming")
    code, out, err = cli(
        "prepare", "-s", "en", "-t", "de", "--trainpref", corpus / "train",
        "--validpref", corpus / "valid", "--out", tmp_path / "data", "--streaming",
        "--workers", "1", "--spm-sample", "1000", "--spm-threads", "1", "--vocab-size", "300",
    )  # fmt: skip
    assert code == 0, err
    m = load_manifest(tmp_path / "data")
    assert m["spm_model"]["sample"]["sentences"] == 1000
    assert m["settings"]["streaming"] == {"workers": 1, "spm_sample": 1000, "spm_threads": 1}
    from aiayn.training.trainer import train

    cfg = tiny_config({"train.max_tokens": 300, "valid_interval_steps": 3}, max_steps=3)
    train(cfg, tmp_path / "data", tmp_path / "run")
    lines = (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"step"' in x]
    assert any(r.get("step") == 3 for r in steps)
    assert any("valid_nll" in r for r in steps), lines[-3:]


def test_unigram_vocabulary(corpus: Path, tmp_path: Path) -> None:
    """--model-type unigram: a unigram model of the asked size (the En-Fr vocabulary)."""
    m = prepare_streaming(
        "en", "de", corpus / "train", None, None, tmp_path / "u", workers=0,
        model_type="unigram", **SETTINGS,
    )  # fmt: skip
    assert m["spm_model"]["model_type"] == "unigram"
    assert m["vocab_size"] == SETTINGS["vocab_size"]
    assert load_tokenizer(tmp_path / "u")._sp.encode("kalimera")  # it encodes


# --------------------------------------------------------------------------- at scale
_SCALE_SCRIPT = r"""
import json, sys, resource
from pathlib import Path
from aiayn.config import apply_overrides, get_preset
from aiayn.training.trainer import train

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

if __name__ == "__main__":
    data, run = sys.argv[1], sys.argv[2]
    cfg = apply_overrides(get_preset("tiny"), {
        "N": 1, "d_model": 32, "d_ff": 64, "h": 2, "d_k": 16, "d_v": 16,
        "train.max_tokens": 500, "max_steps": 100, "warmup_steps": 10,
        "valid_interval_steps": 1000, "save_interval_steps": 1000, "dtype": "fp32"})
    train(cfg, data, run)
    print(json.dumps({"hwm": kib("VmHWM:"), "anon": kib("RssAnon:"), "file": kib("RssFile:")}))
"""


def _prepare_and_train(root: Path, pairs: int) -> dict[str, int]:
    root.mkdir(parents=True)
    write_corpus(root / "train", pairs, seed=11)
    write_corpus(root / "valid", 500, seed=12, gz=False)
    prepare_streaming(
        "en", "de", root / "train", root / "valid", None, root / "data",
        vocab_size=8000, spm_sample=200_000,
    )  # fmt: skip
    for f in root.glob("train.*.gz"):
        f.unlink()
    script = root / "train_micro.py"
    script.write_text(_SCALE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(root / "data"), str(root / "run")],
        capture_output=True,
        text=True,
        check=True,
    )
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    rss["array_kib"] = (
        sum(os.path.getsize(root / "data" / array_file("train", k)) for k in ARRAYS) // 1024
    )
    return rss


@pytest.mark.slow
def test_scale_rss_does_not_follow_the_corpus(tmp_path: Path) -> None:
    """4.5M synthetic pairs (AIAYN_SCALE_PAIRS to change) stream through prepare and 100
    training steps of a micro model; so do 0.5M. The training process's anonymous memory
    grows by far less than the token arrays do: they are mapped, not loaded, and the
    epoch's batches are arrays (`EpochBatches`: ~4 bytes a pair, plus the lengths' 8)."""
    big = int(os.environ.get("AIAYN_SCALE_PAIRS", 4_500_000))
    small = big // 9
    r_small = _prepare_and_train(tmp_path / "small", small)
    r_big = _prepare_and_train(tmp_path / "big", big)
    print(json.dumps({"small": r_small, "big": r_big}))
    grown_arrays = r_big["array_kib"] - r_small["array_kib"]
    grown_anon = r_big["anon"] - r_small["anon"]
    assert grown_arrays > 500_000 * big / 4_500_000  # the arrays did grow (~1 GB)
    assert grown_anon < 0.15 * grown_arrays, (r_small, r_big)
