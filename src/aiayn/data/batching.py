"""Batching (section 5.1): "Sentence pairs were batched together by approximate sequence
length. Each training batch contained a set of sentence pairs containing approximately
25000 source tokens and 25000 target tokens."

A batch's cost is its padded size, so the budget is ``n_sentences * longest <= max_tokens``
on each side separately, counting the token each side gains: the source is x + [EOS]
(fairseq and tensor2tensor both end the source with EOS), the decoder input is [BOS] + y
and its output y + [EOS], both of length |y| + 1. Padding is PAD_ID on the right.

Batch order is a function of (seed, epoch) only, drawn from a torch.Generator, so every
process computes the same list and a resumed run replays the same epoch (RELIABILITY A3,
D7).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, overload

import numpy as np
import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID

logger = logging.getLogger(__name__)


class PairSource(Protocol):
    """What `collate` needs from a corpus (data.Corpus has it)."""

    def src(self, i: int) -> list[int]: ...

    def tgt(self, i: int) -> list[int]: ...


@dataclass
class Batch:
    """Padded tensors for one training step (batch-first).

    Attributes:
        src: (B, S) long, x + [EOS], right-padded with PAD_ID.
        tgt_in: (B, T) long, [BOS] + y: the decoder input, shifted right (section 3.1).
        tgt_out: (B, T) long, y + [EOS]: what each decoder position predicts.
        ids: (B,) long, the corpus index of each row.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ids: torch.Tensor

    @property
    def src_tokens(self) -> int:
        """Non-pad source tokens (EOS included)."""
        return int((self.src != PAD_ID).sum())

    @property
    def tgt_tokens(self) -> int:
        """Non-pad target tokens: the number of predictions the loss averages over."""
        return int((self.tgt_out != PAD_ID).sum())

    def drop_words(self, p: float) -> Batch:
        """Word dropout (`train.word_dropout`): each source token but EOS and each decoder
        input but BOS becomes <unk> with probability p, drawn from PyTorch's generator on
        the batch's device; what the decoder predicts (tgt_out) is left as it is."""

        def drop(x: torch.Tensor, keep: int) -> torch.Tensor:
            hit = torch.rand(x.shape, device=x.device) < p
            return torch.where(hit & (x != PAD_ID) & (x != keep), UNK_ID, x)

        return Batch(drop(self.src, EOS_ID), drop(self.tgt_in, BOS_ID), self.tgt_out, self.ids)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on `device`; `non_blocking` overlaps the copy from pinned memory with
        the GPU's work."""
        return Batch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.src, self.tgt_in, self.tgt_out, self.ids)
            )
        )

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory, from which a GPU copies asynchronously."""
        return Batch(*(t.pin_memory() for t in (self.src, self.tgt_in, self.tgt_out, self.ids)))


def pad_right(seqs: list[list[int]], pad_id: int = PAD_ID) -> torch.Tensor:
    """Stack sequences into a (B, max_len) long tensor, padded on the right."""
    width = max((len(s) for s in seqs), default=0)
    # One tensor from padded lists: a copy per row costs a training step far more
    # (measured: docs/performance.md).
    return torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long).view(
        len(seqs), width
    )


def collate(corpus: PairSource, indices: list[int]) -> Batch:
    """Build the padded batch of the given corpus pairs, in the given order.

    No indices give the null batch: a source of one EOS, a decoder input of one BOS and a
    target of one PAD, with no ids. Its loss and gradient are exactly zero (padding is
    never predicted) and it counts no target tokens, yet a forward and backward pass over
    it lets a rank whose slice of a global batch is empty take part in the step's
    gradient all-reduce (`split_global_batch`).
    """
    if not indices:
        one = torch.ones(1, 1, dtype=torch.long)
        return Batch(EOS_ID * one, BOS_ID * one, PAD_ID * one, torch.zeros(0, dtype=torch.long))
    src = [corpus.src(i) + [EOS_ID] for i in indices]
    tgt = [corpus.tgt(i) for i in indices]
    return Batch(
        src=pad_right(src),
        tgt_in=pad_right([[BOS_ID, *y] for y in tgt]),
        tgt_out=pad_right([[*y, EOS_ID] for y in tgt]),
        ids=torch.tensor(indices, dtype=torch.long),
    )


def _cut(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where the batches of a length-sorted order start: greedily, each batch as long as
    n x (longest source) and n x (longest target) stay within the budget (lengths as
    padded: + EOS, + BOS; products in int64).

    A pair that alone exceeds the budget becomes a batch by itself rather than being
    dropped: losing data silently is worse than one large batch.

    n x (running maximum) only grows with n, so the pairs a batch may take are a prefix of
    what follows it: each batch is found with a few array operations on a window ahead
    (doubled until the budget is exceeded inside it), not a Python step per pair.
    """
    n = len(src_len)
    starts: list[int] = []
    a, window = 0, 64
    while a < n:
        while True:
            b = min(n, a + window)
            count = np.arange(1, b - a + 1)
            fits = (count * np.maximum.accumulate(src_len[a:b]) <= max_tokens) & (
                count * np.maximum.accumulate(tgt_len[a:b]) <= max_tokens
            )
            size = int(fits.argmin()) if not fits.all() else b - a
            if size < b - a or b == n:
                break
            window *= 2
        size = max(size, 1)
        starts.append(a)
        a += size
        window = 2 * size + 16  # the next batch is about as long: lengths change slowly
    return np.asarray(starts, dtype=np.int64)


