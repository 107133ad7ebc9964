"""Tests for aiayn.decoding.search: greedy and beam search, length penalty (paper section 6.1)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID, PAD_ID
from aiayn.decoding.search import (
    Hypothesis,
    beam_search,
    greedy_search,
    length_penalty,
    max_output_len,
    row_topk,
)
from aiayn.model import Transformer
from helpers import (
    LENGTHS,
    A,
    B,
    EosRamp,
    TableModel,
    eos_ramp_model,
    hand_table,
    random_src,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------- formulas
def test_length_penalty_is_gnmt_formula() -> None:
    """Section 6.1: lp(Y) = ((5 + |Y|) / 6) ** alpha, for numbers and tensors."""
    for length in (1, 4, 17, 100):
        for alpha in (0.0, 0.6, 1.0):
            assert length_penalty(length, alpha) == pytest.approx(
                ((5 + length) / 6) ** alpha, rel=1e-15
            )
    lengths = torch.tensor([1.0, 4.0, 17.0], dtype=torch.float64)
    expected = torch.tensor([1.0, 1.5, 22 / 6], dtype=torch.float64) ** 0.6
    torch.testing.assert_close(length_penalty(lengths, 0.6), expected, rtol=1e-15, atol=0)
    assert length_penalty(1, 0.6) == 1.0  # a one-token output is not penalised


def test_max_output_len_is_input_plus_50() -> None:
    """Section 6.1: maximum output length = input length + 50 (a=1, b=50), floored."""
    assert max_output_len(7, 1.0, 50) == 57
    assert max_output_len(5, 1.5, 3) == 10  # 10.5 -> 10
    assert max_output_len(0, 2.0, 1) == 1


@pytest.mark.rows("F14")
@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"beam": 0}, "beam"),
        ({"beam": 2, "nbest": 3}, "nbest"),
        ({"nbest": 0}, "nbest"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"max_len_a": -1.0}, "max_len_a"),
        ({"max_len_b": -1}, "max_len_b"),
    ],
)
def test_invalid_options_raise_naming_the_option(kwargs: dict, option: str) -> None:
    """RELIABILITY F14: beam 0, nbest > beam, negative length penalty: ValueError naming
    the option, before any work (the model is never called)."""
    model = hand_table()
    args = {"beam": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 5, "nbest": 1} | kwargs
    with pytest.raises(ValueError, match=option):
        beam_search(model, torch.tensor([[A, EOS_ID]]), **args)
    assert model.steps == 0


# ------------------------------------------------------------------------- hand-set table
SRC = torch.tensor([[A, B, EOS_ID]])  # source length 3; with a=0, b=10 the cap is 10
L_B = math.log(0.45 * 0.5)  # "B EOS", |Y| = 2
L_BA = math.log(0.45 * 0.45 * 0.03)  # "B A EOS", |Y| = 3
L_BAA = math.log(0.45 * 0.45 * 0.95 * 0.99)  # "B A A EOS", |Y| = 4


def test_greedy_on_hand_table_takes_the_locally_best_word() -> None:
    """Section 6.1 contrast: greedy picks A (0.5 > 0.45), then EOS (0.4): "A", P = 0.2."""
    assert greedy_search(hand_table(), SRC, 0.0, 10) == [[A]]


def test_beam_on_hand_table_alpha_0_matches_hand_computation() -> None:
    """Section 6.1 beam search, worked by hand with beam 2 and alpha 0 (score = log P).

    step 1: A .5, B .45 stay live.
    step 2: candidates B EOS .225, B A .2025, A EOS .2, A A .175, ...; the best two are
            "B EOS" (finished) and "B A" (live). "A EOS" (.2, greedy's answer) falls out.
    step 3: from "B A": "B A A" .1924 (live), "B A EOS" .0061 (finished).
    step 4: "B A A EOS" .1904 finished; the live "B A A A" (.0012) cannot beat the worst
            of the two best finished (.1904), so the search ends, 6 steps before the cap.
    Best: "B" (.225 > .1904).
    """
    model = hand_table()
    (hyps,) = beam_search(model, SRC, beam=2, alpha=0.0, max_len_a=0.0, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[B], [B, A, A]]
    assert hyps[0].log_prob == pytest.approx(L_B, abs=1e-5)
    assert hyps[0].score == pytest.approx(L_B, abs=1e-5)
    assert hyps[1].log_prob == pytest.approx(L_BAA, abs=1e-5)
    assert model.steps == 4  # early termination: the cap (10) was never reached


def test_beam_on_hand_table_alpha_1_prefers_the_longer_output() -> None:
    """Section 6.1 length penalty: same search, alpha 1, lp(|Y|) = (5 + |Y|) / 6.

    "B":       log .225   / (7/6) = -1.279
    "B A A":   log .19045 / (9/6) = -1.106   <- best: normalisation favours the longer one
    "B A":     log .006075 / (8/6) = -3.828
    After step 3 the two best finished are "B" and "B A"; the live "B A A" (log P -1.648)
    could still reach -1.648 / lp(10) = -0.659 > -3.828, so the search goes on. After step 4
    the live "B A A A" can reach at most log(.00115) / lp(10) = -2.71 < -1.279: done.
    """
    model = hand_table()
    (hyps,) = beam_search(model, SRC, beam=2, alpha=1.0, max_len_a=0.0, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[B, A, A], [B]]
    assert hyps[0].score == pytest.approx(L_BAA / (9 / 6), abs=1e-5)
    assert hyps[0].log_prob == pytest.approx(L_BAA, abs=1e-5)
    assert hyps[1].score == pytest.approx(L_B / (7 / 6), abs=1e-5)
    assert model.steps == 4


def test_wider_beam_keeps_greedys_answer_as_runner_up() -> None:
    """Section 6.1 beam search with beam 3, alpha 0, by hand: at step 2 "A EOS" (.2) is now
    among the 3 best candidates, so it is finished too; step 4 ends the search as before.
    n-best: "B" .225, "A" .2, "B A A" .19045."""
    model = hand_table()
    (hyps,) = beam_search(model, SRC, beam=3, alpha=0.0, max_len_a=0.0, max_len_b=10, nbest=3)
    assert [h.tokens for h in hyps] == [[B], [A], [B, A, A]]
    expected = [L_B, math.log(0.5 * 0.4), L_BAA]
    assert [h.log_prob for h in hyps] == pytest.approx(expected, abs=1e-5)
    assert model.steps == 4


def test_bound_keeps_searching_while_a_longer_output_could_still_win() -> None:
    """Section 6.1 early termination with the bound l / lp(cap), worked by hand (beam 2,
    alpha 1, cap 10, lp(10) = 2.5).

    step 2: "A EOS" .45 finished (score log .45 / (7/6) = -0.685); "B A" .4455 live.
    step 3: "B A EOS" .245 finished (log .245 / (8/6) = -1.055); "B A A" .196 live, with
            log P -1.630 below both finished scores; but a longer completion could still
            reach -1.630 / 2.5 = -0.652, so the search must go on (a bound using the
            current length, -1.630 / (8/6) = -1.22, would stop here).
    step 5: "B A A A EOS" .1844 finishes with log .1844 / (10/6) = -1.014 > -1.055: it
            replaces "B A" as the second best, and the remaining live "B A A A A" (.0038)
            can reach at most -2.23: done.
    """
    model = TableModel(
        table={
            (): {A: 0.5, B: 0.45, EOS_ID: 0.05},
            (A,): {EOS_ID: 0.9, A: 0.06, B: 0.04},
            (B,): {A: 0.99, EOS_ID: 0.006, B: 0.004},
            (B, A): {EOS_ID: 0.55, A: 0.44, B: 0.01},
            (B, A, A): {A: 0.97, EOS_ID: 0.02, B: 0.01},
            (B, A, A, A): {EOS_ID: 0.97, A: 0.02, B: 0.01},
        },
        default={EOS_ID: 0.5, A: 0.3, B: 0.2},
    )
    (hyps,) = beam_search(model, SRC, beam=2, alpha=1.0, max_len_a=0.0, max_len_b=10, nbest=2)
    assert [h.tokens for h in hyps] == [[A], [B, A, A, A]]
    log_p = math.log(0.45 * 0.99 * 0.44 * 0.97 * 0.97)
    assert hyps[1].score == pytest.approx(log_p / (10 / 6), abs=1e-5)
    assert model.steps == 5


def test_beam_at_the_cap_finishes_live_hypotheses_as_they_are() -> None:
    """Section 6.1 length cap: with cap 1 only one step is taken; "A" (.5) is force-ended
    without EOS, |Y| = 1, and "EOS" alone (.05) is finished normally."""
    model = hand_table()
    (hyps,) = beam_search(model, SRC, beam=3, alpha=0.6, max_len_a=0.0, max_len_b=1, nbest=3)
    assert model.steps == 1
    assert [h.tokens for h in hyps] == [[A], [B], []]
    assert hyps[0] == Hypothesis(
        [A], pytest.approx(math.log(0.5), abs=1e-6), pytest.approx(math.log(0.5), abs=1e-6)
    )


def test_beam_1_equals_greedy_on_hand_table() -> None:
    """STYLE property "beam 1 equals greedy", where the runner-up would win with a wider beam."""
    (hyps,) = beam_search(hand_table(), SRC, beam=1, alpha=0.6, max_len_a=0.0, max_len_b=10)
    assert hyps[0].tokens == [A]
    assert hyps[0].log_prob == pytest.approx(math.log(0.5 * 0.4), abs=1e-6)


def test_pad_and_bos_are_never_generated() -> None:
    """Section 6.1 outputs are target sentences: PAD (whose logit is never trained) and BOS
    are not generated, even by a model that puts most probability on them."""
    model = TableModel(table={}, default={PAD_ID: 0.5, BOS_ID: 0.3, A: 0.15, EOS_ID: 0.05})
    assert greedy_search(model, SRC, 0.0, 3) == [[A, A, A]]
    (hyps,) = beam_search(model, SRC, beam=2, alpha=0.6, max_len_a=0.0, max_len_b=3, nbest=2)
    assert [h.tokens for h in hyps] == [[], [A]]


# ------------------------------------------------------------------------- random models
def test_incremental_decode_step_equals_full_decode() -> None:
    """Section 6.1 incremental decoding: each decode_step's logits equal the last row of
    the teacher-forced decoder over the whole prefix (cached keys/values are exact)."""
    model = tiny_model()
    src = random_src([5, 3, 8])
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        states = model.init_state(memory, 12)
        prefix = torch.full((3, 1), BOS_ID)
        g = torch.Generator().manual_seed(2)
        for _ in range(12):
            step = model.decode_step(prefix[:, -1:], src_mask, states)
            full = model.decode(prefix, memory, src_mask)[:, -1]
            torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)
            prefix = torch.cat([prefix, torch.randint(4, 40, (3, 1), generator=g)], dim=1)


@pytest.mark.parametrize("model_fn", [tiny_model, eos_ramp_model], ids=["plain", "eos_ramp"])
def test_beam_1_equals_greedy_on_random_model(model_fn) -> None:
    """STYLE property: beam 1 equals greedy, token for token, on a random tiny Transformer
    (plain: outputs run to the cap; eos_ramp: outputs end in EOS at varied lengths)."""
    model = model_fn()
    src = random_src(LENGTHS)
    greedy = greedy_search(model, src, 1.0, 5)
    beam = beam_search(model, src, beam=1, alpha=0.6, max_len_a=1.0, max_len_b=5)
    assert [h[0].tokens for h in beam] == greedy
    if model_fn is eos_ramp_model:  # the EOS path was exercised, not only the cap
        caps = [max_output_len(n + 1, 1.0, 5) for n in LENGTHS]
        assert any(len(g) < c for g, c in zip(greedy, caps, strict=True))


@pytest.mark.rows("F5")
def test_untrained_model_stops_at_the_length_cap() -> None:
    """RELIABILITY F5: a model that never emits EOS terminates, and every output has
    exactly floor(a * src_len + b) tokens (src_len counts the source's EOS)."""

    class NeverEos(Transformer):
        def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list) -> Tensor:
            logits = super().decode_step(tokens, src_mask, states)
            logits[:, EOS_ID] = float("-inf")
            return logits

    torch.manual_seed(0)
    model = NeverEos(tiny_model().cfg).eval()
    src = random_src([3, 7, 1])
    caps = [max_output_len(n + 1, 1.5, 3) for n in (3, 7, 1)]  # 9, 15, 6
    assert [len(t) for t in greedy_search(model, src, 1.5, 3)] == caps
    hyps = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.5, max_len_b=3, nbest=4)
    assert [[len(h.tokens) for h in sent] for sent in hyps] == [[c] * 4 for c in caps]


