"""Padding left out of the position-wise layers when training on the CPU."""

from __future__ import annotations

from torch import Tensor

from aiayn.config import PAD_ID


class Packing:
    """Where the real (non-pad) tokens of a right-padded (B, T) batch are: rows of its
    (B*T, ...) view.

    Every sublayer but attention itself works on each position alone (section 3.3: the
    projections, the FFN, residuals, LayerNorm, dropout), so when training on the CPU the
    model runs them on the N real rows only (N, D), and lays rows out as (B, T, .) just
    for the attention products, whose masks already keep padding out of every real
    position's result. Padding is work that would be computed and thrown away. Zeros stand
    at the padded positions left out; no real row sees them.

    The rows are the real tokens plus the first few padded positions that make their
    number a multiple of `granule`: each product shape is a oneDNN kernel compiled and
    cached once (bf16), and a count that changed with every batch would make new ones
    every step; padded positions are harmless to compute.
    """

    granule = 64

    def __init__(self, tokens: Tensor) -> None:
        self.batch, self.length = tokens.shape
        keep = tokens.flatten() != PAD_ID
        extra = -int(keep.sum()) % self.granule
        if extra:
            keep[(~keep).nonzero()[:extra]] = True
        self.rows = keep.nonzero().squeeze(1)

    @property
    def padded(self) -> bool:
        return self.rows.numel() < self.batch * self.length

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (N, C), the rows kept."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.rows)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B, T, C), zeros at the padding left out."""
        out = x.new_zeros(self.batch * self.length, x.size(-1))
        return out.index_copy_(0, self.rows, x).view(self.batch, self.length, -1)
