"""Forced decoding (aiayn.decoding.score): a pair's log-probability equals the teacher-forced
sum written out from the model's forward, equals what the search says of its own output,
and does not depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from aiayn.config import BOS_ID, EOS_ID
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.score import score_ids, token_log_probs
from aiayn.decoding.search import beam_search, length_penalty
from helpers import random_src, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def by_hand(model: torch.nn.Module, src: list[int], ref: list[int]) -> float:
    """sum_t log softmax(forward(src, BOS ref)[t])[(ref EOS)[t]], one pair, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([src]), torch.tensor([[BOS_ID, *ref]]))[0].double()
    log_p = logits.log_softmax(dim=-1)
    return sum(float(log_p[t, y]) for t, y in enumerate([*ref, EOS_ID]))


def pairs(n: int, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n, 2), generator=g).tolist()
    srcs = [[*torch.randint(4, 40, (a,), generator=g).tolist(), EOS_ID] for a, _ in lengths]
    refs = [torch.randint(4, 40, (b,), generator=g).tolist() for _, b in lengths]
    return srcs, refs


def test_equals_the_teacher_forced_sum_written_out() -> None:
    model = tiny_model()
    srcs, refs = pairs(7)
    scores = score_ids(model, srcs, refs, alpha=0.6, max_tokens=4000)
    for s, src, ref in zip(scores, srcs, refs, strict=True):
        expected = by_hand(model, src, ref)
        assert s.total == pytest.approx(expected, abs=1e-4)
        assert s.tokens == len(ref) + 1
        assert s.per_token == pytest.approx(expected / (len(ref) + 1), abs=1e-5)
        assert s.normalized == pytest.approx(expected / ((5 + len(ref) + 1) / 6) ** 0.6, abs=1e-4)


def test_batch_invariant_and_in_input_order() -> None:
    model = tiny_model()
    srcs, refs = pairs(12)
    together = score_ids(model, srcs, refs, alpha=0.6, max_tokens=4000)
    tiny_batches = score_ids(model, srcs, refs, alpha=0.6, max_tokens=10)
    alone = [
        score_ids(model, [s], [r], alpha=0.6, max_tokens=4000)[0]
        for s, r in zip(srcs, refs, strict=True)
    ]
    for a, b, c in zip(together, tiny_batches, alone, strict=True):
        assert a.total == pytest.approx(c.total, abs=1e-4)
        assert b.total == pytest.approx(c.total, abs=1e-4)


def test_scoring_the_searchs_output_gives_back_its_log_prob() -> None:
    """The search's Hypothesis.log_prob, recomputed by teacher forcing: two implementations
    (incremental steps on the fast model, one forward pass) agree. A hypothesis cut at the
    length cap has no EOS: its log P is the sum over its tokens only."""
    model = tiny_model()
    head = torch.nn.Linear(32, 40, bias=True)  # a bias towards EOS: outputs of varied length
    with torch.no_grad():
        head.weight.copy_(model.generator.weight)
        head.bias.zero_()
        head.bias[EOS_ID] = 1.5
    model.generator = head
    src = random_src([5, 3, 7, 2])
    hyps = beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=3, nbest=4)
    checked = {True: 0, False: 0}
    for row, sentence in zip(src.tolist(), hyps, strict=True):
        source = [t for t in row if t != 0]
        for h in sentence:
            per_token = (
                token_log_probs(
                    model,
                    torch.tensor([source]),
                    torch.tensor([[BOS_ID, *h.tokens]]),
                    torch.tensor([[*h.tokens, EOS_ID]]),
                )[0]
                .detach()
                .double()
            )
            n = len(h.tokens)
            with_eos = h.score == pytest.approx(h.log_prob / length_penalty(n + 1, 0.6), rel=1e-6)
            expected = float(per_token.sum() if with_eos else per_token[:n].sum())
            assert h.log_prob == pytest.approx(expected, abs=1e-4)
            if with_eos:
                total = score_ids(model, [source], [h.tokens], 0.6, 4000)[0]
                assert total.normalized == pytest.approx(h.score, abs=1e-4)
            checked[with_eos] += 1
    assert checked[True] and checked[False]  # both kinds were seen


def test_an_ensemble_scores_with_its_members_mean_distribution() -> None:
    a, b = tiny_model(0), tiny_model(1)
    srcs, refs = pairs(3)
    got = score_ids(Ensemble([a, b]), srcs, refs, alpha=0.0, max_tokens=4000)
    for s, src, ref in zip(got, srcs, refs, strict=True):
        with torch.no_grad():
            la = a(torch.tensor([src]), torch.tensor([[BOS_ID, *ref]]))[0].double().softmax(-1)
            lb = b(torch.tensor([src]), torch.tensor([[BOS_ID, *ref]]))[0].double().softmax(-1)
        mean = (la + lb) / 2
        expected = sum(math.log(mean[t, y]) for t, y in enumerate([*ref, EOS_ID]))
        assert s.total == pytest.approx(expected, abs=1e-4)


def test_mismatched_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="2 sources but 1 references"):
        score_ids(tiny_model(), [[4, EOS_ID], [5, EOS_ID]], [[4]], 0.6, 4000)
