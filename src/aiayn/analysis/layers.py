"""The layers Table 1 compares (section 4, "Why Self-Attention"), one of each kind at one
width d, each mapping (B, n, d) -> (B, n, d) so that they stack and time alike.

- self-attention: aiayn's own `MultiHeadAttention` (section 3.2.2), unmasked, as in the
  encoder: O(n^2 d) per layer.
- recurrent: an LSTM layer, PyTorch's fused one (oneDNN / cuDNN) for timing: O(n d^2).
  Its fused kernel is one opaque op to PyTorch, so FLOPs and sequential operations are
  counted on `unrolled`, the same weights written out as n cell steps (the same outputs:
  tested).
- convolutional: a kernel-k `Conv1d`, causal (the input left-padded by k-1, as in
  ByteNet's and ConvS2S's decoders): output i sees inputs i-k+1 .. i, so a contiguous
  stack needs ceil((n-1)/(k-1)) layers to connect position 1 to position n; a dilated
  stack (dilation k^l in layer l, `dilation`) needs ceil(log_k n): the paper's O(log_k n).
- separable: the separable convolution section 4 cites (Chollet 2017): a depthwise
  kernel-k convolution then a pointwise (1x1) one, O(k n d + n d^2).
- restricted: self-attention restricted to the r positions centred on each query (r odd),
  computed over those windows only, so that its cost is O(r n d) and not a masked
  O(n^2 d); `banded_mask` is the same restriction as a mask for the dense layer (tested
  equal).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model import MultiHeadAttention

#: The layer kinds, in Table 1's order (the separable convolution after the plain one).
KINDS = ("self-attention", "recurrent", "convolutional", "separable", "restricted")


class Table1Layer(nn.Module):
    """A layer of Table 1: (B, n, d) -> (B, n, d)."""

    def unrolled(self, x: Tensor) -> Tensor:
        """The same outputs with every sequential step an op of its own, for counting
        FLOPs and dependent operations (only the recurrent layer differs from forward)."""
        return self(x)  # type: ignore[no-any-return]


class SelfAttention(Table1Layer):
    """Table 1, row 1: multi-head self-attention, h heads of d/h, no mask."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(d, h, d // h, d // h, self_attention=True)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.attn(x, mask=mask)  # type: ignore[no-any-return]


