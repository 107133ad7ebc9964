"""Which batches an epoch holds, in which order, on which rank: from (seed, epoch) alone, so
a resumed run sees the same batches as an uninterrupted one."""

from __future__ import annotations

from collections.abc import Iterator

from aiayn.config import TrainConfig
from aiayn.data.batching import Batch, collate, token_batches
from aiayn.data.corpus import Corpus
from aiayn.training.distributed import DistContext


def epoch_order(
    corpus: Corpus, cfg: TrainConfig, epoch: int, dist_ctx: DistContext
) -> list[list[int]]:
    return token_batches(
        corpus.src_lens,
        corpus.tgt_lens,
        cfg.max_tokens,
        seed=cfg.seed,
        epoch=epoch,
        rank=dist_ctx.rank,
        world_size=dist_ctx.world_size,
    )


def batches_from(
    corpus: Corpus, cfg: TrainConfig, epoch: int, start: int, dist_ctx: DistContext
) -> Iterator[tuple[int, Batch]]:
    order = epoch_order(corpus, cfg, epoch, dist_ctx)
    for i in range(start, len(order)):
        yield i, collate(corpus, order[i])