@pytest.mark.rows("F6")
@pytest.mark.parametrize("model_fn", [tiny_model, eos_ramp_model], ids=["plain", "eos_ramp"])
def test_output_does_not_depend_on_batch_composition(model_fn) -> None:
    """RELIABILITY F6 (CPU fp32): each sentence translated alone, unpadded, gives the same
    tokens as in a padded batch where other sentences finish and leave it earlier."""
    model = model_fn()
    src = random_src(LENGTHS)
    batched_greedy = greedy_search(model, src, 1.0, 5)
    batched = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    for i, n in enumerate(LENGTHS):
        alone_src = src[i : i + 1, : n + 1]
        assert greedy_search(model, alone_src, 1.0, 5) == [batched_greedy[i]]
        (alone,) = beam_search(
            model, alone_src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4
        )
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]
        for h1, h2 in zip(alone, batched[i], strict=True):
            assert h1.score == pytest.approx(h2.score, abs=1e-4)


def test_beam_search_terminates_early_on_random_model() -> None:
    """Section 6.1 "terminate early when possible": once every sentence's finished
    hypotheses dominate, decoding stops well before the longest cap."""
    model = eos_ramp_model()
    calls = 0
    decode_step = model.decode_step

    def counting(*args):
        nonlocal calls
        calls += 1
        return decode_step(*args)

    model.decode_step = counting  # type: ignore[method-assign]
    src = random_src(LENGTHS)
    hyps = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50)
    longest_cap = max(LENGTHS) + 1 + 50
    assert calls < longest_cap // 2
    assert all(
        len(h[0].tokens) < max_output_len(n + 1, 1.0, 50)
        for h, n in zip(hyps, LENGTHS, strict=True)
    )


