"""Tests for length-bucketed token-budget batching (section 5.1; RELIABILITY A3, D7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID
from aiayn.data.batching import Batch, Prefetch, collate, decode_batches, pad_right, token_batches
from aiayn.data.corpus import Corpus


class ListCorpus:
    def __init__(self, src: list[list[int]], tgt: list[list[int]]) -> None:
        self._src, self._tgt = src, tgt

    def src(self, i: int) -> list[int]:
        return self._src[i]

    def tgt(self, i: int) -> list[int]:
        return self._tgt[i]


def _lengths(n: int = 500, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, 60, (n,), generator=g)
    tgt = (src + torch.randint(-5, 15, (n,), generator=g)).clamp(min=0)
    return src, tgt


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_budget_respected_on_both_sides() -> None:
    """Section 5.1: each batch holds about max_tokens source AND target tokens; we bound
    n_sentences x longest (with EOS / BOS added) on each side, padding included."""
    src, tgt = _lengths()
    tgt[7] = 120  # a long target: the target side alone must limit its batch
    for max_tokens in (64, 300, 1000):
        batches = token_batches(src, tgt, max_tokens, seed=1, epoch=0)
        for b in batches:
            assert len(b) * max(int(src[i]) + 1 for i in b) <= max_tokens or len(b) == 1
            assert len(b) * max(int(tgt[i]) + 1 for i in b) <= max_tokens or len(b) == 1
    # Greedy packing is tight: merging two neighbouring sorted batches breaks the budget.
    sorted_batches = token_batches(src, tgt, 300, seed=1, epoch=0, shuffle=False)
    for a, b in zip(sorted_batches, sorted_batches[1:], strict=False):
        merged = [*a, b[0]]
        assert (
            len(merged) * max(int(src[i]) + 1 for i in merged) > 300
            or len(merged) * max(int(tgt[i]) + 1 for i in merged) > 300
        )


def test_batches_group_similar_lengths() -> None:
    """Section 5.1: "batched together by approximate sequence length": unshuffled, the
    batches follow (source length, target length) order."""
    src, tgt = _lengths()
    order = _flat(token_batches(src, tgt, 400, seed=3, epoch=0, shuffle=False))
    keys = [(int(src[i]), int(tgt[i])) for i in order]
    assert keys == sorted(keys)
    assert order == sorted(range(len(src)), key=lambda i: (int(src[i]), int(tgt[i]), i))


@pytest.mark.rows("A3", "D7")
def test_every_index_once_and_long_pairs_alone() -> None:
    """RELIABILITY A3/D7: every pair is in exactly one batch per epoch; a pair over the
    budget forms its own batch instead of being dropped."""
    src, tgt = _lengths(300)
    src[11], tgt[12] = 500, 500
    batches = token_batches(src, tgt, 200, seed=5, epoch=2)
    assert sorted(_flat(batches)) == list(range(300))
    assert [11] in batches and [12] in batches
    assert (
        token_batches(
            torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 100, seed=0, epoch=0
        )
        == []
    )


@pytest.mark.rows("A3", "D7")
def test_deterministic_per_seed_and_epoch() -> None:
    """RELIABILITY A3/D7: the order is a function of (seed, epoch) only, so a resumed run
    or another rank computes the same list; other epochs and seeds give other orders."""
    src, tgt = _lengths()
    a = token_batches(src, tgt, 300, seed=7, epoch=3)
    assert a == token_batches(src.clone(), tgt.clone(), 300, seed=7, epoch=3)
    assert a != token_batches(src, tgt, 300, seed=7, epoch=4)
    assert a != token_batches(src, tgt, 300, seed=8, epoch=3)
    # Ties are broken by the seeded permutation: batch contents also vary between epochs.
    contents = {
        frozenset(map(frozenset, token_batches(src, tgt, 300, seed=7, epoch=e))) for e in range(3)
    }
    assert len(contents) > 1


@pytest.mark.rows("D7")
def test_rank_shards_partition_the_epoch() -> None:
    """RELIABILITY D7: with W ranks each gets the same number of batches, rank r takes
    batches r, r+W, ...; together they cover every pair, padding at most W-1 repeats."""
    src, tgt = _lengths()
    full = token_batches(src, tgt, 250, seed=2, epoch=1)
    for world in (2, 3, 4):
        shards = [
            token_batches(src, tgt, 250, seed=2, epoch=1, rank=r, world_size=world)
            for r in range(world)
        ]
        assert len({len(s) for s in shards}) == 1
        for r, shard in enumerate(shards):
            assert shard[: len(full[r::world])] == full[r::world]
        pooled = [b for s in shards for b in s]
        assert sorted(set(_flat(pooled))) == list(range(len(src)))
        assert len(pooled) - len(full) == -len(full) % world < world
    with pytest.raises(ValueError, match="rank"):
        token_batches(src, tgt, 250, seed=2, epoch=1, rank=2, world_size=2)


def test_collate_places_bos_eos_and_padding() -> None:
    """Section 3.1: the decoder input is the target shifted right ([BOS] + y), the output
    is y + [EOS]; the source ends with EOS; padding is PAD_ID on the right."""
    corpus = ListCorpus(src=[[5, 6], [8], [9, 9, 9]], tgt=[[7], [9, 10, 11], [4]])
    b = collate(corpus, [0, 1])
    assert b.src.tolist() == [[5, 6, EOS_ID], [8, EOS_ID, PAD_ID]]
    assert b.tgt_in.tolist() == [[BOS_ID, 7, PAD_ID, PAD_ID], [BOS_ID, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[7, EOS_ID, PAD_ID, PAD_ID], [9, 10, 11, EOS_ID]]
    assert b.ids.tolist() == [0, 1]
    assert b.src_tokens == 5 and b.tgt_tokens == 6
    assert all(t.dtype == torch.long for t in (b.src, b.tgt_in, b.tgt_out, b.ids))
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and torch.equal(moved.tgt_out, b.tgt_out)
    assert pad_right([]).shape == (0, 0)


def test_collate_from_prepared_corpus() -> None:
    """data.Corpus plugs into token_batches and collate: the batch sizes follow the
    corpus lengths and every real token lands in the batch."""
    ids = torch.arange(4, 4 + 3 + 1 + 2, dtype=torch.int32)
    corpus = Corpus(
        {
            "src_ids": ids,
            "src_offsets": torch.tensor([0, 3, 4, 6]),
            "tgt_ids": ids.flip(0),
            "tgt_offsets": torch.tensor([0, 1, 3, 6]),
            "line_numbers": torch.tensor([1, 2, 4]),
        }
    )
    (batch,) = token_batches(corpus.src_lens, corpus.tgt_lens, 100, seed=0, epoch=0)
    b = collate(corpus, batch)
    assert b.src_tokens == int(corpus.src_lens.sum()) + 3
    assert b.tgt_tokens == int(corpus.tgt_lens.sum()) + 3


def test_decode_batches() -> None:
    """Inference batches: longest first, source budget with EOS counted, every input
    exactly once (the caller restores input order, RELIABILITY F3)."""
    lengths = [3, 10, 1, 10, 7, 40, 2]
    batches = decode_batches(lengths, 24)
    order = _flat(batches)
    assert sorted(order) == list(range(len(lengths)))
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    assert order[:3] == [5, 1, 3]  # ties keep input order
    for b in batches:
        assert len(b) * (max(lengths[i] for i in b) + 1) <= 24 or len(b) == 1
    assert [5] in batches  # 41 tokens: alone
    assert decode_batches(torch.tensor([], dtype=torch.long), 10) == []
    with pytest.raises(ValueError):
        decode_batches([1], 0)


def test_prefetch_gives_the_items_in_order_and_ends() -> None:
    items = [torch.full((3,), i) for i in range(50)]
    got = list(Prefetch(iter(items), depth=3))
    assert len(got) == 50 and all(g is x for g, x in zip(got, items, strict=True))


def test_prefetch_raises_the_producers_error_at_its_item_and_stops() -> None:
    def items():  # type: ignore[no-untyped-def]
        yield 1
        yield 2
        raise ValueError("bad line 3")

    p = Prefetch(items())
    assert next(p) == 1 and next(p) == 2
    with pytest.raises(ValueError, match="bad line 3"):
        next(p)
    with pytest.raises(StopIteration):  # and does not wait for more
        next(p)
    assert not p._thread.is_alive()


def test_prefetch_close_stops_an_endless_producer() -> None:
    import itertools

    drawn = []
    p = Prefetch((drawn.append(i) or i for i in itertools.count()), depth=2)
    assert [next(p) for _ in range(5)] == [0, 1, 2, 3, 4]
    p.close()
    assert not p._thread.is_alive()
    assert len(drawn) <= 5 + 2 + 1  # read ahead by the depth (and one in hand), no more
    with pytest.raises(StopIteration):
        next(p)


def _reference_batches(
    src: torch.Tensor, tgt: torch.Tensor, max_tokens: int, seed: int, epoch: int
) -> list[list[int]]:
    """The batching of section 5.1 one pair at a time, as aiayn did before
    `EpochBatches`: the same sort, then each pair joins the open batch while
    n x longest fits on both sides, then the same shuffle of the batches."""
    gen = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(len(src), generator=gen)
    perm = perm[torch.sort(tgt[perm], stable=True).indices]
    perm = perm[torch.sort(src[perm], stable=True).indices]
    batches: list[list[int]] = []
    current: list[int] = []
    max_s = max_t = 0
    for i in perm.tolist():
        s, t = max(max_s, int(src[i]) + 1), max(max_t, int(tgt[i]) + 1)
        if current and (len(current) + 1) * max(s, t) > max_tokens:
            batches.append(current)
            current, s, t = [], int(src[i]) + 1, int(tgt[i]) + 1
        current.append(i)
        max_s, max_t = s, t
    if current:
        batches.append(current)
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


@pytest.mark.parametrize("max_tokens", [1, 7, 64, 300, 5000, 10**6])
def test_array_batching_equals_the_pair_by_pair_greedy(max_tokens: int) -> None:
    """`token_batches` cuts the sorted order with array operations on a window ahead
    (`_cut`); it gives exactly the batches of the per-pair greedy loop, so runs made
    before it replay the same epochs. Lengths are skewed so that windows double and
    shrink, with pairs longer than the budget and an int32 corpus as a mapped one has."""
    g = torch.Generator().manual_seed(max_tokens)
    src = (torch.rand(3000, generator=g) ** 4 * 400).long()
    tgt = (src + torch.randint(-20, 60, (3000,), generator=g)).clamp(min=0)
    for lens in ((src, tgt), (src.int(), tgt.int())):
        got = token_batches(*lens, max_tokens, seed=4, epoch=1)
        assert list(got) == _reference_batches(src, tgt, max_tokens, seed=4, epoch=1)


def test_epoch_batches_hold_arrays_not_lists() -> None:
    """An epoch of a million pairs is one int32 permutation and two int64 bounds per
    batch (~4 bytes a pair), not a Python int per pair (~70 bytes with its list)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(1, 80, (1_000_000,), generator=g, dtype=torch.int32)
    tgt = (src + torch.randint(-5, 15, src.shape, generator=g, dtype=torch.int32)).clamp(min=0)
    batches = token_batches(src, tgt, 25_000, seed=1, epoch=0)
    held = sum(a.nbytes for a in (batches.order, batches.starts, batches.ends))
    assert batches.order.dtype == np.int32 and held < 4.2 * len(src)
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
