"""The tree constraint (`aiayn.decoding.tree_constraint`) and the search's constraint hook:
the mask after any prefix is exactly the set of tokens that some complete tree over the
words (within the limits and the cap) continues with, found by enumerating every such
tree; and random models decode only trees under it."""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch

from aiayn.config import EOS_ID, DecodeConfig
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.constraints import ForcedPrefix
from aiayn.decoding.parse import parse_lines, sentence_words
from aiayn.decoding.search import beam_search
from aiayn.decoding.tree_constraint import (
    Brackets,
    TreeConstraint,
    TreeLimits,
    bracket_tokens,
    tree_limits,
)
from aiayn.parsing.linearize import delinearize
from aiayn.parsing.trees import parse_tree
from helpers import random_model

LABELS = ("A", "B")
BRACKETS = Brackets(LABELS, (10, 11), (12, 13))
V = 40


def all_trees(pieces: list[list[int]], limits: TreeLimits, cap: int) -> set[tuple[int, ...]]:
    """Every linearized tree over the words (each word its pieces), every constituent
    non-empty, depth <= max_depth, open runs <= max_opens, at most `cap` tokens: the
    reference language, built from the definition of a tree, not from the constraint."""

    @cache
    def spans(i: int, j: int, d: int) -> frozenset[tuple[int, ...]]:
        """Constituents over words i..j-1 at depth d (1 = the root)."""
        if d > limits.max_depth:
            return frozenset()
        out = set()
        for children in sequences(i, j, d + 1):
            for o, c in zip(BRACKETS.open_ids, BRACKETS.close_ids, strict=True):
                out.add((o, *children, c))
        return frozenset(out)

    @cache
    def sequences(i: int, j: int, d: int) -> frozenset[tuple[int, ...]]:
        """Sequences of children (words, or constituents at depth d) covering i..j-1."""
        if i == j:
            return frozenset({()})
        out = set()
        for rest in sequences(i + 1, j, d):  # a word first
            out.add((*pieces[i], *rest))
        for k in range(i + 1, j + 1):  # a constituent first
            for first in spans(i, k, d):
                for rest in sequences(k, j, d):
                    out.add(first + rest)
        return frozenset(out)

    def run_ok(seq: tuple[int, ...]) -> bool:
        run = 0
        for t in seq:
            run = run + 1 if t in BRACKETS.open_ids else 0
            if run > limits.max_opens:
                return False
        return True

    return {s for s in spans(0, len(pieces), 1) if len(s) <= cap and run_ok(s)}


def reference_allowed(trees: set[tuple[int, ...]], prefix: tuple[int, ...], cap: int) -> set[int]:
    n = len(prefix)
    nxt = {t[n] for t in trees if len(t) > n and t[:n] == prefix}
    if prefix in trees and n < cap:
        nxt.add(EOS_ID)
    return nxt


def random_sentence(rng: random.Random) -> list[list[int]]:
    return [
        [rng.randrange(20, V) for _ in range(rng.choice([1, 1, 2]))]
        for _ in range(rng.randint(1, 3))
    ]


@pytest.mark.parametrize("seed", range(6))
def test_the_mask_is_the_set_of_tokens_some_tree_continues_with(seed):
    """Random prefixes (walks through the reference language, rows duplicated and
    reordered as a beam does): the constraint's mask equals the reference's set."""
    rng = random.Random(seed)
    limits = TreeLimits(max_depth=rng.choice([2, 3]), max_opens=rng.choice([1, 2, 3]))
    sentences = [random_sentence(rng) for _ in range(3)]
    caps = [sum(map(len, s)) + 2 + rng.randrange(0, 6) for s in sentences]
    trees = [all_trees(s, limits, cap) for s, cap in zip(sentences, caps, strict=True)]
    constraint = TreeConstraint(sentences, BRACKETS, V, limits)
    state = constraint.start(caps)
    rows = [(b, ()) for b in range(len(sentences))]  # (sentence, prefix) of each row
    checked = 0
    for _step in range(max(caps)):
        mask = constraint.allowed(state)
        assert mask.shape == (len(rows), V)
        for r, (b, prefix) in enumerate(rows):
            want = reference_allowed(trees[b], prefix, caps[b])
            got = set(mask[r].nonzero().flatten().tolist())
            assert got == want, (sentences[b], prefix, caps[b])
            checked += 1
        # the next rows: each a random allowed continuation of a random row (some rows
        # copied, some dropped, as the beam reorders); a finished or dead row is not kept
        choices = [
            (r, t)
            for r, (b, p) in enumerate(rows)
            for t in reference_allowed(trees[b], p, caps[b])
            if t != EOS_ID and len(p) + 1 < caps[b]
        ]
        if not choices:
            break
        picked = [rng.choice(choices) for _ in range(rng.randint(1, 6))]
        origin = torch.tensor([r for r, _ in picked])
        tokens = torch.tensor([t for _, t in picked])
        state = constraint.advance(state, tokens, origin)
        rows = [(rows[r][0], (*rows[r][1], t)) for r, t in picked]
    assert checked > 10


