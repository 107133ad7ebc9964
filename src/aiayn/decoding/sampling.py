"""Sampling: outputs drawn from the model's distribution instead of searched for.

The standard way to make synthetic sources for back-translation (Edunov et al., 2018,
"Understanding Back-Translation at Scale"): unrestricted or top-k sampling of the reverse
model gives a richer training signal than its beam output. Each step draws the next token
from

    p_T(y) proportional to exp(logit(y) / T)       (temperature T > 0)

restricted to the k most probable tokens (`top_k`, 0 = all) and then to the smallest set
of most probable tokens whose probability reaches `top_p` (nucleus sampling, Holtzman et
al., 2020; 1 = all), renormalised. PAD and BOS are never drawn (as in the search); EOS
ends an output; the length cap is the search's (`output_caps`).

Reproducible and batch-invariant: sample j of input line i draws its uniforms from its own
stream, seeded by (seed, i, j) through numpy's SeedSequence, and picks by the inverse of
the cumulative distribution. The same seed gives the same samples whatever the batch size,
the batch a line falls in, or the other lines (up to float rounding of the logits across
batch shapes). Each `Hypothesis` carries the sample's log-probability under the model
itself (temperature 1, nothing cut), the one `score` gives it, and as its score that
divided by the search's length penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID
from aiayn.decoding.search import (
    Hypothesis,
    IncrementalDecoder,
    excluded,
    length_penalty,
    output_caps,
    reorder_states,
)


@dataclass(frozen=True)
class SamplingOptions:
    """How to sample: n outputs per input, temperature, top-k, top-p, seed."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first invalid option, before any work."""
        if self.n < 1:
            raise ValueError(f"samples per input must be >= 1, got {self.n}")
        if not self.temperature > 0:  # also rejects NaN
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: no cut), got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


# ------------------------------------------------------------------------- masks
def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """True at the tokens each row keeps: its k largest logits (all with k = 0 or k >= V).
    A tie with the k-th value is kept, so a row may keep more than k."""
    if k <= 0 or k >= logits.size(-1):
        return torch.ones_like(logits, dtype=torch.bool)
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits >= kth


