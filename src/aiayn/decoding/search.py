"""Greedy and beam search with incremental decoding (section 6.1, "inference").

The paper decodes with beam size 4 and the GNMT length penalty alpha = 0.6:
``score(Y) = log P(Y|X) / lp(Y)`` with ``lp(Y) = ((5 + |Y|) / 6) ** alpha``; the output is
at most input length + 50 tokens long, and the search terminates early when possible.

Choices, written down once:

- ``|Y|`` counts every token whose log-probability is in ``log P(Y|X)``: the EOS when the
  model emitted it, so a hypothesis ``w1 w2 EOS`` has ``|Y| = 3``. A hypothesis cut off at
  the length cap has no EOS and ``|Y|`` = its number of tokens.
- Source length is the number of non-pad tokens of ``src`` as fed, EOS included (fairseq's
  convention), so the cap is ``floor(a * src_len + b)`` output tokens, EOS not counted.
  It is clamped to [1, the model's ``max_positions``].
- PAD and BOS are never generated (their log-probabilities are set to -inf, as in fairseq):
  the model was never trained to predict them, and PAD's logit is not trained at all.
- Beam step (OpenNMT-py semantics): each sentence keeps the ``beam`` best candidates of
  ``beam * V`` extensions; those ending in EOS leave the beam for the finished list and
  their slot stays empty for that one step (the next step again picks ``beam``
  candidates). fairseq and tensor2tensor instead refill the beam from ``2 * beam``
  candidates; combined with the early-termination bound below that makes beam 1 differ
  from greedy search (the runner-up keeps decoding after greedy's EOS), so we do not.
- Early termination: a sentence is done when it has no live hypothesis, or when it has
  ``beam`` finished ones and no live one can beat the worst of them (see
  :func:`best_possible_score`), or when it reaches its length cap, where its live
  hypotheses are finished as they are. Done sentences leave the active batch.
- Constraints (`aiayn.decoding.constraints`): an optional per-hypothesis mask of the
  tokens allowed next, carried with the hypotheses and reordered with the beam. Tokens
  outside it get log P -inf after the model's normaliser is taken over the whole
  vocabulary (the model's distribution is not renormalised, as fairseq's
  prefix_allowed_tokens_fn). The parser's tree constraint is one such mask. A constraint
  may rescore the table before the mask (`reweigh`; the tree constraint's `word_mass`).
- With the speed paths, incremental states that can run this whole search in compiled
  code (`aiayn.speed`'s `whole_search`: the one-call decoder step's) do, without a
  constraint; they implement the choices above and give the same hypotheses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor

from aiayn import speed
from aiayn.config import BOS_ID, EOS_ID, PAD_ID
from aiayn.decoding.constraints import Constraint

#: Tokens that are never generated: padding and the start symbol.
NEVER_GENERATED = (PAD_ID, BOS_ID)


@dataclass(frozen=True)
class Hypothesis:
    """One finished output: token ids without BOS/EOS, its length-normalised score and log P."""

    tokens: list[int]
    score: float
    log_prob: float


class IncrementalDecoder(Protocol):
    """What search needs from a model (see `Transformer`): encode once, then decode steps.

    `init_state` returns per-layer states with a `reorder(index, sentences=None)` method:
    keep hypothesis rows `index`, and of what is stored once per sentence (the encoder's
    keys/values), the sentences `sentences` (None: unchanged).
    """

    def encode(self, src: Tensor) -> tuple[Any, Tensor]: ...  # (memory, src_mask)

    def init_state(self, memory: Any, max_len: int) -> Any: ...

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: Any) -> Tensor: ...


# ------------------------------------------------------------------------- formulas
def length_penalty(length: Any, alpha: float) -> Any:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6) ** alpha (for an int, float or Tensor)."""
    return ((5 + length) / 6) ** alpha


def max_output_len(src_len: int, a: float, b: float) -> int:
    """Output length cap floor(a * src_len + b); the paper's is src_len + 50 (a=1, b=50)."""
    return math.floor(a * src_len + b)


def best_possible_score(live_log_prob: float, cap: int, alpha: float) -> float:
    """Upper bound on the final score of a live hypothesis with log-probability l <= 0.

    Any completion has log-probability l' <= l (log-probabilities only add terms <= 0) and
    length |Y'| <= cap, so with alpha >= 0, 1 <= lp(|Y'|) <= lp(cap) and
    l' / lp(|Y'|) <= l / lp(|Y'|) <= l / lp(cap) (the last step because l <= 0).
    """
    return live_log_prob / length_penalty(cap, alpha)


