"""Tests for aiayn.scoring.evalb: our EVALB agrees with the real one, built from its C
sources, on every printed character: the per-sentence table, the totals, both summaries,
its stderr messages, and where it stops (MAX_ERROR)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from aiayn.files import InputError
from aiayn.scoring.evalb import (
    COLLINS,
    EvalbAbortError,
    EvalbParams,
    EvalbResult,
    format_params,
    format_report,
    format_summary,
    load_params,
    parse_params,
    score_files,
    score_trees,
)
from aiayn.scoring.evalb_reference import (
    EvalbBuildError,
    build_evalb,
    find_c_compiler,
    run_evalb,
)
from helpers import ROOT

EVALB_SOURCE = ROOT.parent / "shared" / "tools" / "EVALB"
NEW = EVALB_SOURCE / "new.prm"
#: COLLINS.prm that never stops: the random and long tests score every sentence.
PATIENT = dataclasses.replace(COLLINS, max_error=100_000)


@pytest.fixture(scope="module")
def evalb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real evalb, compiled once for this module from the shared EVALB sources."""
    if not (EVALB_SOURCE / "evalb.c").is_file():
        pytest.skip(f"needs EVALB's sources in {EVALB_SOURCE}")
    if find_c_compiler() is None:
        pytest.skip("no C compiler (gcc or cc) to build the reference EVALB")
    return build_evalb(EVALB_SOURCE, tmp_path_factory.mktemp("evalb"))


def _write(path: Path, lines: list[str]) -> Path:
    path.write_bytes(b"".join(line.encode("utf-8") + b"\n" for line in lines))
    return path


def _params_file(tmp: Path, params: EvalbParams | Path) -> tuple[Path, EvalbParams]:
    if isinstance(params, Path):
        return params, load_params(params)
    return _write(tmp / "test.prm", format_params(params).splitlines()), params


def _outcome(run: Callable[[], EvalbResult]) -> tuple[EvalbResult, bool]:
    """(result, aborted) of a scorer call."""
    try:
        return run(), False
    except EvalbAbortError as e:
        return e.result, True


def assert_same(
    evalb: Path, tmp: Path, gold: list[str], test: list[str], params: EvalbParams | Path
) -> EvalbResult:
    """Score with ours and with evalb; demand the same report text, stderr, per-sentence
    records and summaries, and the same stop (if any). Returns our result."""
    g, t = _write(tmp / "gold.txt", gold), _write(tmp / "test.txt", test)
    prm, p = _params_file(tmp, params)
    ours, ours_stopped = _outcome(lambda: score_trees(gold, test, p))
    ref, ref_stopped = _outcome(lambda: run_evalb(evalb, g, t, prm))
    assert ref.evalb_stdout is not None
    assert format_report(ours) == ref.evalb_stdout
    assert ours.messages == ref.messages
    assert ours_stopped == ref_stopped
    assert ours.sentences == ref.sentences
    assert (ours.all, ours.cutoff, ours.cutoff_len) == (ref.all, ref.cutoff, ref.cutoff_len)
    return ours


# --------------------------------------------------------------------------- EVALB's files
@pytest.mark.parametrize("prm", ["sample/sample.prm", "COLLINS.prm"])
def test_sample_files(evalb: Path, prm: str) -> None:
    """EVALB's own sample: skips, length and word mismatches, EQ_LABEL and EQ_WORD."""
    gold, test = EVALB_SOURCE / "sample/sample.gld", EVALB_SOURCE / "sample/sample.tst"
    ours = score_files(gold, test, load_params(EVALB_SOURCE / prm))
    ref = run_evalb(evalb, gold, test, EVALB_SOURCE / prm)
    assert format_report(ours) == ref.evalb_stdout == ref.report
    assert ours.messages == ref.messages
    assert ours.sentences == ref.sentences and ours.all == ref.all
    assert ours.all.error_sentences > 0 and ours.all.skipped_sentences > 0