def test_beam_search_runs_in_bf16() -> None:
    """Section 6.1 in reduced precision: scores are accumulated in float32 log-softmax, so
    a bf16 model decodes and its scores are finite floats."""
    model = tiny_model().to(torch.bfloat16)
    hyps = beam_search(model, random_src([4, 6]), beam=2, alpha=0.6, max_len_a=1.0, max_len_b=3)
    assert all(math.isfinite(h[0].score) for h in hyps)


@pytest.mark.parametrize("model_fn", [tiny_model, eos_ramp_model], ids=["plain", "eos_ramp"])
def test_beam_scores_equal_teacher_forced_recomputation(model_fn) -> None:
    """Section 6.1 incremental beam search against a second computation: every returned
    hypothesis's log P equals the sum of log-softmax scores the full (teacher-forced,
    uncached) decoder gives its tokens (EOS included when it ended in one), and its score
    is log P / lp(|Y|). This checks the cache reordering, the per-sentence encoder keys/
    values shared by a sentence's hypotheses, and picking tokens by logit before
    normalising."""
    model = model_fn()
    src = random_src(LENGTHS)
    hyps = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    caps = [max_output_len(n + 1, 1.0, 5) for n in LENGTHS]
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        for i, sent in enumerate(hyps):
            assert len(sent) == 4
            for h in sent:
                ended = len(h.tokens) < caps[i]  # below the cap it ended in EOS
                out = h.tokens + [EOS_ID] if ended else h.tokens
                tgt_in = torch.tensor([[BOS_ID] + out[:-1]])
                logits = model.decode(tgt_in, memory[i : i + 1], src_mask[i : i + 1])[0]
                if model_fn is eos_ramp_model:  # the same nudge, at positions 0..T-1
                    logits[:, EOS_ID] += 0.5 * torch.arange(len(out)) - 3.0
                lp = logits.float().log_softmax(-1).gather(1, torch.tensor(out)[:, None]).sum()
                assert h.log_prob == pytest.approx(float(lp), abs=1e-4)
                assert h.score == pytest.approx(h.log_prob / length_penalty(len(out), 0.6))


