"""Parsing with a translation model (section 6.3): whatever the search writes, each input
line gets one well-formed tree over exactly its words."""

from __future__ import annotations

import shutil

import pytest

from aiayn.config import DecodeConfig
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding import parse as parse_mod
from aiayn.decoding.parse import (
    escape_word,
    flat_tree,
    parse_file,
    parse_lines,
    sentence_words,
)
from aiayn.decoding.translate import Translation, translate_lines, translate_nbest
from aiayn.files import InputError
from aiayn.parsing.linearize import delinearize
from aiayn.parsing.trees import parse_tree
from aiayn.scoring.evalb import COLLINS, score_trees
from aiayn.scoring.evalb_reference import build_evalb, run_evalb
from helpers import ROOT, random_model

EVALB = ROOT.parent / "shared" / "tools" / "EVALB"

SENTENCES = [
    "The cat sat on the mat .",
    "Stocks fell sharply , traders said .",
    "He did n't ( really ) care .",
    "Yes",
]
TREES = [
    "(S (NP XX XX )NP (VP XX (PP XX (NP XX XX )NP )PP )VP XX )S",
    "(S (S (NP XX )NP (VP XX (ADVP XX )ADVP )VP )S XX (NP XX )NP (VP XX )VP XX )S",
    "(S (NP XX )NP (VP XX XX (PRN XX (ADVP XX )ADVP XX )PRN (VP XX )VP )VP XX )S",
    "(INTJ XX )INTJ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_from_sentences(
        SENTENCES * 3 + TREES * 3, 120, None, split_by_script=False
    )


def leaves(tree: str) -> list[str]:
    return parse_tree(tree).leaves()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_untrained_models_outputs_become_trees_over_exactly_the_words(tokenizer, seed):
    """An untrained model writes garbage: every line still gets one tree over its words,
    and the lines that needed a repair are the ones counted as ill-formed."""
    model = random_model(tokenizer.vocab_size, seed)
    cfg = DecodeConfig(beam=3, alpha=0.3, max_len_a=1.0, max_len_b=20)
    result = parse_lines(model, tokenizer, SENTENCES, cfg, constrained=False)
    assert len(result.trees) == len(SENTENCES) == len(result.raw)
    for tree, line in zip(result.trees, SENTENCES, strict=True):
        assert "\n" not in tree
        assert leaves(tree) == sentence_words(line)
    # the trees are what delinearize makes of the search's own outputs
    raw = translate_lines(model, tokenizer, [" ".join(sentence_words(s)) for s in SENTENCES], cfg)
    assert result.raw == raw
    for i, (r, line) in enumerate(zip(raw, SENTENCES, strict=True)):
        tree, repairs = delinearize(r, sentence_words(line))
        assert result.trees[i] == tree.to_string()
        assert (i in result.ill_formed) == (repairs.total > 0)
    assert result.repairs.total >= len(result.ill_formed)
    # the subwords the search emitted (re-encoding the decoded text may differ)
    nbest, _ = translate_nbest(
        model, tokenizer, [" ".join(sentence_words(s)) for s in SENTENCES], cfg
    )
    assert result.output_tokens == sum(len(n[0].tokens) for n in nbest)
    summary = result.summary()
    assert summary["sentences"] == 4 and summary["ill_formed"] == len(result.ill_formed)


def test_well_formed_outputs_are_kept_and_ill_formed_ones_repaired(tokenizer, monkeypatch):
    """The search's text is the tree: a valid linearization is used as it is; a broken one
    is repaired, counted, and scores as no constituent in the no-repair row."""
    outputs = [TREES[0], "(S (NP XX XX )VP XX", TREES[2], ""]

    def fake_nbest(model, tok, lines, cfg, *args, **kwargs):
        return [[Translation(o, 0.0)] for o in outputs], None

    monkeypatch.setattr(parse_mod, "translate_nbest", fake_nbest)
    result = parse_lines(
        None,  # type: ignore[arg-type]
        tokenizer,
        SENTENCES,
        DecodeConfig(),
        constrained=False,
    )
    assert result.ill_formed == [1, 3]
    assert result.trees[0] == delinearize(TREES[0], sentence_words(SENTENCES[0]))[0].to_string()
    assert result.repairs.total >= 2
    unrepaired = result.unrepaired()
    assert unrepaired[0] == result.trees[0] and unrepaired[2] == result.trees[2]
    assert unrepaired[1] == flat_tree(sentence_words(SENTENCES[1]))
    # scored against the repaired trees themselves: the no-repair row loses exactly the
    # brackets of the ill-formed sentences, and nothing it proposes is wrong
    gold = result.trees
    full = score_trees(gold, result.trees, COLLINS).all
    bare = score_trees(gold, unrepaired, COLLINS).all
    assert full.f1 == 100.0 and bare.precision == 100.0 and bare.recall < 100.0