def banded_mask(n: int, r: int, device: torch.device | str = "cpu") -> Tensor:
    """(n, n), True = may attend: the r positions centred on each query (r odd)."""
    pos = torch.arange(n, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= (r - 1) // 2


class RestrictedSelfAttention(Table1Layer):
    """Table 1, row 4: self-attention over the neighbourhood of size r centred on each
    position; the keys and values of each window gathered, so that the scores are (n, r)."""

    def __init__(self, d: int, h: int, r: int) -> None:
        super().__init__()
        if r < 1 or r % 2 == 0:
            raise ValueError(f"the neighbourhood r must be odd (centred on the query), got {r}")
        self.attn = MultiHeadAttention(d, h, d // h, d // h, self_attention=True)
        self.r = r

    def forward(self, x: Tensor) -> Tensor:
        a, n, half = self.attn, x.size(1), (self.r - 1) // 2
        q, k, v = a.w_qkv(x).split([a.h * a.d_k, a.h * a.d_k, a.h * a.d_v], dim=-1)
        q, k, v = a.split_heads(q, a.d_k), a.split_heads(k, a.d_k), a.split_heads(v, a.d_v)
        # (B, H, n, K) -> each position's window of r keys: (B, H, n, K, r)
        k_win = F.pad(k, (0, 0, half, half)).unfold(2, self.r, 1)
        v_win = F.pad(v, (0, 0, half, half)).unfold(2, self.r, 1)
        scores = (q.unsqueeze(-2) @ k_win).squeeze(-2) * a.d_k**-0.5  # (B, H, n, r)
        # window slot j of query i is position i - half + j: off the ends is padding
        slot = (
            torch.arange(n, device=x.device)[:, None] - half + torch.arange(self.r, device=x.device)
        )
        scores = scores.masked_fill((slot < 0) | (slot >= n), float("-inf"))
        out = (v_win @ scores.softmax(dim=-1).unsqueeze(-1)).squeeze(-1)  # (B, H, n, Vd)
        return a.w_o(out.transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


class Recurrent(Table1Layer):
    """Table 1, row 2: one LSTM layer of width d."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lstm(x)[0]  # type: ignore[no-any-return]

    def unrolled(self, x: Tensor, cut: int | None = None) -> Tensor:
        """The LSTM as n explicit cell steps (PyTorch's gate order i, f, g, o). The input
        products of all steps are one product, as the fused kernels do: only the
        recurrence is sequential. `cut`: detach the state after that step (0-based), to
        find which steps every dependency passes through (`paths.recurrent_path_length`)."""
        m = self.lstm
        w_ih, w_hh, b_ih, b_hh = (cast(Tensor, w) for w in m.all_weights[0])
        x_gates = F.linear(x, w_ih, b_ih)  # (B, n, 4d)
        h = c = x.new_zeros(x.size(0), m.hidden_size)
        outputs = []
        for t in range(x.size(1)):
            gates = x_gates[:, t] + F.linear(h, w_hh, b_hh)
            i, f, g, o = gates.chunk(4, dim=-1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            if t == cut:
                h, c = h.detach(), c.detach()
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class Convolution(Table1Layer):
    """Table 1, row 3: a causal kernel-k convolution, d channels in and out."""

    def __init__(self, d: int, k: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, dilation=dilation)
        self.pad = (k - 1) * dilation

    def forward(self, x: Tensor) -> Tensor:
        # (B, n, d) -> (B, d, n), left-padded so that output i sees inputs up to i only
        return self.conv(F.pad(x.transpose(1, 2), (self.pad, 0))).transpose(1, 2)  # type: ignore[no-any-return]


class SeparableConvolution(Table1Layer):
    """A causal depthwise kernel-k convolution (one filter per channel) and a pointwise one."""

    def __init__(self, d: int, k: int, dilation: int = 1) -> None:
        super().__init__()
        self.depthwise = nn.Conv1d(d, d, k, dilation=dilation, groups=d)
        self.pointwise = nn.Conv1d(d, d, 1)
        self.pad = (k - 1) * dilation

    def forward(self, x: Tensor) -> Tensor:
        y = self.depthwise(F.pad(x.transpose(1, 2), (self.pad, 0)))
        return self.pointwise(y).transpose(1, 2)  # type: ignore[no-any-return]


def build(kind: str, d: int, *, h: int, k: int, r: int, dilation: int = 1) -> Table1Layer:
    """One layer of `kind` (one of KINDS) at width d, in its default (float32) dtype.

    Args:
        h: heads of the attention layers (d must divide by h). k: the convolutions'
            kernel. r: the restricted attention's neighbourhood (odd).
        dilation: the convolutions' dilation (a dilated stack uses k^l in layer l).
    """
    if kind in ("self-attention", "restricted") and d % h:
        raise ValueError(f"d={d} does not divide into h={h} heads")
    if kind == "self-attention":
        return SelfAttention(d, h)
    if kind == "restricted":
        return RestrictedSelfAttention(d, h, r)
    if kind == "recurrent":
        return Recurrent(d)
    if kind == "convolutional":
        return Convolution(d, k, dilation)
    if kind == "separable":
        return SeparableConvolution(d, k, dilation)
    raise ValueError(f"unknown layer kind {kind!r}; one of {', '.join(KINDS)}")


def forward_macs(kind: str, n: int, d: int, *, k: int, r: int) -> int:
    """Multiply-adds of the layer's matrix products and convolutions on one sequence of n,
    forward (what PyTorch's FlopCounterMode counts, at 2 FLOPs each; element-wise work,
    softmax and biases are not counted). Self-attention: Q, K, V and output projections
    4 n d^2, Q K^T n^2 d, weights x V n^2 d. Restricted: the same with r keys a query.
    LSTM: input and hidden products, 2 x d x 4d a step. Convolutions: k d^2 a position;
    separable: k d (depthwise) + d^2 (pointwise)."""
    table = {
        "self-attention": 4 * n * d * d + 2 * n * n * d,
        "restricted": 4 * n * d * d + 2 * r * n * d,
        "recurrent": 8 * n * d * d,
        "convolutional": k * n * d * d,
        "separable": k * n * d + n * d * d,
    }
    return table[kind]
