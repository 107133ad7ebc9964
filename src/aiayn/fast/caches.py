"""Decoding steps on the CPU in compiled C (`aiayn.fast.native`): the self-attention cache
that a beam reordering never copies, and when the compiled attention applies."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.fast import native


def compiled_decoding(x: Tensor, h: int, d_k: int, d_v: int) -> bool:
    """Whether a decoding step on `x` attends with the compiled kernels (`native`): on the
    CPU, without gradients (they have no backward), for float32 and bf16."""
    return (
        x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and native.attention_applies(x.dtype, h, d_k, d_v)
    )


class PathKVCache:
    """Self-attention keys and values for the compiled decoding step
    (`native.cached_attention`): each step's fused projection output (B, H*(2K+Vd)) stays
    where it was written, and `path` (B, steps) says which row of each step's table holds
    a hypothesis's key and value. A beam reordering permutes `path`, 8 bytes a row and
    step, where `KVCache` copies the whole cache.
    """

    def __init__(self, h: int, d_k: int, d_v: int, capacity: int = 64) -> None:
        self.h, self.d_k, self.d_v = h, d_k, d_v
        self.tables: list[Tensor] = []  # step i's projection output, (B_i, H*(2K+Vd))
        self.addresses = torch.empty(max(1, capacity), dtype=torch.int64)  # of the tables
        self.path: Tensor | None = None  # (B, capacity) int64
        self._index: Tensor | None = None  # rows to keep, not yet applied

    @property
    def length(self) -> int:
        return len(self.tables)

    def add(self, rows: Tensor) -> None:
        """The newest position: row i of `rows` belongs to hypothesis row i."""
        t, b = len(self.tables), rows.size(0)
        if rows.stride(1) != 1 or rows.size(1) != self.h * (2 * self.d_k + self.d_v):
            raise ValueError(f"expected rows of the fused projection, got {tuple(rows.shape)}")
        if t == self.addresses.numel():  # more steps than planned: twice the room
            self.addresses = torch.cat([self.addresses, torch.empty_like(self.addresses)])
            if self.path is not None:
                self.path = torch.cat([self.path, torch.empty_like(self.path)], dim=1)
        if self.path is None:
            self.path = torch.empty(b, self.addresses.numel(), dtype=torch.int64)
        elif self._index is not None:
            self.path = self.path.index_select(0, self._index)
        if self.path.size(0) != b:
            raise ValueError(f"{b} new rows for a cache of {self.path.size(0)}")
        self.path[:, t] = torch.arange(b)
        self.tables.append(rows)
        self.addresses[t] = rows.data_ptr()
        self._index = None

    def attend(self, q: Tensor) -> Tensor:
        """Eq. 1 for the newest query of each row, q (B, H*K), over all its positions:
        (B, H*Vd)."""
        hk = self.h * self.d_k
        return native.cached_attention(
            q,
            self.addresses[: self.length],
            self.tables[-1].stride(0),
            hk,
            2 * hk,
            self.path,  # type: ignore[arg-type]
            self.h,
            self.d_k,
            self.d_v,
        )

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """The cached keys and values as `KVCache` holds them, (B, H, t, K) and
        (B, H, t, Vd), for PyTorch ops (a picture of the attention weights)."""
        assert self.path is not None
        hk = self.h * self.d_k
        rows = torch.stack(
            [table.index_select(0, self.path[:, i]) for i, table in enumerate(self.tables)], dim=1
        )  # (B, t, .)
        k = rows[..., hk : 2 * hk].unflatten(-1, (self.h, self.d_k)).transpose(1, 2)
        v = rows[..., 2 * hk :].unflatten(-1, (self.h, self.d_v)).transpose(1, 2)
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Keep the rows `index` (beam search reordering); applied at the next `add`."""
        self._index = index if self._index is None else self._index.index_select(0, index)