@pytest.mark.parametrize("prm", ["COLLINS.prm", "new.prm"])
def test_bug_files(evalb: Path, prm: str) -> None:
    """EVALB's bug/ example: mislabelled quotes, length errors under COLLINS.prm, put back
    by the 2006 fix under new.prm (QUOTE_LABEL)."""
    gold, test = EVALB_SOURCE / "bug/bug.gld", EVALB_SOURCE / "bug/bug.tst"
    ours = score_files(gold, test, load_params(EVALB_SOURCE / prm))
    ref = run_evalb(evalb, gold, test, EVALB_SOURCE / prm)
    assert format_report(ours) == ref.evalb_stdout
    assert ours.messages == ref.messages and ours.sentences == ref.sentences
    errors = ours.all.error_sentences
    assert errors == 5 if prm == "COLLINS.prm" else errors == 0


# --------------------------------------------------------------------------- edge cases
G = "(S (NP-SBJ (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))"
T = "(S (NP (DT the) (NN cat)) (VP (VBD sat)) (PP (IN on) (NP (DT the) (NN mat))) (. .))"
EDGE_CASES = {
    "identical": ([G], [G]),
    "attachment": ([G], [T]),
    "length mismatch": ([G], ["(S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))"]),
    "word mismatch": ([G], [G.replace("cat", "dog")]),
    "only punctuation": (["(S (, ,) (. .))"], ["(S (, ,) (. .))"]),
    "only punctuation, test tags words": (["(S (, ,) (. .))"], ["(S (NN ,) (NN .))"]),
    "placeholder tags on punctuation": ([G], [G.replace("(. .)", "(XX .)")]),
    "punctuation tags swapped": ([G + " ", G.replace("(. .)", "(, .)")], [G, G]),
    "unary chains": (
        ["(S (NP (NP (NN a))) (VP (VB b)))"],
        ["(S (NP (NN a)) (VP (VP (VP (VB b)))))"],
    ),
    "duplicate brackets": (
        ["(S (NP (NP (NP (NN a)) (NN b))) (VB c))"],
        ["(S (NP (NP (NN a)) (NN b)) (NP (VB c)))"],
    ),
    "function tags and indices": (
        ["(S (NP-SBJ-1 (NN a)) (VP=2 (VB b) (NP (-NONE- *T*-1))) (ADVP-TMP (RB c)))"],
        ["(S (NP (NN a)) (VP (VB b)) (PRT (RB c)))"],
    ),
    "-NONE- and -LRB- as bracket labels": (
        ["(S (-NONE- (NN a)) (VP (VB b)) (X (NN c)))"],
        ["(S (-LRB- (NN a)) (VP (VB b)) (-RRB- (NN c)))"],
    ),
    "traces only": (["(S (NP (-NONE- *)) (VP (-NONE- *T*)))"], ["(S (NP (NN a)))"]),
    "empty test line": ([G, G], ["", G]),
    "empty gold line": (["", G], [G, G]),
    "both empty": ([""], [""]),
    "whitespace only test": ([G], [" \t "]),
    "TOP and ROOT wrappers": (["(TOP " + G + ")"], ["(ROOT " + G + ")"]),
    "PTB empty root in gold only": (["( " + G + " )"], [G]),
    "PTB empty root on both": (["( " + G + " )"], ["( " + G + " )"]),
    "quote mislabelled as POS": (
        ["(S (`` `) (NP (NN a)) ('' ') (VB b))"],
        ["(S (`` `) (NP (NN a)) (POS ') (VB b))"],
    ),
    "several quotes put back on both sides": (
        ["(S ('' ') (NP (NN a) ('' ')) (VP (VB b) (POS ') ('' \")) (CD /) ('' '))"],
        ["(S (POS ') (NP (NN a) (POS ')) (VP (VB b) ('' ') (NN \")) (: /) (`` '))"],
    ),
    "double quotes as CD and NN": (
        ["(S (`` \") (NP (NN a)) ('' \") (VB b))"],
        ['(S (CD ") (NP (NN a)) (NN ") (VB b))'],
    ),
    "unclosed test bracket": ([G], [G[:-1]]),
    "surplus close bracket": ([G], [G + ")"]),
    "surplus close bracket mid-tree": (
        ["(S (NP (NN a)) (VP (VB b)))"],
        ["(S (NP (NN a))) (VP (VB b)))"],
    ),
    "close bracket before the tree": (
        ["(S (NP (NN a)) (VP (VB b)))"],
        [")(S (NP (NN a)) (VP (VB b))"],
    ),
    "no spaces, tabs and CR": (["(S(NP (NN a))\t(VP (VB b)))\r"], ["(S (NP (NN a)) (VP (VB b)))"]),
    "leaf without a word": (["(S (NN ) (VB b))"], ["(S (NN ) (VB b))"]),
    "leaf without a tag": (["(S ( a) (VB b))"], ["(S (NN a) (VB b))"]),
    "empty bracket": (["(S (NP) (VB b))"], ["(S (VB b))"]),
    "non-ASCII words": (["(S (NN café) (VB naïve))"], ["(S (NN cafe) (VB naïve))"]),
    "crossing": (
        ["(S (A (x a) (x b)) (B (x c) (x d)) (C (x e) (x f)))"],
        ["(S (x a) (D (x b) (x c)) (E (x d) (x e)) (x f))"],
    ),
    "NUL byte ends the line": (["(S (NN a) (VB b))\0 junk"], ["(S (NN a) (VB b))"]),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("params", ["COLLINS", "new.prm"])
def test_edge_cases(evalb: Path, tmp_path: Path, name: str, params: str) -> None:
    gold, test = EDGE_CASES[name]
    assert_same(evalb, tmp_path, gold, test, COLLINS if params == "COLLINS" else NEW)


@pytest.mark.parametrize(
    "line", ["this is not a tree", "(S (NP (NN a )) (VB b))", "(S (NN a b))", "(S x (NN a))"]
)
def test_unreadable_line_stops_evalb(evalb: Path, tmp_path: Path, line: str) -> None:
    """Text outside "(TAG word)" makes evalb repeat "Reading sentence" until MAX_ERROR
    stops it, without a summary; a leaf with a space before ")" is such text."""
    ours = assert_same(evalb, tmp_path, [G, G, G], [G, line, G], COLLINS)
    assert ours.aborted and len(ours.sentences) == 1
    with pytest.raises(EvalbAbortError, match="stops at line 2"):
        score_trees([G, G, G], [G, line, G])


def test_max_error_stops_at_the_same_sentence(evalb: Path, tmp_path: Path) -> None:
    """evalb exits at its (MAX_ERROR + 2)-th error, mid-table: so do we."""
    short = "(S (NP (DT the) (NN cat)) (. .))"
    gold, test = [G] * 20, [short if i % 3 else G for i in range(20)]
    for max_error in (0, 3, 10):
        params = dataclasses.replace(COLLINS, max_error=max_error)
        ours = assert_same(evalb, tmp_path, gold, test, params)
        assert ours.aborted
    ours = assert_same(evalb, tmp_path, gold, test, PATIENT)
    assert not ours.aborted and ours.all.error_sentences == 13


def test_placeholder_punctuation_tags_are_length_errors(evalb: Path, tmp_path: Path) -> None:
    """A parser that tags punctuation "XX" keeps words that gold deletes (",", "."): every
    such sentence is a length error, out of all totals, and counts towards MAX_ERROR."""
    gold = ["(S (NP (NN a)) (, ,) (VP (VB b)) (. .))"] * 3
    test = ["(S (NP (XX a)) (XX ,) (VP (XX b)) (XX .))"] * 3
    ours = assert_same(evalb, tmp_path, gold, test, COLLINS)
    assert ours.all.error_sentences == 3 and ours.all.valid_sentences == 0
    assert ours.sentences[0].errors == ("1 : Length unmatch (2|4)",)
    assert ours.all.f1_is_nan and "-nan" in format_report(ours)
    # with the gold punctuation tags kept, only the other tags are wrong
    kept = ["(S (NP (XX a)) (, ,) (VP (XX b)) (. .))"] * 3
    ours = assert_same(evalb, tmp_path, gold, kept, COLLINS)
    assert ours.all.f1 == 100.0 and ours.all.tagging_accuracy == 0.0


def test_unlabeled(evalb: Path, tmp_path: Path) -> None:
    unlabeled = dataclasses.replace(COLLINS, labeled=False)
    gold, test = [G, G], [T, G.replace("NP", "XP").replace("VP", "YP")]
    ours = assert_same(evalb, tmp_path, gold, test, unlabeled)
    labeled = score_trees(gold, test)
    assert ours.all.matched_brackets > labeled.all.matched_brackets


def test_cutoff_length_boundary(evalb: Path, tmp_path: Path) -> None:
    """Sentence length is the gold's leaves, punctuation included, traces not: 40 words
    are in the "len<=40" summary, 41 are not, 40 words and a trace are."""

    def sentence(n: int, trace: bool = False) -> str:
        leaves = " ".join(f"(NN w{i})" for i in range(n - 1)) + " (. .)"
        return f"(S (NP {leaves}){' (NP (-NONE- *T*-1))' if trace else ''})"

    gold = [sentence(40), sentence(41), sentence(40, trace=True), sentence(39)]
    test = [g.replace("(NP ", "(VP ", 1) for g in gold]
    ours = assert_same(evalb, tmp_path, gold, test, COLLINS)
    assert [s.length for s in ours.sentences] == [40, 41, 40, 39]
    assert ours.cutoff.sentences == 3 and ours.all.sentences == 4
    other = assert_same(evalb, tmp_path, gold, test, dataclasses.replace(COLLINS, cutoff_len=39))
    assert other.cutoff.sentences == 1


def test_eq_word_and_custom_params(evalb: Path, tmp_path: Path) -> None:
    """EVALB's sample.prm settings and more: EQ_WORD, EQ_LABEL, no '.' deletion."""
    params = parse_params(
        [
            "MAX_ERROR 100",
            "CUTOFF_LEN 3",
            "DELETE_LABEL TOP",
            "DELETE_LABEL NP",
            "DELETE_LABEL_FOR_LENGTH .",
            "EQ_LABEL T TT",
            "EQ_LABEL VP S",
            "EQ_WORD This this",
        ]
    )
    gold = ["(TOP (S (NP (T This)) (VP (V is) (NP (A a) (N pen))) (. .)))", G]
    test = ["(S (NP (TT this)) (S (V is) (XP (A a) (N pen))) (. .))", T]
    ours = assert_same(evalb, tmp_path, gold, test, params)
    assert ours.sentences[0].status == 0 and ours.sentences[0].length == 4


def test_lines_longer_than_evalbs_buffer(evalb: Path, tmp_path: Path) -> None:
    """evalb reads 4999 bytes at a time: a longer line becomes two "sentences", and the
    files fall out of step (here: an empty gold piece, then a gold line left over)."""
    gold = [G + " " * 6000, G, G]
    test = [G, G, G]
    ours = assert_same(evalb, tmp_path, gold, test, PATIENT)
    assert len(ours.sentences) == 3 and "too many lines in gold file" in ours.messages[-1]


@pytest.mark.parametrize("seed", [1, 2])
def test_random_trees(evalb: Path, tmp_path: Path, seed: int) -> None:
    """Hundreds of random gold trees and perturbed test trees (relabelled, flattened,
    regrouped, retagged, punctuation swapped, words dropped or changed, unbalanced):
    the whole report agrees, under COLLINS, new.prm, unlabeled and odd settings."""
    rng = random.Random(seed)
    gold, test = [], []
    for _ in range(300):
        tree = _random_tree(rng)
        gold.append(_wrap(rng, _show(tree)))
        test.append(_perturb(rng, tree))
    new = dataclasses.replace(load_params(NEW), max_error=100_000)
    odd = dataclasses.replace(
        new,
        labeled=False,
        cutoff_len=8,
        delete_labels=(*new.delete_labels, "PRT", "NP-SBJ"),
        eq_labels=(("ADVP", "PRT"), ("S", "SBAR"), ("SBAR", "VP"), ("NN", "NNS"), ("XX", ".")),
        eq_words=(("w1", "w2"),),
    )
    seen_status = set()
    for params in (PATIENT, new, dataclasses.replace(new, labeled=False), odd):
        ours = assert_same(evalb, tmp_path, gold, test, params)
        seen_status |= {s.status for s in ours.sentences}
        assert 0 < ours.all.matched_brackets < ours.all.gold_brackets
    assert seen_status == {0, 1, 2}


# --------------------------------------------------------------------------- random trees
Tree = tuple[str, "list[Tree] | str"]
WORDS = ["w1", "w2", "w3", "dog", "cat", "ran", "über", "na\u00efve", "0", "*"]
TAGS = ["NN", "NNS", "VB", "VBD", "DT", "JJ", "IN", "RB", "PRP", "CD", "POS"]
PUNCT = [(",", ","), (".", "."), (":", ";"), ("``", "``"), ("''", "''"), ("``", "'")]
PUNCT += [("''", "'"), ("''", '"'), ("``", '"'), ("POS", "'"), (":", "/")]
LABELS = ["S", "NP", "VP", "PP", "ADJP", "ADVP", "PRT", "SBAR", "WHNP", "NP-SBJ", "NP-SBJ-1"]
LABELS += ["S-TPC-2", "NP=2", "PP-LOC", "-NONE-", "S1"]


def _random_tree(rng: random.Random, depth: int = 0) -> Tree:
    if depth > 0 and (depth > 4 or rng.random() < 0.3):
        r = rng.random()
        if r < 0.15:
            return rng.choice(PUNCT)
        if r < 0.2:
            return ("-NONE-", rng.choice(["*T*-1", "0", "*"]))
        return (rng.choice(TAGS), rng.choice(WORDS))
    n = rng.choice([1, 1, 2, 2, 3, 4])
    return (rng.choice(LABELS), [_random_tree(rng, depth + 1) for _ in range(n)])


def _show(tree: Tree) -> str:
    label, kids = tree
    if isinstance(kids, str):
        return f"({label} {kids})"
    return f"({label} {' '.join(_show(k) for k in kids)})"


def _wrap(rng: random.Random, text: str) -> str:
    return rng.choice(["{}", "{}", "(TOP {})", "( {} )", "(ROOT {})"]).format(text)


def _leaves(tree: Tree) -> list[Tree]:
    label, kids = tree
    return [tree] if isinstance(kids, str) else [x for k in kids for x in _leaves(k)]


def _perturb(rng: random.Random, tree: Tree) -> str:
    """A parser's guess at `tree`: most sentences a little wrong, a few badly."""

    def edit(node: Tree) -> list[Tree]:
        label, kids = node
        if isinstance(kids, str):
            r = rng.random()
            if r < 0.05:
                return [(rng.choice(TAGS), kids)]  # wrong tag
            if r < 0.15 and label in ("NN", "NNS"):
                return [({"NN": "NNS", "NNS": "NN"}[label], kids)]  # equal under EQ_LABEL
            if r < 0.08 and label in {p for p, _ in PUNCT}:
                return [(rng.choice(PUNCT)[0], kids)]  # punctuation tag swapped
            if r < 0.09:
                return [("XX", kids)]
            if r < 0.1 and label == "-NONE-":
                return []  # parsers drop traces
            return [node]
        new_kids = [x for k in kids for x in edit(k)]
        r = rng.random()
        if r < 0.1:
            return new_kids  # bracket removed
        if r < 0.2:
            label = rng.choice(LABELS)
        elif r < 0.25 and len(new_kids) > 2:
            i = rng.randrange(len(new_kids) - 1)
            new_kids[i : i + 2] = [(rng.choice(LABELS), new_kids[i : i + 2])]
        elif r < 0.3:
            return [(label, [(rng.choice(LABELS), new_kids)])]  # unary added
        return [(label, new_kids)]

    out = edit(tree)
    guess: Tree = out[0] if len(out) == 1 else ("S", out)
    r = rng.random()
    if r < 0.02:
        return ""
    if r < 0.04:
        words = _leaves(guess)
        return _show(("S", [*words, ("NN", "extra")]))  # length mismatch
    if r < 0.05:
        return _show(guess).replace(" w1)", " w9)")  # word mismatch (if w1 occurs)
    if r < 0.06:
        return _show(guess).replace(" w1)", " w2)")  # the same word under EQ_WORD w1 w2
    text = _wrap(rng, _show(guess))
    if r < 0.08:
        return text[:-1]  # a bracket left open
    if r < 0.09:
        return text + ")"
    return text


# --------------------------------------------------------------------------- API
def test_collins_constant_is_collins_prm() -> None:
    assert load_params(EVALB_SOURCE / "COLLINS.prm") == COLLINS
    new = load_params(NEW)
    assert new.quote_labels == ("``", "''", "POS", "NN", "CD", "VBZ", ":")
    assert "S1" in new.delete_labels and new.eq_labels == (("ADVP", "PRT"),)
    assert parse_params(format_params(new).splitlines()) == new


def test_params_errors_name_file_and_line(tmp_path: Path) -> None:
    prm = _write(tmp_path / "x.prm", ["# comment", "LABELED 1", "DELETE_LABLE ,"])
    with pytest.raises(InputError, match=r"x\.prm:3: unknown keyword 'DELETE_LABLE'"):
        load_params(prm)
    with pytest.raises(InputError, match=r":1: EQ_LABEL requires two values"):
        parse_params(["EQ_LABEL ADVP"], "p")
    assert parse_params(["MAX_ERROR 7x", "LABELED 0", "CUTOFF_LEN -3"]) == EvalbParams(
        max_error=7, labeled=False, cutoff_len=-3
    )


def test_score_files_errors(tmp_path: Path) -> None:
    gold = _write(tmp_path / "gold.trees", [G, G, G])
    test = _write(tmp_path / "test.trees", [G, G])
    with pytest.raises(InputError, match=r"gold\.trees has 3 lines but .*test\.trees has 2"):
        score_files(gold, test)
    with pytest.raises(InputError, match="3 trees but test has 2"):
        score_trees([G, G, G], [G, G])
    (tmp_path / "bad.trees").write_bytes(G.encode() + b"\n(S (NN \xff))\n")
    with pytest.raises(InputError, match=r"bad\.trees:2: invalid UTF-8"):
        score_files(gold, tmp_path / "bad.trees")
    with pytest.raises(InputError, match="newline"):
        score_trees([G + "\n" + G], [G])
    assert score_trees([G + "\n"], [G]).all.f1 == 100.0


def test_summary_and_json() -> None:
    result = score_trees([G, G, G], [T, "", G.replace("cat", "dog")])
    text = format_summary(result)
    assert f"F1 {result.all.f1:.2f}" in text and "len<=40" in text
    assert "2 of 3 sentences are left out" in text
    d = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert d["all"]["valid_sentences"] == 1 and len(d["sentences"]) == 3
    empty = score_trees([G], [""])
    assert empty.all.f1 == 0.0 and empty.all.f1_is_nan
    assert "FMeasure       =   -nan" in empty.report


def test_build_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EvalbBuildError, match="no evalb.c"):
        build_evalb(tmp_path, tmp_path / "work")
    if not (EVALB_SOURCE / "evalb.c").is_file():
        pytest.skip(f"needs EVALB's sources in {EVALB_SOURCE}")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(EvalbBuildError, match="no C compiler"):
        build_evalb(EVALB_SOURCE, tmp_path / "work")


