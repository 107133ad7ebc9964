"""Forced decoding: the log-probability a model gives a given reference (fairseq's
`--score-reference`, Marian's `marian-scorer`).

For a source X and a reference Y = y_1 .. y_n, the model is fed BOS y_1 .. y_n (teacher
forcing, one pass of `forward`) and read at y_1 .. y_n EOS:

    log P(Y|X) = sum_t log softmax(logits_t)[y_t]

over the whole vocabulary, as beam search scores its hypotheses (`search.best_next_tokens`:
the normaliser covers every token, PAD and BOS included), so that scoring a search's own
output gives back its `Hypothesis.log_prob`. |Y| counts EOS, as the search does; the
length-normalised score is the search's: log P / lp(|Y|) with the GNMT penalty
((5 + |Y|) / 6) ** alpha. An ensemble scores with its members' mean distribution, as it
searches.

Pairs are batched by source length (`decode_batches`) and returned in input order; padding
is masked, so a pair's score does not depend on the batch it is in (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, DecodeConfig
from aiayn.data.batching import decode_batches
from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.search import length_penalty, position_limit
from aiayn.decoding.translate import (
    Decoder,
    SubwordTokenizer,
    TranslateStats,
    encode_sources,
    pad_batch,
)


@dataclass(frozen=True)
class PairScore:
    """One pair's forced-decoding score.

    total: log P(ref | src), natural log. tokens: |Y|, the reference's subwords + EOS.
    per_token: total / tokens. normalized: total / lp(tokens), the beam search's score.
    """

    total: float
    tokens: int
    per_token: float
    normalized: float


def token_log_probs(model: Decoder, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
    """log P(tgt_out[b, t] | src[b], tgt_in[b, :t+1]) in float32, (B, T); 0 at PAD targets.

    Args:
        src: (B, S) source ids ending in EOS, PAD-padded. tgt_in: (B, T) BOS + reference.
        tgt_out: (B, T) reference + EOS, PAD-padded.
    """
    members = model.members if isinstance(model, Ensemble) else [model]
    per_member = [F.log_softmax(m(src, tgt_in).float(), dim=-1) for m in members]
    log_p = per_member[0]
    if len(per_member) > 1:  # the mean of the members' distributions, as Ensemble decodes
        log_p = torch.logsumexp(torch.stack(per_member), dim=0) - torch.log(
            torch.tensor(float(len(per_member)))
        )
    picked = log_p.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(tgt_out == PAD_ID, 0.0)


@torch.inference_mode()
def score_ids(
    model: Decoder,
    sources: Sequence[list[int]],
    references: Sequence[list[int]],
    alpha: float,
    max_tokens: int,
    device: str | torch.device = "cpu",
) -> list[PairScore]:
    """Score id sequences: each source ends in EOS; references have neither BOS nor EOS."""
    if len(sources) != len(references):
        raise ValueError(f"{len(sources)} sources but {len(references)} references")
    results: list[PairScore | None] = [None] * len(sources)
    # the budget counts the longer side of each pair: the decoder's pass is as wide
    lengths = [max(len(s) - 1, len(r)) for s, r in zip(sources, references, strict=True)]
    for rows in decode_batches(lengths, max_tokens):
        src = pad_batch([sources[i] for i in rows], device)
        tgt_in = pad_batch([[BOS_ID, *references[i]] for i in rows], device)
        tgt_out = pad_batch([[*references[i], EOS_ID] for i in rows], device)
        totals = token_log_probs(model, src, tgt_in, tgt_out).double().sum(dim=1).tolist()
        for i, total in zip(rows, totals, strict=True):
            n = len(references[i]) + 1
            results[i] = PairScore(total, n, total / n, total / length_penalty(n, alpha))
    return [r for r in results if r is not None]


def score_lines(
    model: Decoder,
    tokenizer: SubwordTokenizer,
    sources: Sequence[str],
    references: Sequence[str],
    cfg: DecodeConfig,
    device: str | torch.device = "cpu",
) -> list[PairScore]:
    """Score text pairs: each source and reference subword-encoded as `translate` does
    (with separate vocabularies, each with its own side's model).

    A blank source is scored as the lone EOS the model would see for it (translate does
    not feed blank lines to the model, but a pair has a reference to score). Sources and
    references longer than the model's position table (or `cfg.max_input_len`) are
    truncated, with a warning naming the line (`encode_sources`).

    Raises:
        ValueError: the two lists differ in length.
    """
    cfg.validate()
    if len(sources) != len(references):
        raise ValueError(f"{len(sources)} sources but {len(references)} references")
    limit = position_limit(model)
    max_len = cfg.max_input_len if limit is None else min(cfg.max_input_len, limit - 1)
    stats = TranslateStats(lines=len(sources))
    src_ids = [s or [EOS_ID] for s in encode_sources(tokenizer, sources, max_len, stats)]
    # references are target text: with separate vocabularies, the target's model encodes them
    target = getattr(tokenizer, "target", tokenizer)
    ref_ids = [r[:-1] if r else [] for r in encode_sources(target, references, max_len, stats)]
    model.eval()
    return score_ids(model, src_ids, ref_ids, cfg.alpha, cfg.max_tokens, device)
