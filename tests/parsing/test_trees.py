"""Tests for trees, their cleaning and their linearization (section 6.3; the target format
of Vinyals et al. 2015, "Grammar as a Foreign Language")."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn.files import InputError
from aiayn.parsing.linearize import (
    Repairs,
    delinearize,
    linearize,
    punctuation_tag,
    punctuation_tags,
    right_branching,
)
from aiayn.parsing.trees import (
    PLACEHOLDER,
    ROOT_LABEL,
    MalformedTreeError,
    Tree,
    clean,
    clean_label,
    parse_tree,
    read_tree_lines,
    read_trees,
)

CAT = "(S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))"


def t(text: str) -> Tree:
    return parse_tree(text)


# --------------------------------------------------------------------------- strategies
LABELS = st.sampled_from(["S", "NP", "VP", "PP", "SBAR", "ADJP", "XX", "PRN"])
TAGS = st.sampled_from(["NN", "DT", "VBD", ",", ".", "''", "POS", "-LRB-", "XX"])
WORDS = st.sampled_from(["the", "cat", "sat", ",", ".", "'", "`", "--", "-LRB-", "XX", "(S"])


def _wrap(tree: Tree) -> Tree:
    return Tree(ROOT_LABEL, [tree]) if tree.is_preterminal else tree


#: Random cleaned trees: a constituent at the root, no empty constituent.
TREES = st.recursive(
    st.builds(lambda tag, w: Tree(tag, word=w), TAGS, WORDS),
    lambda kids: st.builds(Tree, LABELS, st.lists(kids, min_size=1, max_size=4)),
    max_leaves=25,
).map(_wrap)

#: Tokens a decoder might emit wrongly: known ones, misplaced, and garbage.
NOISE = st.sampled_from(
    ["(NP", ")NP", "(S", ")S", ")VP", "XX", "XX", "(", ")", "()", ")(", "NP", "xx", "(XX", "?"]
)


def is_valid(tokens: list[str], words: list[str]) -> bool:
    """The grammar of a linearized tree, written independently of `delinearize`: one
    constituent, labels matching, none empty, exactly one XX (or the word itself) per
    word."""
    stack: list[list] = []
    count, done = 0, False
    for tok in tokens:
        if done:
            return False
        word = words[count] if count < len(words) else None
        # the word itself may stand in for XX, unless it reads as a bracket token
        if stack and word is not None and (tok == "XX" or (tok == word and tok[0] not in "()")):
            count += 1
            stack[-1][1] += 1
        elif tok.startswith("(") and len(tok) > 1:
            if stack:
                stack[-1][1] += 1
            stack.append([tok[1:], 0])
        elif tok.startswith(")") and len(tok) > 1 and stack:
            if stack[-1][0] != tok[1:] or stack[-1][1] == 0:
                return False
            stack.pop()
            done = not stack
        else:
            return False
    return done and count == len(words)


# --------------------------------------------------------------------------- the Tree
def test_tree_accessors_and_string() -> None:
    """A pre-terminal is a tag over one word; leaves and tags read left to right."""
    tree = t(CAT)
    assert tree.leaves() == ["the", "cat", "sat", "."]
    assert tree.pos_tags() == ["DT", "NN", "VBD", "."]
    assert tree.constituents() == 3
    assert tree.to_string() == CAT == str(tree)
    assert tree.children[0].children[1] == Tree("NN", word="cat")
    assert tree != t(CAT.replace("VP", "ADJP"))
    with pytest.raises(ValueError, match="word or children"):
        Tree("NP")
    with pytest.raises(ValueError, match="word or children"):
        Tree("NP", [Tree("DT", word="a")], word="b")


def test_parse_is_whitespace_tolerant_and_keeps_the_wrapper() -> None:
    text = "( (S\r\n    (NP (DT the)\n (NN cat))\t(VP (VBD sat))\n (. .) )\n)"
    tree = t(text)
    assert tree.label == "" and tree.children[0] == t(CAT)
    assert tree.to_string() == f"( {CAT})"


@given(TREES)
@settings(max_examples=60, deadline=None, database=None)
def test_to_string_parse_round_trip(tree: Tree) -> None:
    if "(S" not in tree.leaves():  # a word with a bracket cannot be written as PTB text
        assert parse_tree(tree.to_string()) == tree


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "no tree"),
        ("(S (NP (DT the) (NN cat))", "unbalanced bracket: 1 '(' not closed"),
        ("(S (DT the)))", "trailing text after the tree: ')'"),
        (")", "unbalanced bracket: ')' closes nothing"),
        ("(S (NP the cat))", "a word outside a pre-terminal: 'cat'"),
        ("(S (DT the) cat)", "a word outside a pre-terminal: 'cat'"),
        ("(NN cat (NP (DT a)))", "a word outside a pre-terminal: (NN cat ...)"),
        ("(S ((DT the)))", "label missing"),
        ("( (DT a) word)", "a word outside a pre-terminal: 'word'"),
        ("(word)", "empty constituent (word)"),
        ("(S (NP) (DT a))", "empty constituent (NP)"),
        ("(S (DT a)) (S (DT b))", "trailing text after the tree: '('"),
        ("the (S (DT a))", "text outside the tree: 'the'"),
    ],
)
def test_parse_errors_name_where_and_what(text: str, problem: str) -> None:
    with pytest.raises(InputError) as e:
        parse_tree(text, "f.mrg:7")
    assert str(e.value).startswith("f.mrg:7") and problem in str(e.value), e.value


def test_parse_error_on_a_later_line_names_it_too() -> None:
    with pytest.raises(InputError, match=r"^f\.mrg:7 \(at line 9\): a word outside"):
        parse_tree("(S\n (NP (DT a))\n (NP x y))", "f.mrg:7")


# --------------------------------------------------------------------------- files
def test_read_trees_multi_line_with_crlf(tmp_path: Path) -> None:
    """The .mrg format: trees span lines; a tree may start where another ends."""
    path = tmp_path / "wsj_0001.mrg"
    path.write_bytes(
        b"\r\n( (S \r\n  (NP (DT the) (NN cat))\r\n  (VP (VBD sat))\r\n  (. .) ))\r\n"
        b"\r\n( (NP (DT a) (NN dog)) )( (X (UH oh)) )\r\n"
    )
    trees = list(read_trees(path))
    assert [line for line, _ in trees] == [2, 7, 7]
    assert [clean(tree) for _, tree in trees] == [
        t(CAT),
        t("(NP (DT a) (NN dog))"),
        t("(X (UH oh))"),
    ]


@pytest.mark.parametrize(
    "content, line, problem",
    [
        (b"( (S (DT a)) )\n( (S (DT b)) )\ngarbage\n", 3, "text outside a tree: 'garbage'"),
        (b"( (S (DT a)) )\n\n( (S (DT b)\n  (NN c)\n", 3, "unbalanced bracket: the tree starting"),
        (b"( (S (DT a)) ))\n", 1, "')' closes nothing"),
        (b"( (S (DT a)) )\n( (S (NN caf\xe9)) )\n", 2, "invalid UTF-8 at byte 12"),
        (b"( (S (DT a)) )\n( (S (NN x)\n   (NP y z)))\n", 2, "a word outside a pre-terminal"),
    ],
)
def test_read_trees_errors_name_file_and_line(
    tmp_path: Path, content: bytes, line: int, problem: str
) -> None:
    path = tmp_path / "bad.mrg"
    path.write_bytes(content)
    with pytest.raises(InputError) as e:
        list(read_trees(path))
    assert str(e.value).startswith(f"{path}:{line}") and problem in str(e.value), e.value


def test_read_trees_of_an_empty_file_is_empty(tmp_path: Path) -> None:
    (tmp_path / "empty.mrg").write_bytes(b"")
    (tmp_path / "blank.mrg").write_bytes(b"\n  \r\n")
    assert (
        list(read_trees(tmp_path / "empty.mrg")) == list(read_trees(tmp_path / "blank.mrg")) == []
    )


def test_read_tree_lines(tmp_path: Path) -> None:
    """The prepared files: one tree per line, gzip accepted; anything else names FILE:LINE."""
    path = tmp_path / "x.trees.gz"
    path.write_bytes(gzip.compress(f"{CAT}\n(NP (DT a))\n".encode()))
    assert [(n, tree.to_string()) for n, tree in read_tree_lines(path)] == [
        (1, CAT),
        (2, "(NP (DT a))"),
    ]
    for content, line, problem in [
        (f"{CAT}\n\n{CAT}\n", 2, "empty line"),
        (f"{CAT}\n{CAT} {CAT}\n", 2, "trailing text"),
        (f"{CAT}\n(S (DT a)\n(DT b))\n", 2, "unbalanced"),
    ]:
        bad = tmp_path / "bad.trees"
        bad.write_text(content)
        with pytest.raises(InputError, match=rf"^{bad}:{line}: .*{problem}"):
            list(read_tree_lines(bad))


# --------------------------------------------------------------------------- cleaning
def test_clean_drops_traces_and_the_constituents_they_empty() -> None:
    """(S (NP-SBJ (-NONE- *-1)) (VP ...)) loses its NP; a chain of empties goes too."""
    raw = t(
        "( (S (NP-SBJ-1 (-NONE- *-1)) (VP (VBD sat) (NP (NP (-NONE- *T*-2)) (SBAR (-NONE- 0))))"
        " (. .)) )"
    )
    assert clean(raw) == t("(S (VP (VBD sat)) (. .))")
    assert clean(t("( (S (NP-SBJ (-NONE- *)) (VP (-NONE- *?*))) )")) is None


def test_clean_labels() -> None:
    """Function tags and indices go; names starting with '-' stay."""
    for raw, cleaned in [
        ("NP-SBJ-1", "NP"),
        ("PP-LOC=2", "PP"),
        ("S-TPC-1", "S"),
        ("NP=3", "NP"),
        ("ADVP|PRT", "ADVP"),
        ("PRP$", "PRP$"),
        ("-NONE-", "-NONE-"),
        ("-LRB-", "-LRB-"),
        ("-RRB-", "-RRB-"),
    ]:
        assert clean_label(raw) == cleaned
    raw = t("( (S (NP-SBJ (-LRB- -LRB-) (NN x) (-RRB- -RRB-)) (VP-1 (VBD sat))) )")
    assert clean(raw) == t("(S (NP (-LRB- -LRB-) (NN x) (-RRB- -RRB-)) (VP (VBD sat)))")


def test_clean_wrappers_and_unary_chains() -> None:
    """The wrapper goes (PTB's empty label, ROOT, TOP); several top constituents or a
    bare word get an S; unary chains such as (NP (NP ...)) stay."""
    assert clean(t(f"( {CAT} )")) == clean(t(f"(ROOT {CAT})")) == clean(t(f"(TOP {CAT})")) == t(CAT)
    assert clean(t("( (NP (DT a)) (. .) )")) == t("(S (NP (DT a)) (. .))")
    assert clean(t("( (UH hello) )")) == t("(S (UH hello))")
    assert clean(t("(UH hello)")) == t("(S (UH hello))")
    chain = t("(NP (NP (NP (NN x))))")
    assert clean(Tree("", [chain])) == chain


@given(TREES)
@settings(max_examples=40, deadline=None, database=None)
def test_clean_is_idempotent(tree: Tree) -> None:
    once = clean(tree)
    assert once is not None and clean(once) == once


# --------------------------------------------------------------------------- linearization
def test_linearize_example() -> None:
    """Vinyals et al.'s target: labels on both brackets, XX for each word."""
    assert linearize(t(CAT)) == "(S (NP XX XX )NP (VP XX )VP XX )S"
    # the variant with the words in their places (what the decoder then copies)
    assert linearize(t(CAT), words=True) == "(S (NP the cat )NP (VP sat )VP . )S"
    odd = Tree("S", [Tree("NN", word="(S"), Tree("NN", word=")x"), Tree("NN", word="y")])
    assert linearize(odd, words=True) == "(S XX XX y )S"  # words that read as brackets
    # the words due, in their places, need no repair
    tree, repairs = delinearize("(S a (NP b XX )NP )S", ["a", "b", "c"])
    assert tree == t("(S (XX a) (NP (XX b) (XX c)))") and repairs.total == 0


@given(TREES)
@settings(max_examples=150, deadline=None, database=None)
def test_delinearize_inverts_linearize_with_words(tree: Tree) -> None:
    words = tree.leaves()
    back, repairs = delinearize(linearize(tree, words=True), words)
    assert repairs == Repairs() and back == delinearize(linearize(tree), words)[0]
    assert delinearize(linearize(tree, words=True), words, tags=tree.pos_tags())[0] == tree


@given(TREES)
@settings(max_examples=150, deadline=None, database=None)
def test_delinearize_inverts_linearize(tree: Tree) -> None:
    words = tree.leaves()
    back, repairs = delinearize(linearize(tree), words)
    assert repairs == Repairs() and repairs.total == 0 and repairs.well_formed
    assert linearize(back) == linearize(tree) and back.leaves() == words
    assert back.pos_tags() == punctuation_tags(words)
    assert delinearize(linearize(tree), words, tags=tree.pos_tags())[0] == tree
    assert delinearize(linearize(tree), words, repair=False)[0] == back


@given(TREES, st.data())
@settings(max_examples=200, deadline=None, database=None)
def test_mutated_sequences_always_give_a_tree_over_the_words(
    tree: Tree, data: st.DataObject
) -> None:
    """Whatever the decoder emits, a well-formed tree over exactly the words comes back,
    with repairs counted exactly when the sequence was not a valid linearization, and
    strict mode refusing exactly those."""
    tokens = linearize(tree).split()
    for _ in range(data.draw(st.integers(0, 4))):
        op = data.draw(st.sampled_from(["delete", "insert", "swap", "next", "garbage"]))
        # the ends are outside the root: drawn as often as the inside, not more
        i = round(data.draw(st.floats(0, 1)) * len(tokens))
        last = max(0, len(tokens) - 1)
        if op == "delete" and tokens:
            del tokens[min(i, last)]
        elif op == "insert":
            tokens.insert(i, data.draw(NOISE))
        elif op == "swap" and tokens:
            j = data.draw(st.integers(0, last))
            tokens[min(i, last)], tokens[j] = tokens[j], tokens[min(i, last)]
        elif op == "next" and len(tokens) > 1:  # swap neighbours
            i = min(i, last - 1)
            tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
        elif op == "garbage":
            tokens.insert(i, data.draw(st.text(max_size=6)))
    text, words = " ".join(tokens), tree.leaves()
    back, repairs = delinearize(text, words)
    assert back.leaves() == words and not back.is_preterminal
    again, none = delinearize(linearize(back), words, repair=False)  # well formed
    assert again == back and none.total == 0
    valid = is_valid(text.split(), words)
    assert (repairs.total == 0) == valid == repairs.well_formed
    if valid:
        assert delinearize(text, words, repair=False)[0] == back
    else:
        with pytest.raises(MalformedTreeError):
            delinearize(text, words, repair=False)


@given(st.text(max_size=40), st.lists(WORDS, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None, database=None)
def test_garbage_gives_a_tree_over_the_words(text: str, words: list[str]) -> None:
    back, repairs = delinearize(text, words)
    assert back.leaves() == words and repairs.total > 0


ABC = ["a", "b", "c"]


@pytest.mark.parametrize(
    "text, words, expected, counts",
    [
        ("(S (NP XX XX )NP (VP XX", ABC, "(S (NP (XX a) (XX b)) (VP (XX c)))", {"unclosed": 2}),
        ("(S XX XX XX )S )NP", ABC, "(S (XX a) (XX b) (XX c))", {"unmatched_close": 1}),
        ("(S (NP XX )VP XX XX )S", ABC, "(S (NP (XX a)) (XX b) (XX c))", {"mismatched_close": 1}),
        ("(S XX XX XX XX )S", ABC, "(S (XX a) (XX b) (XX c))", {"surplus_words": 1}),
        (  # missing words go to the lowest open constituent...
            "(S (NP XX",
            ABC,
            "(S (NP (XX a) (XX b) (XX c)))",
            {"missing_words": 2, "unclosed": 2},
        ),
        # ... or, with none open, to the root
        ("(S (NP XX )NP )S", ABC, "(S (NP (XX a)) (XX b) (XX c))", {"missing_words": 2}),
        ("(S XX ( XX ) XX )S", ABC, "(S (XX a) (XX b) (XX c))", {"unknown_tokens": 2}),
        # a label holding a bracket would not read back: an untrained model wrote these
        ("(S ((ad XX XX )S) XX )S", ABC, "(S (XX a) (XX b) (XX c))", {"unknown_tokens": 2}),
        # a word in a word's place: the one due is fine, another is replaced by it
        ("(S a (NP oops XX )NP )S", ABC, "(S (XX a) (NP (XX b) (XX c)))", {"changed_words": 1}),
        ("(S (NP )NP XX XX XX )S", ABC, "(S (XX a) (XX b) (XX c))", {"empty_constituents": 1}),
        ("(NP XX )NP (VP XX XX )VP", ABC, "(S (NP (XX a)) (VP (XX b) (XX c)))", {"root_added": 1}),
        ("XX", ["a"], "(S (XX a))", {"root_added": 1}),
        ("", ["a", "."], "(S (XX a) (. .))", {"root_added": 1, "missing_words": 2}),
    ],
)
def test_each_repair(text: str, words: list[str], expected: str, counts: dict[str, int]) -> None:
    tree, repairs = delinearize(text, words)
    assert tree == t(expected)
    assert repairs == Repairs(**counts) and repairs.total == sum(counts.values())
    assert not repairs.well_formed
    with pytest.raises(MalformedTreeError):
        delinearize(text, words, repair=False)


def test_repairs_add_up() -> None:
    total = Repairs(unclosed=1, root_added=2) + Repairs(unclosed=3, surplus_words=1)
    assert total == Repairs(unclosed=4, root_added=2, surplus_words=1) and total.total == 7
    assert total.to_dict() == {
        "unclosed": 4,
        "unmatched_close": 0,
        "mismatched_close": 0,
        "surplus_words": 1,
        "missing_words": 0,
        "unknown_tokens": 0,
        "changed_words": 0,
        "empty_constituents": 0,
        "root_added": 2,
    }
    assert sum([Repairs(unknown_tokens=1)] * 3, Repairs()).unknown_tokens == 3


def test_strict_mode_says_what_is_wrong() -> None:
    with pytest.raises(MalformedTreeError, match=r"token 2: \)VP closes \(NP"):
        delinearize("(S (NP )VP XX )S", ["a"], repair=False)


def test_delinearize_arguments() -> None:
    with pytest.raises(ValueError, match="at least one word"):
        delinearize("(S )S", [])
    with pytest.raises(ValueError, match="2 tags for 1 words"):
        delinearize("(S XX )S", ["a"], tags=["DT", "NN"])


def test_deep_sequences_do_not_hit_the_recursion_limit() -> None:
    n = 5000
    tree, repairs = delinearize("(NP " * n + "XX", ["a"])
    assert repairs.unclosed == n and tree.constituents() == n
    assert linearize(tree).count("(NP") == n and clean(tree) == tree


# --------------------------------------------------------------------------- tags, baseline
def test_punctuation_tags() -> None:
    """The PTB tags EVALB's COLLINS.prm deletes, by word form."""
    table = {",": ",", ".": ".", "?": ".", "!": ".", ":": ":", ";": ":", "--": ":"}
    table |= {"...": ":", "-": ":", "``": "``", "`": "``", "''": "''", "-LRB-": "-LRB-"}
    table |= {"-RRB-": "-RRB-", "-LCB-": "-LRB-", "$": "$", "#": "#", "'": "POS"}
    for word, tag in table.items():
        assert punctuation_tag(word) == tag
    assert punctuation_tag("cat") == punctuation_tag("XX") == PLACEHOLDER
    words = ["he", "said", "`", "no", "'", "and", "the", "boys", "'", "toys", ",", "'", "too"]
    tags = punctuation_tags(words)
    assert [tags[i] for i in (2, 4, 8, 10, 11)] == ["``", "''", "POS", ",", "POS"]
    tree, _ = delinearize("(S XX XX XX XX )S", ["Hi", ",", "you", "!"])
    assert tree.pos_tags() == ["XX", ",", "XX", "."]


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_right_branching(n: int) -> None:
    words = [f"w{i}" for i in range(n - 1)] + ["."]
    tree = right_branching(words)
    assert tree.leaves() == words and tree.constituents() == max(1, n - 1)
    node = tree
    for i in range(n - 2):  # each level: a word on the left, the rest on the right
        assert node.label == ROOT_LABEL and node.children[0] == Tree("XX", word=words[i])
        assert len(node.children) == 2
        node = node.children[1]
    assert node.pos_tags()[-1] == "."
    assert right_branching(["a", "b"], label="X") == t("(X (XX a) (XX b))")
    with pytest.raises(ValueError):
        right_branching([])