def test_run_evalb_checks_what_it_reads(evalb: Path, tmp_path: Path) -> None:
    """Negative control: an 'evalb' whose summary disagrees with its table is refused."""
    gold, test = _write(tmp_path / "g", [G, G]), _write(tmp_path / "t", [T, G])
    real = run_evalb(evalb, gold, test, EVALB_SOURCE / "COLLINS.prm").evalb_stdout
    assert real is not None and "Bracketing Recall         =  " in real
    recall = real.split("Bracketing Recall         = ")[1][:6]
    fake = tmp_path / "fake-evalb"
    (tmp_path / "out.txt").write_text(
        real.replace(f"Recall         = {recall}", "Recall         =  99.99", 1)
    )
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="prints recall = 99.99"):
        run_evalb(fake, gold, test, EVALB_SOURCE / "COLLINS.prm")


# --------------------------------------------------------------------------- the command line
def test_the_command_prints_evalbs_report_and_summary(evalb: Path) -> None:
    """`aiayn evaluate --task parse`: --report is EVALB's stdout itself (here on EVALB's
    sample with its parameter file), the default a summary of the same numbers, --json
    the numbers."""
    from helpers import cli

    gold, test = EVALB_SOURCE / "sample/sample.gld", EVALB_SOURCE / "sample/sample.tst"
    prm = EVALB_SOURCE / "sample/sample.prm"
    ref = run_evalb(evalb, gold, test, prm)
    args = ["evaluate", "--task", "parse", "--hyp", test, "--ref", gold, "--params", prm]
    code, out, _ = cli(*args, "--report")
    assert code == 0 and out == ref.evalb_stdout
    code, out, _ = cli(*args)
    assert code == 0 and f"F1 {ref.all.f1:.2f}" in out and f"P {ref.all.precision:.2f}" in out
    code, out, _ = cli(*args, "--json")
    assert code == 0 and json.loads(out)["all"]["f1"] == pytest.approx(ref.all.f1)
    code, _, err = cli("evaluate", "--hyp", test, "--ref", gold, "--params", prm)
    assert code == 2 and "--params is for --task parse" in err
