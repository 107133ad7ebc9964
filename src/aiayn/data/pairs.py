"""A prepared split in memory: every pair's subword ids as flat id tensors and offsets.

Its own module, so that both ways of reading a split back (`corpus.load_corpus`: a whole
`train.pt`; `mmap_corpus.MmapCorpus`: memory-mapped arrays) build on it without importing
each other.
"""

from __future__ import annotations

import torch

from aiayn.files import InputError


class Corpus:
    """One prepared split: pair i is (src(i), tgt(i)), subword ids without BOS or EOS.

    Attributes:
        src_lens, tgt_lens: int64 (n,) lengths in subwords, without BOS/EOS.
        line_numbers: int64 (n,) the pair's 1-based line in the raw input files.
    """

    def __init__(self, data: dict[str, torch.Tensor], name: str = "<corpus>") -> None:
        n = data["line_numbers"].numel()
        for side in ("src", "tgt"):
            ids, off = data[f"{side}_ids"], data[f"{side}_offsets"]
            if (
                ids.dtype != torch.int32
                or off.dtype != torch.int64
                or off.numel() != n + 1
                or int(off[0]) != 0
                or int(off[-1]) != ids.numel()
                or bool((off[1:] < off[:-1]).any())
            ):
                raise InputError(f"{name}: inconsistent {side} ids/offsets; re-run prepare")
        self._src_ids, self._src_off = data["src_ids"], data["src_offsets"]
        self._tgt_ids, self._tgt_off = data["tgt_ids"], data["tgt_offsets"]
        self.line_numbers = data["line_numbers"]
        self.src_lens = self._src_off[1:] - self._src_off[:-1]
        self.tgt_lens = self._tgt_off[1:] - self._tgt_off[:-1]

    def __len__(self) -> int:
        return int(self.line_numbers.numel())

    def src(self, i: int) -> list[int]:
        return self._src_ids[self._src_off[i] : self._src_off[i + 1]].tolist()

    def tgt(self, i: int) -> list[int]:
        return self._tgt_ids[self._tgt_off[i] : self._tgt_off[i + 1]].tolist()

    def both_directions(self) -> Corpus:
        """Every pair twice, as (src, tgt) and then as (tgt, src): bidirectional training's
        data (Ding et al., 2021). Needs one vocabulary for both languages, as
        `prepare` builds; pair n + i is pair i reversed, with its line number."""

        def joined(first: str, second: str) -> tuple[torch.Tensor, torch.Tensor]:
            ids_a, off_a = getattr(self, f"_{first}_ids"), getattr(self, f"_{first}_off")
            ids_b, off_b = getattr(self, f"_{second}_ids"), getattr(self, f"_{second}_off")
            return torch.cat([ids_a, ids_b]), torch.cat([off_a, off_b[1:] + ids_a.numel()])

        src_ids, src_off = joined("src", "tgt")
        tgt_ids, tgt_off = joined("tgt", "src")
        return Corpus(
            {
                "src_ids": src_ids,
                "src_offsets": src_off,
                "tgt_ids": tgt_ids,
                "tgt_offsets": tgt_off,
                "line_numbers": torch.cat([self.line_numbers, self.line_numbers]),
            },
            name="<both directions>",
        )