def test_a_token_outside_the_mask_kills_its_row_without_error():
    """An empty beam slot's candidate may be any token: its row then allows nothing."""
    constraint = TreeConstraint([[[20], [21]]], BRACKETS, V, TreeLimits(3, 3))
    state = constraint.start([10])
    constraint.allowed(state)
    for bad in (12, 20, EOS_ID, 39):  # a close, a word, EOS before the root: none allowed
        s = constraint.advance(state, torch.tensor([bad]), torch.tensor([0]))
        assert not constraint.allowed(s).any()


def test_word_mass_scores_the_next_piece_by_the_mass_of_every_word_piece():
    """`reweigh` with word_mass: each row's next input piece (the only word token its mask
    can allow) scores log sum P over the tokens that are not brackets or specials, computed
    here by hand; every other column keeps the model's log P. Without word_mass (the
    default) there is no rescoring."""
    sentences = [[[20, 21], [22]], [[30]]]
    on = TreeConstraint(sentences, BRACKETS, V, TreeLimits(3, 3), word_mass=True)
    off = TreeConstraint(sentences, BRACKETS, V, TreeLimits(3, 3))
    state = on.start([10, 10])
    on.allowed(state)
    # rows: sentence 0 after "(A 20" (inside its first word: 21 is forced), sentences 1
    # and 0 after "(A (A" (their first word's first piece may come next)
    state = on.advance(state, torch.tensor([10, 10]), torch.tensor([0, 1]))
    on.allowed(state)
    state = on.advance(state, torch.tensor([20, 10, 10]), torch.tensor([0, 1, 0]))
    on.allowed(state)
    log_p = torch.log_softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)), 1)
    assert on.reweigh is not None
    got = on.reweigh(state, log_p.clone())
    words = [t for t in range(V) if t not in (0, 2, EOS_ID, 10, 11, 12, 13)]
    mass = torch.logsumexp(log_p[:, words], dim=1)
    for row, piece in enumerate((21, 30, 20)):
        assert got[row, piece].item() == pytest.approx(mass[row].item(), abs=1e-6)
        rest = [t for t in range(V) if t != piece]
        assert torch.equal(got[row, rest], log_p[row, rest])
    assert off.reweigh is None  # the plain search


def test_the_search_ranks_by_the_constraints_scores():
    """The hook's `reweigh`: the search keeps what the constraint's scores rank first (here
    a token the model itself rates as any other), and a hypothesis' score sums them."""
    model = random_model(60, 5)
    src = torch.tensor([[30, 31, EOS_ID]])

    class Favour:
        def start(self, caps):
            return len(caps)

        def allowed(self, rows):
            return torch.ones((rows, 60), dtype=torch.bool)

        def reweigh(self, rows, log_p):
            out = torch.full_like(log_p, -50.0)
            out[:, 44] = -0.25
            return out

        def advance(self, rows, tokens, origin):
            return tokens.numel()

    (best, *_), *_ = beam_search(model, src, 2, 0.0, 0.0, 5, nbest=2, constraint=Favour())
    assert best.tokens == [44] * 5
    assert best.log_prob == pytest.approx(-0.25 * 5)


def test_tree_limits_are_the_training_trees_deepest_nesting_and_longest_run():
    lines = ["(S (NP (NP a )NP b )NP (VP c )VP )S", "(S (VP (PP (NP d )NP )PP )VP )S"]
    assert tree_limits(lines) == TreeLimits(max_depth=4, max_opens=4)
    assert tree_limits(["(S a (NP b )NP )S"]) == TreeLimits(2, 1)