def test_beam_wider_than_the_vocabulary_finds_the_exhaustive_best() -> None:
    """Beam 8 over the hand table's 6-token vocabulary (4 ever generated): the first step
    has fewer candidates than slots (the rest stay empty), and the 3 best hypotheses
    equal those of an exhaustive enumeration of the table (alpha 0: plain log P)."""
    model = hand_table()

    def log_p(seq: tuple[int, ...]) -> float:
        total = 0.0
        for i, tok in enumerate(seq):
            total += math.log(model.table.get(seq[:i], model.default)[tok])
        return total

    every = [(*words, EOS_ID) for n in range(6) for words in itertools.product((A, B), repeat=n)]
    best = sorted(every, key=log_p, reverse=True)[:3]
    (hyps,) = beam_search(model, SRC, beam=8, alpha=0.0, max_len_a=0.0, max_len_b=10, nbest=3)
    assert [h.tokens for h in hyps] == [list(seq[:-1]) for seq in best]
    assert [h.log_prob for h in hyps] == pytest.approx([log_p(s) for s in best], abs=1e-5)


@pytest.mark.parametrize("v", [7, 200, 8000, 10_000, 1_000 + 37])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_row_topk_equals_torch_topk(v: int, k: int, ties: bool) -> None:
    """The two-pass top-k returns torch.topk's values, best first, at columns that hold
    them (distinct columns; with many exact ties, which ones is unspecified), including a
    remainder of columns past the last whole block and rows of -inf (never-generated
    tokens)."""
    g = torch.Generator().manual_seed(v * 10 + k)
    x = (
        torch.randint(0, 6, (33, v), generator=g).float()
        if ties
        else torch.randn(33, v, generator=g)
    )
    x[:, :2] = float("-inf")
    x[0, : v - 1] = float("-inf")  # one finite value left: the rest of the top k is -inf
    k = min(k, v)
    values, cols = row_topk(x, k)
    expected = x.topk(k, dim=1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(1, cols), values)
    assert all(len(set(row)) == k for row in cols.tolist())


