"""Separate vocabularies (`prepare --vocab separate`, issue 73): an En->Fr slice with a
sentencepiece model per language prepares, trains, decodes, scores and exports to
CTranslate2 and MarianMT; the checkpoint records both models; nothing ties the source
embedding to the target's."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

import aiayn
from aiayn.checkpoints import load_checkpoint, load_model
from aiayn.data.corpus import load_corpus, load_manifest
from aiayn.data.tokenizer import (
    PAIR_MAGIC,
    PairTokenizer,
    Tokenizer,
    load_vocabulary,
    vocabulary_from_bytes,
)
from aiayn.decoding import score as score_mod
from aiayn.files import InputError, read_lines
from aiayn.model import count_parameters, parameter_formula
from aiayn.training.trainer import train
from helpers import MULTI30K, SMALL_TRAINING, cli, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

LINES = 300


@pytest.fixture(scope="module")
def en_fr(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 Multi30k En-Fr pairs (40 of them as valid), prepared with separate vocabularies."""
    if not MULTI30K.is_dir():
        pytest.skip("needs ../shared/data/multi30k")
    root = tmp_path_factory.mktemp("enfr")
    for lang in ("en", "fr"):
        lines = list(islice(read_lines(MULTI30K / f"train.{lang}.gz"), LINES))
        (root / f"train.{lang}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        (root / f"valid.{lang}").write_text("".join(f"{x}\n" for x in lines[:40]), encoding="utf-8")
    code, _, err = cli(
        "prepare", "-s", "en", "-t", "fr", "--trainpref", root / "train",
        "--validpref", root / "valid", "--out", root / "prep", "--vocab-size", "200",
        "--vocab", "separate",
    )  # fmt: skip
    assert code == 0, err
    return root


def test_each_side_is_encoded_with_its_own_vocabulary(en_fr: Path) -> None:
    prep = en_fr / "prep"
    manifest = load_manifest(prep)
    assert manifest["vocab"] == "separate" and manifest["vocab_size"] == 200
    vocab = load_vocabulary(prep / "spm.model")
    assert isinstance(vocab, PairTokenizer) and vocab.source.sha256 != vocab.target.sha256
    assert vocab.sha256 == manifest["spm_model"]["sha256"]
    corpus = load_corpus(prep, "valid")
    en = (en_fr / "valid.en").read_text(encoding="utf-8").splitlines()
    fr = (en_fr / "valid.fr").read_text(encoding="utf-8").splitlines()
    for i in range(5):
        assert list(corpus.src(i)) == vocab.source.encode(en[i])
        assert list(corpus.tgt(i)) == vocab.target.encode(fr[i])
    # each side's model learned on its own side: French words are whole pieces in French
    assert len(vocab.target.encode(fr[0])) < len(vocab.source.encode(fr[0]))


def test_a_pair_serializes_and_refuses_different_sizes(en_fr: Path) -> None:
    vocab = load_vocabulary(en_fr / "prep" / "spm.model")
    assert isinstance(vocab, PairTokenizer)
    b = vocab.to_bytes()
    assert b.startswith(PAIR_MAGIC)
    again = vocabulary_from_bytes(b)
    assert isinstance(again, PairTokenizer) and again.sha256 == vocab.sha256
    shared = vocabulary_from_bytes(vocab.source.to_bytes())
    assert isinstance(shared, Tokenizer)
    small = Tokenizer.train_from_sentences(["a b c d e f"] * 10, 12, None)
    with pytest.raises(InputError, match="one size"):
        PairTokenizer(vocab.source, small)


def test_it_trains_decodes_scores_and_exports(
    en_fr: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    over = {"max_steps": 60, "save_interval_steps": 60, "valid_interval_steps": 60}
    result = train(tiny_config({**SMALL_TRAINING, **over}), en_fr / "prep", tmp_path / "run")
    ckpt = result.last_checkpoint
    assert ckpt is not None
    raw = load_checkpoint(ckpt)
    assert raw["tokenizer"].numpy().tobytes().startswith(PAIR_MAGIC)  # both models recorded
    model, vocab, cfg = load_model(ckpt, fast=False)
    assert isinstance(vocab, PairTokenizer) and not cfg.model.share_embeddings
    assert cfg.model.share_target_embeddings  # tied only where the vocabulary is shared:
    assert model.src_embed.token.weight is not model.tgt_embed.token.weight
    assert model.generator.weight is model.tgt_embed.token.weight  # the target side's
    assert count_parameters(model) == parameter_formula(cfg.model)

    t = aiayn.Translator.load(ckpt, dtype="fp32")
    lines = (en_fr / "valid.en").read_text(encoding="utf-8").splitlines()[:8]
    greedy = t.translate(lines, beam=1)
    assert len(greedy) == 8 and any(greedy)
    nbest = t.translate(lines[:2], beam=2, nbest=2)
    # the output is the target vocabulary's text: it re-encodes (French side) to what was scored
    scores = t.score(lines[:2], [n[0].text for n in nbest])
    assert all(s.total < 0 for s in scores)
    seen: list[list[list[int]]] = []  # the references are read with the target's model
    real = score_mod.score_ids
    monkeypatch.setattr(
        score_mod, "score_ids", lambda m, s, r, *a: seen.append(r) or real(m, s, r, *a)
    )
    refs = [n[0].text for n in nbest]
    t.score(lines[:2], refs)
    assert seen == [[vocab.target.encode(r) for r in refs]]
    assert seen[0] != [vocab.source.encode(r) for r in refs]

    ct2 = pytest.importorskip("ctranslate2")
    from aiayn.deploy.export import ct2_translate, export_ctranslate2

    out = export_ctranslate2(ckpt, tmp_path / "ct2")
    assert (out / "sentencepiece.target.model").read_bytes() == vocab.target.to_bytes()
    assert (out / "sentencepiece.model").read_bytes() == vocab.source.to_bytes()
    translator = ct2.Translator(str(out), device="cpu", compute_type="float32")
    assert ct2_translate(out, lines, beam=1, translator=translator) == greedy

    pytest.importorskip("transformers")
    from aiayn.deploy.marian import export_marian, marian_translate

    out = export_marian(ckpt, tmp_path / "marian")
    assert (out / "target_vocab.json").is_file()
    assert marian_translate(out, lines, beam=1) == greedy