def test_brackets_in_words_are_written_as_the_treebank_writes_them():
    assert sentence_words("f ( x ) [ y ] { z }") == [
        "f", "-LRB-", "x", "-RRB-", "-LSB-", "y", "-RSB-", "-LCB-", "z", "-RCB-",
    ]  # fmt: skip
    tree = flat_tree(["He", "said", ",", "no", "."])
    assert tree == "(TOP (XX He) (XX said) (, ,) (XX no) (. .))"


def test_an_empty_sentence_is_an_error_naming_its_line(tokenizer, tmp_path):
    path = tmp_path / "in.words"
    path.write_text("A cat .\n\nDogs bark .\n")
    out = tmp_path / "out.trees"
    model = random_model(tokenizer.vocab_size, 0)
    with pytest.raises(InputError, match=rf"{path}:2: empty sentence"):
        parse_file(model, tokenizer, path, out, DecodeConfig(beam=1, max_len_b=5))
    assert not out.exists()  # refused before any output was opened


def test_parse_file_writes_a_tree_a_line_and_the_raw_outputs(tokenizer, tmp_path):
    path = tmp_path / "in.words"
    path.write_text("".join(f"{s}\n" for s in SENTENCES))
    out, raw = tmp_path / "out.trees", tmp_path / "out.lin"
    model = random_model(tokenizer.vocab_size, 1)
    result, summary = parse_file(
        model, tokenizer, path, out, DecodeConfig(beam=2, max_len_b=12), raw_path=raw
    )
    trees = out.read_text().splitlines()
    assert trees == result.trees and raw.read_text().splitlines() == result.raw
    assert [leaves(t) for t in trees] == [sentence_words(s) for s in SENTENCES]
    assert summary["sentences"] == 4 and summary["output_tokens_per_s"] > 0


@pytest.mark.rows("F9")
def test_bad_utf8_replaced_counted_and_partial_as_translate_does(tokenizer, tmp_path, caplog):
    """RELIABILITY F9, as `translate_file`: an invalid UTF-8 line is replaced (U+FFFD) and
    warned about with its line number; every line still gets its tree; the summary counts
    it and marks the result partial (the CLI then exits 3)."""
    path = tmp_path / "in.words"
    path.write_bytes(b"A cat .\nDogs \xe9 bark .\nYes\n")
    out = tmp_path / "out.trees"
    model = random_model(tokenizer.vocab_size, 0)
    with caplog.at_level("WARNING"):
        _, summary = parse_file(model, tokenizer, path, out, DecodeConfig(beam=1, max_len_b=5))
    assert summary["bad_utf8"] == 1 and summary["partial"] is True
    assert "in.words:2" in caplog.text
    trees = out.read_text(encoding="utf-8").splitlines()
    assert [leaves(t) for t in trees] == [
        ["A", "cat", "."],
        ["Dogs", "\ufffd", "bark", "."],
        ["Yes"],
    ]


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
@pytest.mark.parametrize("constrained", [True, False])
def test_words_that_look_like_brackets_give_trees_evalb_reads(tokenizer, tmp_path, constrained):
    """ "-LRB-", "(hello)" and "f(x)": escaped as the treebank does on the way in, kept so
    in the tree, and the real EVALB reads the trees (scored against themselves: 100)."""
    lines = ["f(x) and (hello) and -LRB- )", "( a ) b"]
    assert sentence_words(lines[0]) == [
        "f-LRB-x-RRB-",
        "and",
        "-LRB-hello-RRB-",
        "and",
        "-LRB-",
        "-RRB-",
    ]
    assert escape_word("(hello)").replace("-LRB-", "(").replace("-RRB-", ")") == "(hello)"
    model = random_model(tokenizer.vocab_size, 2)
    cfg = DecodeConfig(beam=2, alpha=0.3, max_len_a=1.0, max_len_b=15)
    result = parse_lines(model, tokenizer, lines, cfg, constrained=constrained)
    for tree, line in zip(result.trees, lines, strict=True):
        assert leaves(tree) == sentence_words(line)
    trees = tmp_path / "trees"
    trees.write_text("".join(f"{t}\n" for t in result.trees))
    binary = build_evalb(EVALB, tmp_path / "evalb")
    ref = run_evalb(binary, trees, trees, EVALB / "COLLINS.prm")
    assert ref.all.sentences == 2 and ref.all.error_sentences == 0
    assert ref.all.f1 == 100.0 or ref.all.test_brackets == 0
