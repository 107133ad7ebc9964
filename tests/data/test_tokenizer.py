"""Tests for the shared BPE vocabulary (section 5.1; RELIABILITY E6)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sentencepiece as spm

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.data.tokenizer import Tokenizer
from aiayn.files import InputError, read_lines, sha256_file
from helpers import MULTI30K  # noqa: E402

needs_multi30k = pytest.mark.skipif(
    not (MULTI30K / "train.en.gz").is_file(),
    reason=f"Multi30k not found at {MULTI30K} (see shared/data/README.md)",
)

N_LINES = 1000  # per language: enough for a real vocabulary, fast to train


@pytest.fixture(scope="module")
def train_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The first N_LINES English and German training sentences, as plain text files."""
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    d = tmp_path_factory.mktemp("text")
    out = []
    for lang in ("en", "de"):
        lines = list(read_lines(MULTI30K / f"train.{lang}.gz"))[:N_LINES]
        path = d / f"train.{lang}"
        path.write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        out.append(path)
    return out


@pytest.fixture(scope="module")
def tok(train_files: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.train(train_files, 1000, tmp_path_factory.mktemp("m") / "spm.model")


@pytest.mark.rows("E6")
@needs_multi30k
def test_roundtrip_on_training_lines(
    tok: Tokenizer, train_files: list[Path], record_property: pytest.RecordProperty
) -> None:
    """E6: decode(encode(x)) == normalize(x) for every training line; the lines where it
    differs from x itself are only whitespace normalisation, and are counted."""
    lines = [x for path in train_files for x in read_lines(path)]
    not_normalized = [x for x in lines if tok.decode(tok.encode(x)) != tok.normalize(x)]
    assert not_normalized == []
    failures = [x for x in lines if tok.decode(tok.encode(x)) != x]
    record_property("roundtrip_failures", f"{len(failures)} of {len(lines)}")
    logging.getLogger(__name__).info("round trip != x: %d of %d", len(failures), len(lines))
    assert len(failures) < 0.01 * len(lines)
    for x in failures:  # each one differs from its text by whitespace only
        assert tok.decode(tok.encode(x)) == " ".join(x.split())


@needs_multi30k
def test_a_lowercasing_vocabulary_lowercases_what_it_encodes(
    tok: Tokenizer, train_files: list[Path]
) -> None:
    """recipe.lowercase: the vocabulary itself lowercases, so a checkpoint trained on
    lowercased text lowercases any input it translates (and keeps German's ß)."""
    lc = Tokenizer.train(train_files, 1000, None, lowercase=True)
    assert lc.sha256 != tok.sha256
    lines = [x for path in train_files for x in read_lines(path)]
    assert sum(x != x.lower() for x in lines) > 0.9 * len(lines)
    for x in lines[:200] + ["Eine Frau geht die STRASSE entlang, Straße."]:
        assert lc.encode(x) == lc.encode(x.lower())
        assert lc.decode(lc.encode(x)) == lc.normalize(x) == tok.normalize(x.lower())
    pieces = [lc.id_to_piece(i) for i in range(lc.vocab_size)]
    assert all(p == p.lower() for p in pieces)
    assert any(p != p.lower() for p in (tok.id_to_piece(i) for i in range(tok.vocab_size)))


@pytest.mark.rows("E6")
@needs_multi30k
def test_training_is_deterministic(train_files: list[Path], tmp_path: Path) -> None:
    """E6: learning the vocabulary twice on the same data gives byte-identical models;
    different data gives a different one (so the comparison can fail)."""
    a = Tokenizer.train(train_files, 800, tmp_path / "a.model")
    b = Tokenizer.train(train_files, 800, tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert a.sha256 == b.sha256 == sha256_file(tmp_path / "a.model")
    c = Tokenizer.train(train_files[:1], 800, None)
    assert c.sha256 != a.sha256
    assert list(tmp_path.glob(".*.tmp")) == []  # written atomically


@needs_multi30k
def test_special_ids_and_shared_vocabulary(tok: Tokenizer) -> None:
    """Section 3.4 needs one vocabulary for both languages, with our fixed special ids."""
    assert tok.vocab_size == 1000
    assert [tok.id_to_piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == [
        "<pad>",
        "<unk>",
        "<s>",
        "</s>",
    ]
    en, de = tok.encode("A man is walking."), tok.encode("Ein Mann geht spazieren.")
    for ids in (en, de):
        assert ids and BOS_ID not in ids and EOS_ID not in ids and PAD_ID not in ids
        assert UNK_ID not in ids  # both languages are covered by the one vocabulary
    assert tok.decode([BOS_ID, *en, EOS_ID, PAD_ID, PAD_ID]) == "A man is walking."
    assert "".join(tok.encode_pieces("A man")).replace("\u2581", " ").strip() == "A man"
    assert UNK_ID in tok.encode("\u2603")  # a snowman never occurs in the training text
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


@pytest.mark.rows("F10")
@needs_multi30k
def test_bytes_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    """Checkpoints carry the vocabulary as bytes (RELIABILITY F10): from_bytes(to_bytes())
    and save/load give the same model, identified by the same sha256."""
    again = Tokenizer.from_bytes(tok.to_bytes())
    assert again.sha256 == tok.sha256 and again.to_bytes() == tok.to_bytes()
    tok.save(tmp_path / "m.model")
    loaded = Tokenizer.load(tmp_path / "m.model")
    assert loaded.sha256 == tok.sha256 == sha256_file(tmp_path / "m.model")
    text = "Zwei Hunde spielen im Schnee."
    assert loaded.encode(text) == tok.encode(text)


@pytest.mark.rows("F12")
def test_bad_models_are_refused(tmp_path: Path) -> None:
    """RELIABILITY F12: a missing or corrupt model file is an error naming the path; a
    model with sentencepiece's default special ids (unk 0, bos 1, eos 2) is refused."""
    with pytest.raises(InputError, match="no such"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(InputError, match="junk.model"):
        Tokenizer.load(tmp_path / "junk.model")
    (tmp_path / "t.txt").write_text("a b c d e f g\n" * 50, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "t.txt"),
        vocab_size=12,
        model_type="bpe",
        model_prefix=str(tmp_path / "d"),
        minloglevel=2,
    )
    with pytest.raises(InputError, match="special ids"):
        Tokenizer.load(tmp_path / "d.model")


@pytest.mark.rows("E4")
def test_training_on_odd_text_and_bad_sizes(tmp_path: Path) -> None:
    """RELIABILITY E4: text with \\r and U+2028 inside lines trains and round-trips up to
    normalisation; an impossible vocabulary size is a clear error, not a crash."""
    path = tmp_path / "t.txt"
    path.write_bytes("x y\rz\n\u2028w v\n".encode() * 20)
    tok = Tokenizer.train([path], 12, None)
    assert tok.decode(tok.encode("x y\rz")) == tok.normalize("x y\rz") == "x y z"
    with pytest.raises(InputError, match="[Vv]ocabulary size"):
        Tokenizer.train([path], 5000, None)
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train([path], 4, None)