def validate_search_options(
    beam: int, alpha: float, nbest: int, max_len_a: float, max_len_b: float, min_len: int = 0
) -> None:
    """Raise ValueError naming the first invalid option (RELIABILITY F14), before any work."""
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be in [1, beam={beam}], got {nbest}")
    if not alpha >= 0:  # also rejects NaN
        raise ValueError(f"alpha (length penalty) must be >= 0, got {alpha}")
    if not max_len_a >= 0:
        raise ValueError(f"max_len_a must be >= 0, got {max_len_a}")
    if not max_len_b >= 0:
        raise ValueError(f"max_len_b must be >= 0, got {max_len_b}")
    if min_len < 0:
        raise ValueError(f"min_len must be >= 0, got {min_len}")


# ------------------------------------------------------------------------- steps
def position_limit(model: Any) -> int | None:
    """Longest sequence the model's position table holds, if the model says."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "max_positions", None)


def output_caps(model: Any, src: Tensor, a: float, b: float) -> list[int]:
    """Per-sentence output length cap from its own source length (non-pad tokens, EOS incl.)."""
    limit = position_limit(model)
    caps = []
    for n in (src != PAD_ID).sum(dim=1).tolist():
        cap = max(1, max_output_len(n, a, b))  # at least one step: every sentence gets an output
        caps.append(cap if limit is None else min(cap, limit))
    return caps


def excluded(step: int, min_len: int) -> tuple[int, ...]:
    """The tokens not to be generated after `step` output tokens: PAD and BOS always, EOS
    while the output is shorter than `min_len` (fairseq's --min-len)."""
    return NEVER_GENERATED + (EOS_ID,) if step < min_len else NEVER_GENERATED


def best_next_tokens(
    model: IncrementalDecoder,
    last: Tensor,
    src_mask: Tensor,
    states: Any,
    k: int,
    exclude: tuple[int, ...] = NEVER_GENERATED,
    allowed: Tensor | None = None,
    reweigh: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Each row's k most probable next tokens and their log-probabilities, in float32 even
    if the model runs in bf16: (R, k) log P, (R, k) token ids, best first. With fewer than
    k tokens in the vocabulary the missing candidates are empty: log P -inf.

    log P(token) = logit - logsumexp(logits), and within a row the order of the logits is
    the order of the log-probabilities, so the k best are picked by logit and only they
    are normalised, instead of a log-softmax over the whole (R, V) table. The normaliser
    covers every token, the `exclude`d ones included: the model's distribution is not
    renormalised. With the speed paths on (`aiayn.speed`), a model whose output layer
    finds the best tokens itself (int8 decoding: `step_topk`) is asked for them, so that
    its logits are scaled as they are read rather than written out; the rest goes through
    `logits_topk`.

    `allowed` (R, V) bool, from a `Constraint`: tokens outside it are not picked either
    (log P -inf); the normaliser still covers every token. `reweigh`, the constraint's
    (`Constraint.reweigh`), maps the (R, V) log P table to the scores the search ranks by.
    """
    if allowed is not None:
        logits = model.decode_step(last, src_mask, states)
        return _masked_topk(logits, k, exclude, allowed, reweigh)
    fused = speed.IMPLEMENTATIONS.get("step_topk")
    if fused is not None:
        found = fused(model, last, src_mask, states, k, exclude)
        if found is not None:
            return found
    return logits_topk(model.decode_step(last, src_mask, states), k, exclude)


def logits_topk(logits: Tensor, k: int, exclude: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """`best_next_tokens` of a table of next-token logits (R, V). On the CPU the speed
    paths' compiled `lse_topk` does it in one pass over each row where it can be built
    (`aiayn.speed`); PyTorch ops otherwise, and without the speed paths."""
    kernel = speed.IMPLEMENTATIONS.get("lse_topk")
    fast = kernel(logits, k, exclude) if kernel is not None else None
    if fast is not None:
        return fast
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    logits[:, list(exclude)] = float("-inf")
    top, token = row_topk(logits, min(k, logits.size(-1)))
    if top.size(1) < k:
        missing = (top.size(0), k - top.size(1))
        top = torch.cat([top, top.new_full(missing, float("-inf"))], dim=1)
        token = torch.cat([token, token.new_full(missing, EOS_ID)], dim=1)
    return top - lse, token


def _masked_topk(
    logits: Tensor,
    k: int,
    exclude: tuple[int, ...],
    allowed: Tensor,
    reweigh: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """`best_next_tokens` under a mask: each row's k best allowed tokens, log P over all
    (with `reweigh`, the constraint's scores of the (R, V) log P table)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    if reweigh is not None:  # scores, already normalised
        logits, lse = reweigh(logits - lse), torch.zeros_like(lse)
    logits[:, list(exclude)] = float("-inf")
    logits.masked_fill_(~allowed, float("-inf"))
    top, token = row_topk(logits, min(k, logits.size(-1)))
    if top.size(1) < k:
        missing = (top.size(0), k - top.size(1))
        top = torch.cat([top, top.new_full(missing, float("-inf"))], dim=1)
        token = torch.cat([token, token.new_full(missing, EOS_ID)], dim=1)
    return top - lse, token


#: Columns per block in `row_topk`: the fastest of the sizes tried for vocabularies of
#: 8,000-10,000 and beams of 4-8 (measured: docs/performance.md).
TOPK_BLOCK = 64


def row_topk(x: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of a 2-D table and their columns, largest first:
    the same values as ``x.topk(k, dim=1)``, found in two passes on the CPU.

    torch.topk on the CPU walks each whole row, and with a vocabulary-wide row per
    hypothesis it is a noticeable part of a small model's beam search. Here each row is
    cut into blocks of `block` columns; a row's k largest values lie in the k blocks with
    the largest maxima (a block left out has a maximum no larger than each of k chosen
    blocks' maxima, so it can only hold ties of the k-th value), so one pass takes the
    block maxima and torch.topk then runs on k blocks (plus the remainder columns)
    instead of the row (measured: docs/performance.md, "C beam step", whose fallback
    this is). Among exactly equal values, which columns are returned is unspecified, as
    with torch.topk (whose choice among ties is not the lowest column either); each row is
    searched on its own, so results do not depend on the batch.
    """
    r, v = x.shape
    nb = v // block
    if x.device.type != "cpu" or nb <= 2 * k:
        return x.topk(k, dim=1)
    main = x[:, : nb * block].view(r, nb, block)
    blocks = main.amax(dim=2).topk(k, dim=1).indices  # (r, k)
    cand = main.gather(1, blocks.unsqueeze(2).expand(r, k, block)).view(r, k * block)
    cols = (blocks.unsqueeze(2) * block + torch.arange(block, device=x.device)).view(r, k * block)
    if nb * block < v:  # the remainder columns are always candidates
        cand = torch.cat([cand, x[:, nb * block :]], dim=1)
        cols = torch.cat([cols, torch.arange(nb * block, v, device=x.device).expand(r, -1)], dim=1)
    values, j = cand.topk(k, dim=1)
    return values, cols.gather(1, j)


def reorder_states(states: Any, index: Tensor, sentences: Tensor | None = None) -> None:
    """Keep rows `index` of every layer's incremental state (beam reordering, dropping
    rows) and, if given, sentences `sentences` of what is kept once per sentence."""
    for state in states:
        state.reorder(index, sentences)


# ------------------------------------------------------------------------- greedy
@torch.inference_mode()
def greedy_search(
    model: IncrementalDecoder, src: Tensor, max_len_a: float, max_len_b: float, min_len: int = 0
) -> list[list[int]]:
    """Pick the most probable token at each step until EOS or the length cap.

    Args:
        model: an `IncrementalDecoder` in eval mode. src: (B, S) source ids, PAD-padded,
            each ending in EOS.
        min_len: no EOS before this many output tokens (the length cap still ends them).
    Returns:
        B lists of token ids, without BOS and EOS.
    """
    validate_search_options(1, 0.0, 1, max_len_a, max_len_b, min_len)
    caps = output_caps(model, src, max_len_a, max_len_b)
    out: list[list[int]] = [[] for _ in caps]
    if not caps:
        return out
    memory, src_mask = model.encode(src)
    states = model.init_state(memory, max(caps))
    whole = speed.IMPLEMENTATIONS.get("whole_search")
    found = None if whole is None else whole(states, src_mask, caps, 1, 0.0, min_len)
    if found is not None:  # the same search in compiled code: a beam of 1 is greedy search
        return [hyps[0].tokens if hyps else [] for hyps in found]
    active = list(range(len(caps)))  # row -> sentence
    last = torch.full((len(caps), 1), BOS_ID, dtype=torch.long, device=src.device)
    for step in range(max(caps)):
        # the most probable token: the best one of `best_next_tokens` (which a compiled
        # step finds without writing the logits out)
        _, top = best_next_tokens(model, last, src_mask, states, 1, excluded(step, min_len))
        best = top[:, 0]  # (R,)
        keep = []
        for row, (sent, token) in enumerate(zip(active, best.tolist(), strict=True)):
            if token == EOS_ID:
                continue
            out[sent].append(token)
            if len(out[sent]) < caps[sent]:
                keep.append(row)
        if not keep:
            break
        if len(keep) == len(active):  # nobody finished: the state needs no reordering
            last = best.unsqueeze(1)
            continue
        index = torch.tensor(keep, device=src.device)
        reorder_states(states, index, index)  # one row per sentence
        src_mask, last = src_mask[index], best[index].unsqueeze(1)
        active = [active[row] for row in keep]
    return out


# ------------------------------------------------------------------------- beam
@dataclass
class _Beams:
    """The live hypotheses of the active sentences: A sentences x s slots, batch-first
    (s = 1 before the first step: k copies of BOS would give k identical candidates)."""

    sent: list[int]  # (A,) original index of each active sentence
    tokens: Tensor  # (A*s, t) tokens decoded so far, BOS excluded
    scores: Tensor  # (A, s) float32 log P of each slot; -inf = empty slot
    src_mask: Tensor  # (A*s, 1, 1, S)


def _init_beams(src_mask: Tensor) -> _Beams:
    b = src_mask.size(0)
    scores = torch.zeros(b, 1, device=src_mask.device)
    tokens = torch.empty(b, 0, dtype=torch.long, device=src_mask.device)
    return _Beams(list(range(b)), tokens, scores, src_mask)


def _expand(
    model: IncrementalDecoder,
    beams: _Beams,
    states: Any,
    k: int,
    min_len: int,
    allowed: Tensor | None = None,
    reweigh: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Score all s*V extensions of each sentence's s slots and keep its k best.

    Returns:
        scores (A, k) float32 log P of the candidates, rows (A, k) the row in A*s each
        extends, tokens (A, k) the token each appends.
    """
    a, s = beams.scores.shape
    if beams.tokens.size(1) == 0:
        last = torch.full((a * s, 1), BOS_ID, dtype=torch.long, device=beams.scores.device)
    else:
        last = beams.tokens[:, -1:]
    # A sentence's k best of its s*V extensions are among each slot's own k best tokens.
    exclude = excluded(beams.tokens.size(1), min_len)
    log_p, token = best_next_tokens(
        model, last, beams.src_mask, states, k, exclude, allowed, reweigh
    )  # (A*s, k)
    candidates = (beams.scores.view(-1, 1) + log_p).view(a, s * k)
    scores, flat = candidates.topk(k, dim=1)  # (A, k)
    origin = torch.div(flat, k, rounding_mode="floor")  # slot within the sentence
    rows = origin + torch.arange(a, device=flat.device).unsqueeze(1) * s
    return scores, rows, token.view(a, s * k).gather(1, flat)


def _finish(candidate: list[int], log_prob: float, length: int, alpha: float) -> Hypothesis:
    return Hypothesis(candidate, log_prob / length_penalty(length, alpha), log_prob)


def _set_aside(
    scores: Tensor,
    tokens: Tensor,
    new: Tensor,
    caps: list[int],
    sent: list[int],
    finished: list[list[Hypothesis]],
    alpha: float,
) -> Tensor:
    """Move candidates ending in EOS, and all of a sentence's at its cap, to `finished`.

    Args:
        scores: (A, k) candidate log P. tokens: (A*k, t+1) candidate sequences, their
            last column is `new` (A, k).
    Returns:
        (A, k) log P of the candidates that stay live, -inf where a slot is now empty.
    """
    step = tokens.size(1)  # |Y| of every candidate, EOS included
    k = scores.size(1)
    live = scores.tolist()
    host: list[list[int]] | None = None  # tokens copied from the device once, if needed
    for a, row_new in enumerate(new.tolist()):
        at_cap = step >= caps[sent[a]]
        for j, (log_prob, token) in enumerate(zip(live[a], row_new, strict=True)):
            if log_prob == float("-inf") or (token != EOS_ID and not at_cap):
                continue
            host = tokens.tolist() if host is None else host
            # an EOS is dropped from the output; at the cap the hypothesis ends as it is
            seq = host[a * k + j][:-1] if token == EOS_ID else host[a * k + j]
            finished[sent[a]].append(_finish(seq, log_prob, step, alpha))
            live[a][j] = float("-inf")
    return torch.tensor(live, dtype=scores.dtype, device=scores.device)


def _is_done(finished: list[Hypothesis], best_live: float, cap: int, k: int, alpha: float) -> bool:
    """No live hypothesis left, or none that can beat the worst of the k best finished."""
    if best_live == float("-inf"):
        return True
    if len(finished) < k:
        return False
    worst = sorted((h.score for h in finished), reverse=True)[k - 1]
    return best_possible_score(best_live, cap, alpha) <= worst


@torch.inference_mode()
def beam_search(
    model: IncrementalDecoder,
    src: Tensor,
    beam: int,
    alpha: float,
    max_len_a: float,
    max_len_b: float,
    nbest: int = 1,
    min_len: int = 0,
    constraint: Constraint | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search with GNMT length normalisation and early termination (6.1).

    Args:
        model: an `IncrementalDecoder` in eval mode. src: (B, S) source ids, PAD-padded,
            each ending in EOS.
        beam: beam size k. alpha: length penalty exponent (0 = plain log-probability).
        max_len_a, max_len_b: each sentence's output cap floor(a * src_len + b).
        nbest: hypotheses returned per sentence, best first.
        min_len: no EOS before this many output tokens (fairseq's --min-len; EOS stays in
            the normaliser; the length cap still ends a hypothesis).
        constraint: the tokens each hypothesis may take next (`aiayn.decoding.constraints`),
            started with the B sentences' caps, asked for a mask before each step and
            advanced with the tokens taken and the rows they extend.
    Returns:
        B lists of `nbest` Hypothesis (fewer only if fewer were found), best score first.
    """
    validate_search_options(beam, alpha, nbest, max_len_a, max_len_b, min_len)
    caps = output_caps(model, src, max_len_a, max_len_b)
    finished: list[list[Hypothesis]] = [[] for _ in caps]
    if not caps:
        return finished
    memory, src_mask = model.encode(src)
    # The encoder K/V are projected once per sentence. The first step decodes one row per
    # sentence; its k best candidates then become the k hypothesis rows, and what is kept
    # per sentence (the encoder K/V) stays single.
    states = model.init_state(memory, max(caps))
    whole = speed.IMPLEMENTATIONS.get("whole_search")
    if whole is not None and constraint is None:  # the same search in compiled code
        found = whole(states, src_mask, caps, beam, alpha, min_len)
        if found is not None:
            return [hyps[:nbest] for hyps in found]
    beams = _init_beams(src_mask)
    cstate = None if constraint is None else constraint.start(caps)
    while beams.sent:
        allowed = None if constraint is None else constraint.allowed(cstate)
        rescore = getattr(constraint, "reweigh", None)  # optional (None: the log P)
        reweigh = None if rescore is None else partial(rescore, cstate)
        scores, rows, new = _expand(model, beams, states, beam, min_len, allowed, reweigh)
        a = len(beams.sent)
        tokens = torch.cat([beams.tokens[rows.view(-1)], new.view(-1, 1)], dim=1)
        live = _set_aside(scores, tokens, new, caps, beams.sent, finished, alpha)
        step = tokens.size(1)
        best_live = live.max(dim=1).values.tolist()
        keep = [
            i
            for i, s in enumerate(beams.sent)
            if step < caps[s] and not _is_done(finished[s], best_live[i], caps[s], beam, alpha)
        ]
        if len(keep) == a:  # no sentence done: every row goes on, reordered by origin
            index = rows.view(-1)
            reorder_states(states, index, None)
            if constraint is not None:
                cstate = constraint.advance(cstate, new.view(-1), index)
            # a sentence's rows share its source mask: reordering within it changes nothing
            same = beams.src_mask.size(0) == index.numel()
            beams = _Beams(
                beams.sent, tokens, live, beams.src_mask if same else beams.src_mask[index]
            )
            continue
        kept = torch.tensor(keep, dtype=torch.long, device=src.device)
        index = rows[kept].view(-1)  # reorder by origin and drop done sentences at once
        reorder_states(states, index, kept)
        if constraint is not None:
            cstate = constraint.advance(cstate, new[kept].view(-1), index)
        beams = _Beams(
            [beams.sent[i] for i in keep],
            tokens.view(a, beam, step)[kept].view(-1, step),
            live[kept],
            beams.src_mask[index],
        )
    # sorted() is stable, so equal scores keep the order in which they finished
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[:nbest] for hyps in finished]