def top_p_mask(probs: Tensor, p: float) -> Tensor:
    """True at the tokens each row keeps: the most probable ones, in order, until their
    mass reaches p; the token that crosses p is kept, so at least one always is."""
    if p >= 1:
        return probs > 0
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more probable tokens
    keep_sorted = (before < p) & (sorted_p > 0)
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sampling_distribution(logits: Tensor, opts: SamplingOptions) -> Tensor:
    """The distribution each row samples from (R, V), float64: temperature, then top-k,
    then top-p, renormalised. -inf logits (excluded tokens) get probability 0."""
    scaled = logits.double() / opts.temperature
    scaled = scaled.masked_fill(~top_k_mask(scaled, opts.top_k), float("-inf"))
    probs = scaled.softmax(dim=-1)
    probs = probs.masked_fill(~top_p_mask(probs, opts.top_p), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling: row r takes the first token whose cumulative probability
    exceeds uniforms[r] in [0, 1). A token of probability 0 is never taken."""
    cdf = probs.cumsum(dim=-1)
    u = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(1)
    token = torch.searchsorted(cdf, u, right=True).squeeze(1)
    last = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)  # the last possible token
    return torch.minimum(token, last)


class Streams:
    """One uniform stream per (input line, sample): numpy PCG64 seeded by SeedSequence
    (seed, line, sample), so what a row draws depends on nothing else."""

    def __init__(self, seed: int, lines: Sequence[int], n: int) -> None:
        self.rngs = [
            np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, line, j])))
            for line in lines
            for j in range(n)
        ]

    def next(self, rows: Sequence[int]) -> Tensor:
        """One uniform for each row in `rows` (indices into the streams)."""
        return torch.tensor([self.rngs[r].random() for r in rows], dtype=torch.float64)


# ------------------------------------------------------------------------- search
@torch.inference_mode()
def sample(
    model: IncrementalDecoder,
    src: Tensor,
    opts: SamplingOptions,
    max_len_a: float,
    max_len_b: float,
    alpha: float = 0.0,
    lines: Sequence[int] | None = None,
) -> list[list[Hypothesis]]:
    """`opts.n` samples of each source sentence, batched: every sentence's n rows decode
    together until all of them have ended (EOS or the length cap).

    Args:
        model: an `IncrementalDecoder` in eval mode. src: (B, S) source ids, PAD-padded,
            each ending in EOS.
        alpha: the length penalty of each Hypothesis's score (log P / lp(|Y|)).
        lines: each sentence's number in the input, which seeds its streams (default
            0..B-1); give the line numbers so that batching does not change the samples.
    Returns:
        B lists of n Hypothesis, in the order drawn (not sorted).
    """
    opts.validate()
    n = opts.n
    caps = output_caps(model, src, max_len_a, max_len_b)
    lines = list(range(len(caps))) if lines is None else list(lines)
    if len(lines) != len(caps):
        raise ValueError(f"{len(lines)} line numbers for {len(caps)} sentences")
    if not caps:
        return []
    streams = Streams(opts.seed, lines, n)
    memory, src_mask = model.encode(src)
    states = model.init_state(memory, max(caps))  # the encoder K/V stay once per sentence
    # The first step decodes one row per sentence (all its samples start alike); then each
    # sentence has n rows, sentence-major, as long as one of its samples goes on.
    active = list(range(len(caps)))  # sentences still decoding
    rows = len(caps) * n
    last = torch.full((len(caps), 1), BOS_ID, dtype=torch.long, device=src.device)
    tokens: list[list[int]] = [[] for _ in range(rows)]  # row s * n + j: sample j of s
    log_probs = [0.0] * rows
    ended, drew_eos = [False] * rows, [False] * rows
    for step in range(max(caps)):
        logits = model.decode_step(last, src_mask, states).float()
        if step == 0:
            logits = logits.repeat_interleave(n, dim=0)
        log_p = logits.log_softmax(dim=-1)  # the model's, over the whole vocabulary
        logits[:, list(excluded(step, 0))] = float("-inf")
        row_ids = [s * n + j for s in active for j in range(n)]
        new = draw(sampling_distribution(logits, opts), streams.next(row_ids))
        picked = log_p.gather(1, new.unsqueeze(1)).squeeze(1).tolist()
        for r, (row, token) in enumerate(zip(row_ids, new.tolist(), strict=True)):
            if ended[row]:
                continue
            log_probs[row] += picked[r]
            if token == EOS_ID:
                ended[row] = drew_eos[row] = True
            else:
                tokens[row].append(token)
                ended[row] = len(tokens[row]) >= caps[row // n]
        keep = [i for i, s in enumerate(active) if not all(ended[s * n : s * n + n])]
        if not keep:
            break
        kept = torch.tensor(keep, dtype=torch.long, device=src.device)
        if step == 0:  # one row per sentence becomes n
            index = kept.repeat_interleave(n)
        else:
            index = (kept.unsqueeze(1) * n + torch.arange(n, device=src.device)).view(-1)
        reorder_states(states, index, kept if len(keep) < len(active) else None)
        src_mask = src_mask[kept.repeat_interleave(n) if step == 0 else index]
        last = new[(kept.unsqueeze(1) * n + torch.arange(n, device=src.device)).view(-1)]
        last = last.unsqueeze(1)
        active = [active[i] for i in keep]
    out: list[list[Hypothesis]] = []
    for s in range(len(caps)):
        hyps = []
        for row in range(s * n, s * n + n):
            length = len(tokens[row]) + drew_eos[row]  # |Y| counts EOS, as the search does
            score = log_probs[row] / length_penalty(length, alpha)
            hyps.append(Hypothesis(tokens[row], score, log_probs[row]))
        out.append(hyps)
    return out
