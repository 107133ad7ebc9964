"""Which batches an epoch holds, in which order, on which rank: from (seed, epoch) alone, so
a resumed run sees the same batches as an uninterrupted one.

Two ways to batch (`train.global_batch_tokens`):

- off (0): each rank reads whole batches of `train.max_tokens` (rank r takes batches r,
  r + W, ...; `batching.EpochBatches.shard`) and accumulates `train.update_freq` of them,
  so a step's batch is max_tokens x update_freq x ranks and grows with the ranks.
- on (G > 0): the epoch is one list of global batches of G tokens per side, the same on
  any number of ranks; each is cut into ranks x accumulation slices
  (`batching.EpochBatches.split`), rank r taking slices r, r + W, ... as its micro-batches.
  A step reads exactly one global batch, so 8 ranks, 4 ranks x 2 and 1 rank x 8 read the
  same sentences each step (their gradients differ only by float summation order), every
  pair is read by exactly one rank per epoch (no padding with repeated batches), and a
  position counted in global batches is the same on any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from aiayn.config import TrainConfig
from aiayn.data.batching import Batch, EpochBatches, collate, token_batches
from aiayn.data.corpus import Corpus
from aiayn.training.distributed import DistContext


@dataclass(frozen=True)
class BatchPlan:
    """How a step's batch is divided: what the trainer announces and logs.

    Attributes:
        global_tokens: tokens per side per optimizer step over all ranks and accumulation
            (train.global_batch_tokens; else max_tokens x accumulation x ranks, a bound).
        ranks: processes (world size).
        accumulation: micro-batches per rank per optimizer step.
        rank_tokens: tokens per side of one rank's micro-batch (a bound: padding included).
        fixed: True when the global batch is set (train.global_batch_tokens > 0).
    """

    global_tokens: int
    ranks: int
    accumulation: int
    rank_tokens: int
    fixed: bool

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "global_batch_tokens": self.global_tokens,
            "ranks": self.ranks,
            "accumulation": self.accumulation,
            "tokens_per_rank_batch": self.rank_tokens,
            "global_batch_fixed": self.fixed,
        }


def batch_plan(cfg: TrainConfig, world_size: int) -> BatchPlan:
    """The division of a step's batch on `world_size` ranks.

    With a global batch G, accumulation = max(update_freq, ceil(G / (ranks x max_tokens))):
    it is chosen rather than given so that max_tokens stays what it always was, the most
    tokens a rank puts through one forward pass (its memory), and a resume on fewer ranks
    raises the accumulation instead of running out of memory; update_freq is a floor (a
    1-rank run with update_freq = 8 reads each global batch in 8 slices, as 8 ranks do).
    """
    g = cfg.global_batch_tokens
    if g <= 0:
        return BatchPlan(
            cfg.max_tokens * cfg.update_freq * world_size,
            world_size,
            cfg.update_freq,
            cfg.max_tokens,
            False,
        )
    accumulation = max(cfg.update_freq, math.ceil(g / (world_size * cfg.max_tokens)))
    return BatchPlan(g, world_size, accumulation, g // (world_size * accumulation), True)


def epoch_order(
    corpus: Corpus, cfg: TrainConfig, epoch: int, dist_ctx: DistContext
) -> EpochBatches:
    """This rank's batches of `epoch`, in order; with a global batch, its `accumulation`
    slices of each global batch in turn (an empty list is a null batch, see `collate`)."""
    if cfg.global_batch_tokens <= 0:
        return token_batches(
            corpus.src_lens,
            corpus.tgt_lens,
            cfg.max_tokens,
            seed=cfg.seed,
            epoch=epoch,
            rank=dist_ctx.rank,
            world_size=dist_ctx.world_size,
        )
    world = dist_ctx.world_size
    parts = world * batch_plan(cfg, world).accumulation
    return global_batches(corpus, cfg, epoch).split(parts, dist_ctx.rank, world)


def global_batches(corpus: Corpus, cfg: TrainConfig, epoch: int) -> EpochBatches:
    """The global batches of `epoch` (train.global_batch_tokens > 0): the same list on any
    number of ranks, each the pairs of one optimizer step."""
    return token_batches(
        corpus.src_lens, corpus.tgt_lens, cfg.global_batch_tokens, seed=cfg.seed, epoch=epoch
    )


def batches_from(
    corpus: Corpus, cfg: TrainConfig, epoch: int, start: int, dist_ctx: DistContext
) -> Iterator[tuple[int, Batch]]:
    """(position, batch) of this rank from position `start` on; a position counts this
    rank's batches, or with a global batch the global batches (its `accumulation`
    micro-batches share one), so that it means the same on any number of ranks."""
    order = epoch_order(corpus, cfg, epoch, dist_ctx)
    per = batch_plan(cfg, dist_ctx.world_size).accumulation if cfg.global_batch_tokens else 1
    for i in range(start * per, len(order)):
        yield i // per, collate(corpus, order[i])