def test_min_len_holds_eos_back_and_scores_stay_the_models() -> None:
    """min_len (fairseq's --min-len): no output ends before min_len tokens, though
    without it some do; EOS stays in the normaliser, so each hypothesis's log P is still
    the teacher-forced sum of the model's log-softmax scores; greedy equals a search over
    the model with EOS's logit set to -inf for the first min_len steps."""
    model = eos_ramp_model()
    src = random_src(LENGTHS)
    m = 10
    caps = [max_output_len(n + 1, 1.0, 5) for n in LENGTHS]
    free = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    # the rule has work to do: without it some outputs end in EOS before m tokens
    assert any(
        len(h.tokens) < min(m, cap) for sent, cap in zip(free, caps, strict=True) for h in sent
    )
    assert any(
        len(o) < min(m, cap) for o, cap in zip(greedy_search(model, src, 1.0, 5), caps, strict=True)
    )
    hyps = beam_search(
        model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4, min_len=m
    )
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        for i, sent in enumerate(hyps):
            for h in sent:
                assert len(h.tokens) >= min(m, caps[i])
                out = h.tokens + [EOS_ID] if len(h.tokens) < caps[i] else h.tokens
                tgt_in = torch.tensor([[BOS_ID] + out[:-1]])
                logits = model.decode(tgt_in, memory[i : i + 1], src_mask[i : i + 1])[0]
                logits[:, EOS_ID] += 0.5 * torch.arange(len(out)) - 3.0
                lp = logits.log_softmax(-1).gather(1, torch.tensor(out)[:, None]).sum()
                assert h.log_prob == pytest.approx(float(lp), abs=1e-4)

    class HeldBack(EosRamp):
        def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list) -> Tensor:
            t = states[0].self_cache.length
            logits = super().decode_step(tokens, src_mask, states)
            if t < m:
                logits[:, EOS_ID] = float("-inf")
            return logits

    held = HeldBack(model.cfg).eval()
    held.load_state_dict(model.state_dict())
    assert greedy_search(model, src, 1.0, 5, min_len=m) == greedy_search(held, src, 1.0, 5)
    with pytest.raises(ValueError, match="min_len"):
        beam_search(model, src, beam=2, alpha=0.6, max_len_a=1.0, max_len_b=5, min_len=-1)