# --------------------------------------------------------------------------- with models
SENTENCES = [
    "The cat sat on the mat .",
    "Stocks fell sharply , traders said .",
    "He did n't ( really ) care .",
    "Yes",
    "f(x) and (hello) and -LRB-",
]
TREES = [
    "(S (NP The cat )NP (VP sat (PP on (NP the mat )NP )PP )VP . )S",
    "(S (S (NP Stocks )NP (VP fell (ADVP sharply )ADVP )VP )S , (NP traders )NP (VP said )VP . )S",
    "(INTJ Yes )INTJ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_from_sentences(
        SENTENCES * 3 + TREES * 3, 120, None, split_by_script=False
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("word_mass", [True, False])
def test_random_models_write_only_trees_over_exactly_the_words_when_constrained(
    tokenizer, seed, beam, word_mass
):
    """Untrained models, tight and loose caps, low and high limits, words scored by their
    mass or by their pieces: no output needs a repair, and each is a tree over the input's
    words within the limits."""
    model = random_model(tokenizer.vocab_size, seed)
    for max_len_b, limits in ((1, TreeLimits(2, 1)), (30, TreeLimits(5, 3))):
        cfg = DecodeConfig(beam=beam, alpha=0.3, max_len_a=1.0, max_len_b=max_len_b)
        result = parse_lines(model, tokenizer, SENTENCES, cfg, limits=limits, word_mass=word_mass)
        assert result.ill_formed == [] and result.repairs.total == 0
        for raw, tree, line in zip(result.raw, result.trees, SENTENCES, strict=True):
            words = sentence_words(line)
            delinearize(raw, words, repair=False)  # raises if not a tree over the words
            assert parse_tree(tree).leaves() == words
            got = tree_limits([raw])
            assert got.max_depth <= limits.max_depth and got.max_opens <= limits.max_opens


def test_unconstrained_random_models_need_repairs(tokenizer):
    """The contrast: the same models decoding freely write ill-formed outputs."""
    model = random_model(tokenizer.vocab_size, 0)
    cfg = DecodeConfig(beam=4, alpha=0.3, max_len_a=1.0, max_len_b=30)
    result = parse_lines(model, tokenizer, SENTENCES, cfg, constrained=False)
    assert result.ill_formed


def test_bracket_pieces_are_found_in_a_parsers_vocabulary(tokenizer):
    """A label is writable when both its brackets are one piece each (a vocabulary of 120
    pieces holds only the commonest; the recipe's 4,000 hold every label)."""
    b = bracket_tokens(tokenizer)
    assert {"S", "NP", "VP"} <= set(b.labels)
    assert "INTJ" not in b.labels and len(tokenizer.encode("(INTJ")) > 1
    for label, o, c in zip(b.labels, b.open_ids, b.close_ids, strict=True):
        assert tokenizer.encode(f"({label}") == [o] and tokenizer.encode(f"){label}") == [c]


def test_the_hook_changes_nothing_when_everything_is_allowed_and_forces_a_prefix(tokenizer):
    """The constraint hook itself: an all-True mask gives the unconstrained search's
    outputs; `ForcedPrefix` makes each output start with its prefix."""
    model = random_model(tokenizer.vocab_size, 3)
    src = torch.tensor([[30, 31, 32, EOS_ID], [40, 41, EOS_ID, 0]])
    free = beam_search(model, src, 4, 0.6, 1.0, 8, nbest=2)

    class Everything:
        def start(self, caps):
            return len(caps)

        def allowed(self, rows):
            return torch.ones((rows, tokenizer.vocab_size), dtype=torch.bool)

        def advance(self, rows, tokens, origin):
            return tokens.numel()

    same = beam_search(model, src, 4, 0.6, 1.0, 8, nbest=2, constraint=Everything())
    assert [[h.tokens for h in hs] for hs in same] == [[h.tokens for h in hs] for hs in free]
    for a, b in zip(same, free, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.score == pytest.approx(y.score, abs=1e-5)
    prefixes = [[50, 51, 52], [60]]
    forced = beam_search(
        model,
        src,
        4,
        0.6,
        1.0,
        8,
        nbest=3,
        constraint=ForcedPrefix(prefixes, tokenizer.vocab_size, "cpu"),
    )
    for hyps, p in zip(forced, prefixes, strict=True):
        assert hyps and all(h.tokens[: len(p)] == p for h in hyps)
