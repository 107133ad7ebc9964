"""BPE-dropout (Provilkov et al., 2020; beyond the paper): each epoch re-segments the
training text with the vocabulary's own merges, each merge step leaving each possible merge
out with probability p, drawn from (seed, epoch) alone so that a resumed run repeats it."""

from __future__ import annotations

import logging
from array import array

import torch

from aiayn import speed
from aiayn.config import ConfigError
from aiayn.data.corpus import Corpus
from aiayn.data.tokenizer import Tokenizer, Vocabulary

logger = logging.getLogger(__name__)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _bpe_dropout_words(
    sym: torch.Tensor,
    off: torch.Tensor,
    merges: dict[tuple[int, int], tuple[int, float]],
    seed: int,
    threshold: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/bpe_dropout.c in Python, draw for draw (see there): the fallback without a
    compiler, and the second implementation the tests hold the C code to."""
    flat, starts = sym.tolist(), off.tolist()
    out = list(flat)
    count = []
    for w in range(len(starts) - 1):
        s = flat[starts[w] : starts[w + 1]]
        stream, j = _splitmix64(seed + w * _GOLDEN), 0
        while True:
            best, best_merge = -1, (0, 0.0)
            for i in range(len(s) - 1):
                m = merges.get((s[i], s[i + 1]))
                if m is None:
                    continue
                if threshold > 0:
                    j += 1
                    if _splitmix64(stream + j * _GOLDEN) >> 11 < threshold:
                        continue
                if best < 0 or m[1] > best_merge[1]:
                    best, best_merge = i, m
            if best < 0:
                break
            s[best : best + 2] = [best_merge[0]]
        out[starts[w] : starts[w] + len(s)] = s
        count.append(len(s))
    return torch.tensor(out, dtype=torch.int32), torch.tensor(count, dtype=torch.int64)


class BPEDropout:
    """Training pairs under BPE-dropout (Provilkov et al., 2020): every epoch a fresh
    segmentation of each sentence, each possible BPE merge left out of each merge step
    with probability p (the paper's Algorithm 1; csrc/bpe_dropout.c).

    A departure from the paper (which segments once), for small corpora such as Multi30k:
    the same word seen under several segmentations teaches the model how its pieces
    compose. The draws depend on (seed, word) alone (csrc/bpe_dropout.c), so reruns and
    resumed runs see the same epochs. Each word of the prepared pairs is re-merged from its
    characters with the vocabulary's own merges (`Tokenizer.bpe_merges`); at p = 0 that
    gives back the prepared ids, which the constructor checks: a pair for which it does not
    (e.g. it holds <unk>), or whose new segmentation of a side is longer than `max_len`,
    keeps its prepared segmentation in that epoch.
    """

    def __init__(self, corpus: Corpus, tok: Vocabulary, p: float, max_len: int) -> None:
        if not 0.0 < p < 1.0:
            raise ValueError(f"BPE-dropout p must be in (0, 1), got {p}")
        if not isinstance(tok, Tokenizer):  # one merge table re-segments both sides
            raise ConfigError(
                "train.bpe_dropout needs a shared vocabulary; this data was prepared with "
                "--vocab separate"
            )
        self.p, self.max_len, self.n = p, max_len, len(corpus)
        self._line_numbers = corpus.line_numbers
        self._merges = tok.bpe_merges()
        order = sorted(self._merges)
        v = tok.vocab_size
        self._v = v
        self._keys = torch.tensor([a * v + b for a, b in order], dtype=torch.int64)
        self._merged = torch.tensor([self._merges[k][0] for k in order], dtype=torch.int32)
        self._score = torch.tensor([self._merges[k][1] for k in order], dtype=torch.float64)
        pieces = tok.pieces()
        text = [tok.id_to_piece(i) for i in range(v)]
        # every pair's both sides as one list of sentences: sources, then targets
        self._prepared = torch.cat([corpus._src_ids, corpus._tgt_ids])
        self._prepared_off = torch.cat(
            [corpus._src_off, corpus._tgt_off[1:] + corpus._src_ids.numel()]
        )
        starts: dict[tuple[int, ...], list[int]] = {}
        sym, word_off, sent_words = array("i"), array("q", [0]), array("q", [0])
        prepared, off = self._prepared.tolist(), self._prepared_off.tolist()
        for s in range(2 * self.n):
            ids = prepared[off[s] : off[s + 1]]
            cut = [0] + [k for k in range(1, len(ids)) if text[ids[k]].startswith("\u2581")]
            for a, b in zip(cut, cut[1:] + [len(ids)], strict=True):
                word = tuple(ids[a:b])
                start = starts.get(word)
                if start is None:
                    chars = "".join(text[i] for i in word)
                    start = (
                        [pieces[c] for c in chars]
                        if all(c in pieces for c in chars)
                        else list(word)
                    )
                    starts[word] = start
                sym.extend(start)
                word_off.append(len(sym))
            sent_words.append(len(word_off) - 1)
        self._sym = torch.frombuffer(sym, dtype=torch.int32).clone()
        self._word_off = torch.frombuffer(word_off, dtype=torch.int64).clone()
        self._sent_words = torch.frombuffer(sent_words, dtype=torch.int64).clone()
        flat, sent_off = self._segment(seed=0, threshold=0)
        if torch.equal(sent_off, self._prepared_off):
            # one comparison of everything; a differing id marks its sentence
            wrong = torch.nonzero(flat != self._prepared).flatten()
            same = torch.ones(2 * self.n, dtype=torch.bool)
            same[torch.searchsorted(sent_off, wrong, right=True) - 1] = False
        else:
            same = torch.tensor(
                [
                    torch.equal(
                        flat[sent_off[s] : sent_off[s + 1]], self._prepared[off[s] : off[s + 1]]
                    )
                    for s in range(2 * self.n)
                ]
            )
        self._fixed = ~(same[: self.n] & same[self.n :])
        if bool(self._fixed.any()):
            logger.warning(
                "BPE-dropout: %d of %d training pairs are not rebuilt by the "
                "vocabulary's merges and keep their prepared segmentation",
                int(self._fixed.sum()),
                self.n,
            )

    def _segment(self, seed: int, threshold: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sentence's new ids, concatenated, and their offsets."""
        kernel = speed.IMPLEMENTATIONS.get("bpe_dropout")  # compiled, with the speed paths
        done = (
            kernel(
                self._sym,
                self._word_off,
                self._keys,
                self._merged,
                self._score,
                self._v,
                seed,
                threshold,
            )
            if kernel is not None
            else None
        )
        if done is None:
            done = _bpe_dropout_words(self._sym, self._word_off, self._merges, seed, threshold)
        out, count = done
        word_len = self._word_off[1:] - self._word_off[:-1]
        pos = torch.arange(out.numel()) - torch.repeat_interleave(self._word_off[:-1], word_len)
        flat = out[pos < torch.repeat_interleave(count, word_len)]
        words_end = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(count, 0)])
        return flat, words_end[self._sent_words]

    def epoch(self, seed: int) -> Corpus:
        """The training pairs of one epoch; `seed` should depend on the run's seed and the
        epoch number."""
        flat, sent_off = self._segment(seed, round(self.p * 2**53))
        lens = sent_off[1:] - sent_off[:-1]
        n = self.n
        keep = self._fixed | (lens[:n] > self.max_len) | (lens[n:] > self.max_len)
        keep2 = torch.cat([keep, keep])
        prep_lens = self._prepared_off[1:] - self._prepared_off[:-1]
        new_lens = torch.where(keep2, prep_lens, lens)
        src = torch.where(keep2, self._prepared_off[:-1] + flat.numel(), sent_off[:-1])
        new_off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(new_lens, 0)])
        pos = torch.arange(int(new_off[-1])) - torch.repeat_interleave(new_off[:-1], new_lens)
        ids = torch.cat([flat, self._prepared])[torch.repeat_interleave(src, new_lens) + pos]
        n_src = int(new_off[n])
        return Corpus(
            {
                "src_ids": ids[:n_src].clone(),
                "src_offsets": new_off[: n + 1].clone(),
                "tgt_ids": ids[n_src:].clone(),
                "tgt_offsets": new_off[n:] - n_src,
                "line_numbers": self._line_numbers,
            },
            name=f"BPE-dropout p={self.p}",
        )
