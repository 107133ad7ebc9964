"""Sampling (aiayn.decoding.sampling): the masks on hand tables, the distribution of a
hand-set model's samples within a statistical bound, seeds, batch invariance."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from aiayn.config import EOS_ID
from aiayn.decoding.sampling import (
    SamplingOptions,
    draw,
    sample,
    sampling_distribution,
    top_k_mask,
    top_p_mask,
)
from helpers import A, B, TableModel, random_src, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

INF = float("-inf")


def test_top_k_keeps_the_k_largest_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 5.0, INF]])
    assert top_k_mask(logits, 2).tolist() == [[False, True, True, False], [True, True, True, False]]
    # ties with the k-th value are kept (row 2: two zeros tie for second place)
    assert top_k_mask(logits, 1).tolist() == [
        [False, True, False, False],
        [False, False, True, False],
    ]
    assert top_k_mask(logits, 0).all() and top_k_mask(logits, 4).all()


def test_top_p_keeps_the_smallest_head_that_reaches_p() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.05, 0.0, 0.9, 0.05]])
    # 0.5 < 0.6, 0.5 + 0.3 reaches it: keep {1, 2}
    assert top_p_mask(probs, 0.6).tolist()[0] == [False, True, True, False]
    assert top_p_mask(probs, 0.5).tolist()[0] == [False, True, False, False]
    assert top_p_mask(probs, 0.8).tolist()[0] == [False, True, True, False]
    # 0.8 < 0.81: one of the two 0.1s is needed, and one is enough
    kept = top_p_mask(probs, 0.81)[0]
    assert int(kept.sum()) == 3 and bool(kept[1]) and bool(kept[2])
    assert top_p_mask(probs, 0.95).tolist()[0] == [True, True, True, True]
    assert top_p_mask(probs, 0.01).tolist()[1] == [False, False, True, False]  # always one
    assert top_p_mask(probs, 1.0).tolist()[1] == [True, False, True, True]  # zeros never


def test_the_distribution_temperature_then_top_k_then_top_p() -> None:
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = p.log().unsqueeze(0)
    t2 = p.sqrt() / p.sqrt().sum()
    got = sampling_distribution(logits, SamplingOptions(temperature=2.0))[0]
    assert got.tolist() == pytest.approx(t2.tolist())
    got = sampling_distribution(logits, SamplingOptions(top_k=2))[0]
    assert got.tolist() == pytest.approx([0.4 / 0.7, 0.3 / 0.7, 0, 0])
    got = sampling_distribution(logits, SamplingOptions(top_p=0.85))[0]
    assert got.tolist() == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0])
    excluded = torch.tensor([[INF, 0.0, 0.0, INF]])
    assert sampling_distribution(excluded, SamplingOptions())[0].tolist() == [0, 0.5, 0.5, 0]


def test_draw_is_the_inverse_cdf_and_never_takes_a_zero() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.999999999])
    assert draw(probs, u).tolist() == [1, 1, 3, 3]


def hand_model() -> TableModel:
    """First word A 0.5 / B 0.3 / EOS 0.2; then EOS."""
    return TableModel({(): {A: 0.5, B: 0.3, EOS_ID: 0.2}}, default={EOS_ID: 1.0})


@pytest.mark.parametrize(
    ("opts", "expected"),
    [
        (SamplingOptions(), {A: 0.5, B: 0.3, EOS_ID: 0.2}),
        (SamplingOptions(temperature=0.5), {A: 25 / 38, B: 9 / 38, EOS_ID: 4 / 38}),
        (SamplingOptions(top_k=2), {A: 0.5 / 0.8, B: 0.3 / 0.8, EOS_ID: 0.0}),
        (SamplingOptions(top_p=0.5), {A: 1.0, B: 0.0, EOS_ID: 0.0}),
    ],
)
def test_samples_of_a_hand_set_model_follow_the_distribution(
    opts: SamplingOptions, expected: dict[int, float]
) -> None:
    """4,000 draws: each outcome's count within 5 standard deviations of n p (a binomial
    bound a correct sampler breaks with probability < 1e-5 per outcome); an outcome of
    probability 0 never appears. Each sample's log P is the model's, untempered."""
    n = 4000
    opts = SamplingOptions(n=n, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p)
    (hyps,) = sample(hand_model(), torch.tensor([[A, EOS_ID]]), opts, 0.0, 5)
    first = Counter(h.tokens[0] if h.tokens else EOS_ID for h in hyps)
    for token, p in expected.items():
        sd = math.sqrt(n * p * (1 - p))
        assert abs(first[token] - n * p) <= 5 * sd + 1e-9, (token, first[token], n * p)
    model_p = {A: 0.5, B: 0.3, EOS_ID: 0.2}
    for h in hyps:
        expected_log_p = math.log(model_p[h.tokens[0]]) if h.tokens else math.log(0.2)
        assert h.log_prob == pytest.approx(expected_log_p, abs=1e-6)
        assert len(h.tokens) <= 1


def test_the_same_seed_gives_the_same_samples_and_another_seed_others() -> None:
    model = tiny_model()
    src = random_src([5, 3, 7])
    opts = SamplingOptions(n=3, seed=7)
    a = sample(model, src, opts, 1.0, 5)
    b = sample(model, src, opts, 1.0, 5)
    c = sample(model, src, SamplingOptions(n=3, seed=8), 1.0, 5)
    assert [[h.tokens for h in s] for s in a] == [[h.tokens for h in s] for s in b]
    assert [[h.tokens for h in s] for s in a] != [[h.tokens for h in s] for s in c]
    assert all(len(s) == 3 for s in a)


def test_samples_do_not_depend_on_the_batch() -> None:
    """Each line alone (with its line number) draws what it draws in the batch."""
    model = tiny_model()
    src = random_src([5, 3, 7, 2])
    opts = SamplingOptions(n=2, seed=1, top_k=10)
    together = sample(model, src, opts, 1.0, 6)
    for i in range(4):
        row = src[i : i + 1, : int((src[i] != 0).sum())]
        (alone,) = sample(model, row, opts, 1.0, 6, lines=[i])
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
        for x, y in zip(alone, together[i], strict=True):
            assert x.log_prob == pytest.approx(y.log_prob, abs=1e-4)


def test_invalid_options_are_named() -> None:
    for opts, name in (
        (SamplingOptions(temperature=0), "temperature"),
        (SamplingOptions(top_k=-1), "top_k"),
        (SamplingOptions(top_p=0), "top_p"),
        (SamplingOptions(n=0), "samples"),
    ):
        with pytest.raises(ValueError, match=name):
            opts.validate()
