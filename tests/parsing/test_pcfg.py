"""The PCFG baseline (`aiayn.parsing.pcfg`) on a hand-built treebank whose best parses are
known by counting: the rule probabilities, the Viterbi tree against every alternative,
unknown words, and the annotation undone."""

from __future__ import annotations

import math

import pytest

from aiayn.parsing.pcfg import Pcfg, signature
from aiayn.parsing.trees import parse_tree

TELESCOPE = "(PP (IN with) (NP (DT the) (NN telescope)))"
TREEBANK = [
    # "with the telescope" attaches to the noun twice, to the verb once: NP attachment wins
    f"(S (NP (DT the) (NN man)) (VP (VBD saw) (NP (NP (DT the) (NN dog)) {TELESCOPE})) (. .))",
    f"(S (NP (DT the) (NN dog)) (VP (VBD saw) (NP (NP (DT the) (NN man)) {TELESCOPE})) (. .))",
    f"(S (NP (DT the) (NN man)) (VP (VBD saw) (NP (DT the) (NN dog)) {TELESCOPE}) (. .))",
    "(S (NP (DT the) (NN dog)) (VP (VBD barked)) (. .))",
    "(S (NP (DT a) (NN man)) (VP (VBD barked)) (. .))",
    "(S (NP (NNP Rex)) (VP (VBD barked)) (. .))",
]


@pytest.fixture(scope="module")
def trees():
    return [parse_tree(t) for t in TREEBANK]


def test_rule_probabilities_are_relative_frequencies(trees):
    """Counted by hand: VP^S has 6 expansions, VBD NP PP once (binarized: VP^S -> VBD
    @VP^S|VBD, then @VP^S|VBD -> NP^VP PP^VP); the lexicon P(word | tag)."""
    g = Pcfg(parent=True, h=1, rare=1).train(trees)
    assert g.rule_logp[("VP^S", ("VBD", "@VP^S|VBD"))] == pytest.approx(math.log(1 / 6))
    assert g.rule_logp[("VP^S", ("VBD", "NP^VP"))] == pytest.approx(math.log(2 / 6))
    assert g.rule_logp[("VP^S", ("VBD",))] == pytest.approx(math.log(3 / 6))
    assert g.rule_logp[("@VP^S|VBD", ("NP^VP", "PP^VP"))] == 0.0
    # NP under VP: NP PP twice, DT NN once
    assert g.rule_logp[("NP^VP", ("NP^NP", "PP^NP"))] == pytest.approx(math.log(2 / 3))
    dt = g.index["DT"]
    assert g.word_scores("the")[dt] == pytest.approx(math.log(10 / 11))  # 10 "the", 1 "a"


def test_the_viterbi_tree_is_the_best_of_the_alternatives(trees):
    """The ambiguous sentence parses with the attachment the counts favour, its score is
    the sum of its rules', and it beats the other attachment's score."""
    g = Pcfg(parent=True, h=1, rare=1).train(trees)
    words = ["the", "man", "saw", "the", "dog", "with", "the", "telescope", "."]
    tree, score = g.parse_with_score(words)
    noun = parse_tree(
        "(S (NP (DT the) (NN man)) (VP (VBD saw) (NP (NP (DT the) (NN dog)) (PP (IN with) "
        "(NP (DT the) (NN telescope))))) (. .))"
    )
    verb = parse_tree(
        "(S (NP (DT the) (NN man)) (VP (VBD saw) (NP (DT the) (NN dog)) (PP (IN with) "
        "(NP (DT the) (NN telescope)))) (. .))"
    )
    assert tree == noun
    assert score == pytest.approx(g.tree_log_prob(noun))
    assert g.tree_log_prob(noun) > g.tree_log_prob(verb) > -math.inf
    # hand count: P(NP^VP -> NP PP) = 2/3 against the VP's own PP (VP^S -> VBD @.. = 1/6,
    # NP^VP -> DT NN = 1/3): their ratio is what separates the two trees
    ratio = g.tree_log_prob(noun) - g.tree_log_prob(verb)
    expected = (math.log(2 / 6) + math.log(2 / 3)) - (math.log(1 / 6) + math.log(1 / 3))
    assert ratio == pytest.approx(expected)


def test_unseen_words_parse_through_their_signature(trees):
    g = Pcfg(parent=True, h=1, rare=2).train(trees)
    # "Rex" was seen once: the class of capitalised rare words is a proper noun's
    tree = g.parse(["Zorblax", "barked", "."])
    assert tree == parse_tree("(S (NP (NNP Zorblax)) (VP (VBD barked)) (. .))")
    assert signature("Zorblax") == "UNK-C" and signature("walking") == "UNK-ing"
    assert signature("1987") == "UNK-D"


def test_without_parent_annotation_the_labels_are_plain(trees):
    g = Pcfg(parent=False, h=1, rare=1).train(trees)
    assert not any("^" in s for s in g.symbols)
    tree = g.parse(["the", "dog", "barked", "."])
    assert tree == parse_tree("(S (NP (DT the) (NN dog)) (VP (VBD barked)) (. .))")


def test_a_sentence_with_no_parse_falls_back_to_right_branching(trees):
    g = Pcfg(parent=True, h=1, rare=1).train(trees)
    # "." alone can only be a child of S next to NP VP: no TOP over it
    tree, score = g.parse_with_score(["."])
    assert score == -math.inf and g.failures == 1 and tree.leaves() == ["."]