class EpochBatches(Sequence[list[int]]):
    """An epoch's batches as slices of one permutation of the corpus.

    Why not a list of lists: a Python int per pair, with its list slot and the lengths it
    was cut from, cost 2.4 GB at the peak, 1.3 GB held all epoch on every rank and a minute
    of Python at WMT14 En-Fr's 36M pairs (docs/performance.md). Here a pair costs 4 bytes
    (its place in `order`) and a batch two int64 bounds; `batches[i]` makes the one list of
    indices a step needs.

    Attributes:
        order: (n,) corpus indices, sorted by length (a batch is a contiguous run of it).
        starts, ends: (batches,) each batch's slice of `order`, in the epoch's order; an
            empty slice is a null batch (see `collate`).
    """

    __slots__ = ("order", "starts", "ends")

    def __init__(self, order: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.order, self.starts, self.ends = order, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> list[int]: ...

    @overload
    def __getitem__(self, i: slice) -> EpochBatches: ...

    def __getitem__(self, i: int | slice) -> list[int] | EpochBatches:
        if isinstance(i, slice):
            return EpochBatches(self.order, self.starts[i], self.ends[i])
        return self.order[self.starts[i] : self.ends[i]].tolist()  # type: ignore[no-any-return]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        if len(self) != len(other):
            return False
        return all(a == list(b) for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EpochBatches({len(self)} batches of {len(self.order)} pairs)"

    def sizes(self) -> np.ndarray:
        """(batches,) the number of pairs in each batch."""
        return self.ends - self.starts

    def shard(self, rank: int, world_size: int) -> EpochBatches:
        """Give each rank an equal number of batches: rank r takes batches r, r+W, r+2W, ...

        Equal counts keep the ranks' collectives in step. We pad rather than drop (like
        torch's DistributedSampler with drop_last=False): the first batches of the
        shuffled epoch are repeated, so every pair is seen at least once and at most
        `world_size - 1` batches are seen twice per epoch; the number is logged.
        """
        if world_size == 1:
            return self
        n = len(self)
        extra = -n % world_size
        if extra:
            logger.info(
                "padding %d batches with %d repeated ones so %d ranks get equal shares",
                n,
                extra,
                world_size,
            )
        pick = np.concatenate([np.arange(n), np.arange(extra) % max(n, 1)])[rank::world_size]
        return EpochBatches(self.order, self.starts[pick], self.ends[pick])

    def split(self, parts: int, rank: int = 0, world_size: int = 1) -> EpochBatches:
        """Cut every batch (a global batch, `train.global_batch_tokens`) into `parts` =
        ranks x accumulation slices, and keep rank `rank`'s: slices r, r + W, r + 2W, ...
        of each batch in turn. The slices are contiguous runs of the batch's length-sorted
        pairs, their sizes differing by at most one, the larger first; with fewer pairs
        than parts the last slices are empty (each a null batch for `collate`), so every
        rank gets a pair before any gets a second.

        Contiguous runs of a length-sorted batch keep each slice's padding as low as the
        whole batch's, so each slice costs about global / parts padded tokens.
        """
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        size, extra = np.divmod(self.sizes(), parts)
        j = np.arange(parts)
        # slice j of a batch: size + 1 pairs for j < extra, size after; starts are sums
        lengths = size[:, None] + (j[None, :] < extra[:, None])
        ends = self.starts[:, None] + np.cumsum(lengths, axis=1)
        starts = ends - lengths
        keep = j[rank::world_size]
        return EpochBatches(self.order, starts[:, keep].ravel(), ends[:, keep].ravel())

    def shapes(self, src_lens: torch.Tensor, tgt_lens: torch.Tensor) -> np.ndarray:
        """(batches, 3): pairs, longest source + EOS and longest target + BOS of each
        batch, as `collate` pads it (an empty batch measures 0)."""
        out = np.zeros((len(self), 3), dtype=np.int64)
        out[:, 0] = self.sizes()
        full = np.flatnonzero(out[:, 0])
        if len(full):
            for col, lens in ((1, src_lens), (2, tgt_lens)):
                ordered = lens.numpy()[self.order] + 1
                bounds = zip(self.starts[full], self.ends[full], strict=True)
                out[full, col] = [ordered[s:e].max() for s, e in bounds]
        return out


def split_global_batch(indices: list[int], parts: int) -> list[list[int]]:
    """Cut one global batch into `parts` slices, as `EpochBatches.split` does."""
    one = EpochBatches(np.asarray(indices, dtype=np.int64), np.array([0]), np.array([len(indices)]))
    return list(one.split(parts))


def token_batches(
    src_lens: torch.Tensor,
    tgt_lens: torch.Tensor,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> EpochBatches:
    """Length-bucketed batches of corpus indices for one epoch (section 5.1).

    Pairs are sorted by (source length, target length); ties are broken by a permutation
    seeded with seed + epoch, so batch contents vary between epochs without losing the
    bucketing. The batch order is then shuffled with the same generator.

    Args:
        src_lens, tgt_lens: (n,) lengths in subwords without BOS/EOS (data.Corpus).
        max_tokens: budget per batch and per side, padding included.
        seed, epoch: the only inputs to randomness; equal on every rank.
        shuffle: False gives sorted order with index tie-breaks (validation).
        rank, world_size: this process's shard; see `EpochBatches.shard`.

    Returns:
        This rank's batches, each (`batches[i]`) a list of corpus indices.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world {world_size}")
    if src_lens.shape != tgt_lens.shape or src_lens.dim() != 1:
        raise ValueError(
            f"length shapes differ: {tuple(src_lens.shape)} vs {tuple(tgt_lens.shape)}"
        )
    n = src_lens.numel()
    gen = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
    order = perm.numpy().astype(np.int32 if n < 2**31 else np.int64)
    del perm
    # Sorted by (source length, target length), ties in the permutation's order: one
    # stable sort on a combined key (the same order as two stable sorts, least
    # significant first, with half the memory: ~20 bytes a pair at the peak).
    src, tgt = src_lens.numpy(), tgt_lens.numpy()
    width = int(tgt.max()) + 1 if n else 1
    key_type = np.int32 if (int(src.max()) + 1 if n else 1) * width < 2**31 else np.int64
    key = src[order].astype(key_type) * width + tgt[order]
    order = order[np.argsort(key, kind="stable")]
    del key
    src_len = src[order] + 1  # + EOS
    tgt_len = tgt[order] + 1  # + BOS (tgt_in) or EOS (tgt_out)
    starts = _cut(src_len, tgt_len, max_tokens)
    del src_len, tgt_len
    ends = np.append(starts[1:], n) if len(starts) else starts.copy()
    if shuffle:
        shuffled = torch.randperm(len(starts), generator=gen).numpy()
        starts, ends = starts[shuffled], ends[shuffled]
    return EpochBatches(order, starts, ends).shard(rank, world_size)


def decode_batches(lengths: list[int] | torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Batches of input indices for translation, longest first, within a source budget.

    Sorting by length keeps padding low; longest first makes an out-of-memory error
    happen at the start.

    Args:
        lengths: (n,) source lengths in subwords WITHOUT the EOS; one is added here.
        max_tokens: bound on n_sentences x (longest + 1) per batch; a longer input is
            a batch of its own.

    Returns:
        Lists of input indices; the caller restores input order from them.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lens = [int(x) + 1 for x in lengths]  # + EOS
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Descending order: the batch's first (longest) item fixes its padded width.
        if batches and (len(batches[-1]) + 1) * lens[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


T = TypeVar("T")


class Prefetch(Generic[T]):
    """Draws the next items of an iterator on a background thread, `depth` ahead.

    Why: on a GPU the training step waits for the GPU's result (the loss, the gradient
    norm) before the next step's batch is built, and building one of the paper's
    ~25,000-token batches is milliseconds of Python (`collate`), during which the GPU
    idles (measured: docs/performance.md). Here the next batches are built while the main
    thread waits on the GPU, whose waits release the GIL. The items and their order are
    the iterator's own: only the time they are made changes. Exceptions reach the consumer
    at the item that raised. `close()` stops the thread (a rollback starts a new stream).
    """

    _END = object()

    def __init__(self, items: Iterator[T], depth: int = 2) -> None:
        self._items = items
        self._queue: queue.Queue[tuple[object, BaseException | None]] = queue.Queue(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="aiayn-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put((item, None)):
                    return
            self._put((self._END, None))
        except BaseException as e:  # handed to the consumer, raised there
            self._put((self._END, e))

    def _put(self, entry: tuple[object, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetch[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        if item is self._END:
            self.close()
            raise StopIteration
        return item  # type: ignore[return-value]

    def close(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join()
