"""WMT-like synthetic parallel text, generated on the fly, for scale tests of `prepare`.

The point is to exercise the real costs of a WMT14-sized corpus without the corpus: the
number of lines, their lengths and the variety of words that the subword learner and the
encoder see. So the generator draws:

- sentence lengths from a log-normal with a mean of ~25 words and a long tail (about
  0.5% of the sentences over 100 words), like WMT14 En-De's training text;
- words from a Zipfian distribution (Zipf-Mandelbrot, exponent ~1.1) over `vocab` word
  types (50,000 by default) spelled from syllables, frequent words short and rare words
  long, so sentencepiece has a realistic vocabulary to learn;
- a target that is a noisy word-by-word translation of the source (another spelling of
  the same word rank, ~5% of words dropped, ~10% followed by an inserted function word),
  so the two sides' lengths are correlated as in real parallel text.

Generation is vectorized per block (numpy draws every length and word of a block at once);
what remains in Python is one join per sentence. Everything is a function of the seed.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

import numpy as np

#: Log-normal sentence lengths: mean exp(mu + sigma^2 / 2) ~ 25 words.
LENGTH_SIGMA = 0.6
LENGTH_MU = float(np.log(25.0) - LENGTH_SIGMA**2 / 2)
MAX_WORDS = 300

_SRC_SYLLABLES = [c + v for c in "bdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou")]
_TGT_SYLLABLES = [
    c + v
    for c in ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "w", "sch", "ch")
    for v in ("a", "e", "i", "o", "u", "ei")
]


def _spell(rng: np.random.Generator, n: int, syllables: list[str]) -> list[str]:
    """`n` distinct words; word rank r gets ~1 + log10(r + 1) syllables (frequent = short)."""
    words: list[str] = []
    seen: set[str] = set()
    rank = 0
    while len(words) < n:
        k = 1 + int(np.log10(rank + 1) * 0.8) + int(rng.integers(0, 2))
        word = "".join(syllables[int(j)] for j in rng.integers(0, len(syllables), size=k))
        rank += 1
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


class SyntheticPairs:
    """A seeded source of WMT-like (source, target) sentence pairs.

    Args:
        seed: every draw depends on it alone.
        vocab: word types per language.
        zipf_s: Zipf exponent of the word frequencies.
    """

    def __init__(self, seed: int = 0, vocab: int = 50_000, zipf_s: float = 1.1) -> None:
        self.rng = np.random.default_rng(seed)
        punct = [",", ".", "the", "of", "and"]  # the most frequent "words" of any corpus
        self.src_words = np.array(punct + _spell(self.rng, vocab - 5, _SRC_SYLLABLES), dtype=object)
        tgt_punct = [",", ".", "die", "der", "und"]
        self.tgt_words = np.array(
            tgt_punct + _spell(self.rng, vocab - 5, _TGT_SYLLABLES), dtype=object
        )
        weights = 1.0 / (np.arange(vocab) + 2.7) ** zipf_s
        self.cdf = np.cumsum(weights / weights.sum())
        self.vocab = vocab

    def block(self, n: int) -> tuple[list[str], list[str]]:
        """`n` pairs: (source lines, target lines), without newlines."""
        rng = self.rng
        lens = np.clip(
            np.rint(rng.lognormal(LENGTH_MU, LENGTH_SIGMA, size=n)), 1, MAX_WORDS
        ).astype(np.int64)
        total = int(lens.sum())
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(total)), self.vocab - 1)
        src_tok = self.src_words[ranks].tolist()
        # Target: each source word kept (95%) and, after 10% of the kept ones, a function
        # word (ranks 2..19): np.repeat expands each position to 0, 1 or 2 tokens.
        keep = rng.random(total) >= 0.05
        insert = keep & (rng.random(total) < 0.10)
        count = keep.astype(np.int64) + insert
        sent = np.repeat(np.arange(n), lens)
        first = np.r_[0, np.cumsum(lens)[:-1]]
        count[first] = np.maximum(count[first], 1)  # every target keeps its first word
        tgt_ranks = np.repeat(ranks, count)
        second = np.cumsum(count) - 1  # last slot of each expanded position
        fillers = rng.integers(2, 20, size=total)
        tgt_ranks[second[count == 2]] = fillers[count == 2]
        tgt_tok = self.tgt_words[tgt_ranks].tolist()
        tgt_lens = np.bincount(sent, weights=count, minlength=n).astype(np.int64)
        src_out, tgt_out = [], []
        a = b = 0
        for ls, lt in zip(lens.tolist(), tgt_lens.tolist(), strict=True):
            src_out.append(" ".join(src_tok[a : a + ls]))
            tgt_out.append(" ".join(tgt_tok[b : b + lt]))
            a += ls
            b += lt
        return src_out, tgt_out

    def blocks(self, n: int, block: int = 100_000) -> Iterator[tuple[list[str], list[str]]]:
        """`n` pairs in blocks of at most `block`."""
        done = 0
        while done < n:
            k = min(block, n - done)
            yield self.block(k)
            done += k


def _open_out(path: Path, gz: bool) -> IO[bytes]:
    if gz:
        # level 1: ~5x faster to write than the default 9, ~20% larger; reading costs the same
        return cast(IO[bytes], gzip.open(path, "wb", compresslevel=1))
    return open(path, "wb")  # noqa: SIM115 - closed by the caller


def write_corpus(
    prefix: str | Path,
    n: int,
    *,
    source_lang: str = "en",
    target_lang: str = "de",
    seed: int = 0,
    gz: bool = True,
    vocab: int = 50_000,
    progress: bool = False,
) -> tuple[Path, Path]:
    """Write `n` synthetic pairs to PREFIX.SRC[.gz] and PREFIX.TGT[.gz]; return both paths.

    Memory is one block (100,000 pairs), whatever `n`.
    """
    suffix = ".gz" if gz else ""
    paths = (Path(f"{prefix}.{source_lang}{suffix}"), Path(f"{prefix}.{target_lang}{suffix}"))
    gen = SyntheticPairs(seed, vocab=vocab)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="pairs", desc="generating", mininterval=5)
    with _open_out(paths[0], gz) as fs, _open_out(paths[1], gz) as ft:
        for src, tgt in gen.blocks(n):
            fs.write(("\n".join(src) + "\n").encode("utf-8"))
            ft.write(("\n".join(tgt) + "\n").encode("utf-8"))
            if bar is not None:
                bar.update(len(src))
    if bar is not None:
        bar.close()
    return paths
