"""The Transformer (section 3 of "Attention Is All You Need"), in the paper's order and
names, and nothing else: read it next to the paper.

Shape letters used in comments:
    B batch, S source length, T target length, D d_model, H heads (h),
    K d_k, Vd d_v, F d_ff, V vocabulary size.

Mask convention (one, everywhere): boolean tensors, True = "may attend".
Everything is batch-first. Token id 0 is padding (config.PAD_ID).

The speed paths (padding left out of the position-wise layers, compiled CPU kernels,
fused attention, int8/bf16 inference layers) live in `aiayn.fast`, above this module: they
subclass these modules with the same parameters and are swapped in from outside, through
the one seam `aiayn.speed`. This model runs, trains and decodes without them. So do
pictures of the attention: `aiayn.analysis.attention` observes these modules with
forward hooks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import PAD_ID, ModelConfig


# --------------------------------------------------------------------------- 3.2.1
def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    dropout_p: float = 0.0,
) -> Tensor:
    """Eq. 1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, written out.

    Args:
        q: (B, H, Tq, K) queries. k: (B, H, Tk, K) keys. v: (B, H, Tk, Vd) values.
        mask: boolean, broadcastable to (B, H, Tq, Tk), True = may attend. Illegal
            connections get -inf before the softmax (section 3.2.3).
        causal: also forbid attending to later positions (decoder self-attention); the
            queries are the last Tq of the Tk positions.
        dropout_p: dropout on the attention weights (0 in the paper).
    Returns:
        (B, H, Tq, Vd).
    """
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.size(-1) ** -0.5)  # (B, H, Tq, Tk)
    if causal:
        scores.masked_fill_(~causal_mask(q.size(2), k.size(2), q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


def causal_mask(tq: int, tk: int, device: torch.device) -> Tensor:
    """(Tq, Tk), True = may attend: query i (the last of Tk keys aligned) sees keys <= i."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=tk - tq)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """The softmax of Eq. 1 itself, for analysis and pictures: (B, H, Tq, Tk), True in
    `mask` = may attend."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


# --------------------------------------------------------------------------- 3.2.2
class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O (section 3.2.2),
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections are stored as one matrix each (W^Q: D x h*K, ...); for
    self-attention Q, K and V come from one fused matrix, which is the same parameters laid
    side by side and one matrix product instead of three. No biases: the paper's formula has
    none (tensor2tensor agrees).
    """

    def __init__(
        self,
        d_model: int,
        h: int,
        d_k: int,
        d_v: int,
        *,
        self_attention: bool,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.h, self.d_k, self.d_v, self.dropout = h, d_k, d_v, dropout
        self.self_attention = self_attention
        if self_attention:
            self.w_qkv = nn.Linear(d_model, h * (2 * d_k + d_v), bias=False)
        else:
            self.w_q = nn.Linear(d_model, h * d_k, bias=False)
            self.w_kv = nn.Linear(d_model, h * (d_k + d_v), bias=False)
        self.w_o = nn.Linear(h * d_v, d_model, bias=False)

    def split_heads(self, x: Tensor, d: int) -> Tensor:
        """(B, T, H*d) -> (B, H, T, d)."""
        return x.unflatten(-1, (self.h, d)).transpose(1, 2)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D), computed once per sentence when
        decoding."""
        k, v = self.w_kv(memory).split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self.split_heads(k, self.d_k), self.split_heads(v, self.d_v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        causal: bool = False,
        kv: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Attend from x (B, Tq, D) to itself, or to `memory` (B, Tk, D) / precomputed `kv`.

        `cache` (self-attention, incremental decoding): the new keys/values are appended to
        it and attention covers everything cached so far.
        """
        if self.self_attention:
            q, k, v = self.w_qkv(x).split(
                [self.h * self.d_k, self.h * self.d_k, self.h * self.d_v], dim=-1
            )
            q, k, v = (
                self.split_heads(q, self.d_k),
                self.split_heads(k, self.d_k),
                self.split_heads(v, self.d_v),
            )
            if cache is not None:
                k, v = cache.append(k, v)
                causal = causal and q.size(2) > 1  # a single new query may see all the past
        else:
            q = self.split_heads(self.w_q(x), self.d_k)
            k, v = kv if kv is not None else self.project_kv(memory)  # type: ignore[arg-type]
            if k.size(0) != q.size(0):  # beam search keeps each sentence's keys once
                k, v = (t.repeat_interleave(q.size(0) // t.size(0), dim=0) for t in (k, v))
        return self.w_o(self.attend(q, k, v, mask, causal).transpose(1, 2).flatten(2))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """Eq. 1 over the heads: (B, H, Tq, K) queries -> (B, H, Tq, Vd)."""
        p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, mask, causal=causal, dropout_p=p)


class KVCache:
    """Self-attention keys and values of the tokens decoded so far: (B, H, t, K), contiguous.

    Each step writes the cache once, into a new buffer one position longer: a pending beam
    reordering is gathered straight into it, then the new keys/values go at the end.
    """

    def __init__(
        self, batch: int, h: int, d_k: int, d_v: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.k = torch.empty(batch, h, 0, d_k, device=device, dtype=dtype)
        self.v = torch.empty(batch, h, 0, d_v, device=device, dtype=dtype)
        self._index: Tensor | None = None  # rows to keep, not yet applied

    @property
    def length(self) -> int:
        return self.k.size(2)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k, self.v = self._grow(self.k, k), self._grow(self.v, v)
        self._index = None
        return self.k, self.v

    def _grow(self, old: Tensor, new: Tensor) -> Tensor:
        t = old.size(2)
        out = new.new_empty(new.size(0), new.size(1), t + new.size(2), new.size(3))
        if self._index is None:
            out[:, :, :t] = old
        else:
            torch.index_select(old, 0, self._index, out=out[:, :, :t])
        out[:, :, t:] = new
        return out

    def reorder(self, index: Tensor) -> None:
        """Keep the rows `index` (beam search reordering); applied at the next append."""
        self._index = index if self._index is None else self._index.index_select(0, index)


# --------------------------------------------------------------------------- 3.3
class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Eq. 2)."""

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float = 0.0) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.relu_dropout = nn.Dropout(relu_dropout)  # 0 in the paper (tensor2tensor's knob)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.relu_dropout(torch.relu(self.w_1(x))))


# --------------------------------------------------------------------------- 3.1
class EncoderLayer(nn.Module):
    """Self-attention then FFN, each as LayerNorm(x + Dropout(Sublayer(x))) (post-norm, the
    paper's), or with `model.norm = "pre"` as x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(
            cfg.d_model, cfg.h, cfg.d_k, cfg.d_v, self_attention=True, dropout=cfg.attn_dropout
        )
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.P_drop)  # section 5.4: on each sublayer's output
        self.pre_norm = cfg.norm == "pre"

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        if self.pre_norm:
            h = self.norm1(x)
            x = x + self.dropout(self.self_attn(h, mask=src_mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=src_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


@dataclass
class LayerState:
    """Incremental state of one decoder layer: its self-attention cache and the encoder K/V."""

    self_cache: KVCache
    memory_kv: tuple[Tensor, Tensor]

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep hypothesis rows `index`; and sentences `sentences` of the encoder K/V, which
        are kept once per sentence (None: the same sentences as before)."""
        self.self_cache.reorder(index)
        if sentences is not None:
            k, v = self.memory_kv
            self.memory_kv = (k.index_select(0, sentences), v.index_select(0, sentences))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, FFN; each post-norm (or pre-norm,
    as `EncoderLayer`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(
            cfg.d_model, cfg.h, cfg.d_k, cfg.d_v, self_attention=True, dropout=cfg.attn_dropout
        )
        self.cross_attn = MultiHeadAttention(
            cfg.d_model, cfg.h, cfg.d_k, cfg.d_v, self_attention=False, dropout=cfg.attn_dropout
        )
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.P_drop)
        self.pre_norm = cfg.norm == "pre"

    def forward(
        self, y: Tensor, memory: Tensor, src_mask: Tensor, state: LayerState | None = None
    ) -> Tensor:
        cache = state.self_cache if state is not None else None
        kv = state.memory_kv if state is not None else None
        if self.pre_norm:
            y = y + self.dropout(self.self_attn(self.norm1(y), causal=True, cache=cache))
            y = y + self.dropout(self.cross_attn(self.norm2(y), memory, src_mask, kv=kv))
            return y + self.dropout(self.ffn(self.norm3(y)))
        y = self.norm1(y + self.dropout(self.self_attn(y, causal=True, cache=cache)))
        y = self.norm2(y + self.dropout(self.cross_attn(y, memory, src_mask, kv=kv)))
        return self.norm3(y + self.dropout(self.ffn(y)))


# --------------------------------------------------------------------------- 3.5
def sinusoidal_positions(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same): (P, D)."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)
    div = torch.pow(10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe.float()


class Embeddings(nn.Module):
    """Token embedding x sqrt(d_model) + positional encoding, then dropout (3.4, 3.5, 5.4)."""

    def __init__(self, cfg: ModelConfig, token: nn.Embedding) -> None:
        super().__init__()
        self.token = token
        self.scale = math.sqrt(cfg.d_model)
        self.learned: nn.Embedding | None = None
        if cfg.positional == "learned":  # Table 3 row (E)
            self.learned = nn.Embedding(cfg.max_positions, cfg.d_model)
            nn.init.normal_(self.learned.weight, std=cfg.d_model**-0.5)
        else:
            self.register_buffer(
                "pe", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False
            )
        self.dropout = nn.Dropout(cfg.P_drop)
        self.max_positions = cfg.max_positions

    def positions(self) -> Tensor:
        """The table of positional encodings, (max_positions, D)."""
        return self.learned.weight if self.learned is not None else self.pe  # type: ignore[return-value]

    def check_length(self, end: int) -> None:
        if end > self.max_positions:
            raise ValueError(f"sequence of length {end} exceeds max_positions={self.max_positions}")

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """tokens (B, T) at positions offset..offset+T-1 -> (B, T, D)."""
        t = tokens.size(1)
        self.check_length(offset + t)
        pos = self.positions()[offset : offset + t]
        return self.dropout(self.token(tokens) * self.scale + pos)


# --------------------------------------------------------------------------- 3
class Transformer(nn.Module):
    """Encoder-decoder Transformer. `forward(src, tgt_in)` gives logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (it comes from the vocabulary)")
        self.cfg = cfg
        emb = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.src_embed = Embeddings(cfg, emb)
        tgt_emb = (
            emb
            if cfg.share_embeddings
            else nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD_ID)
        )
        self.tgt_embed = Embeddings(cfg, tgt_emb)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.N))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.N))
        # pre-norm: each stack's output is normalised once more, as the post-norm stack's
        # last sublayer does (only then: post-norm checkpoints keep their parameters)
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else None
        self.generator = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_parameters()
        if cfg.share_embeddings:
            self.generator.weight = emb.weight  # the pre-softmax projection is the embedding
        elif cfg.share_target_embeddings:  # separate vocabularies: the target side's only
            self.generator.weight = tgt_emb.weight

    def _init_parameters(self) -> None:
        # tensor2tensor: Glorot-uniform matrices, N(0, d_model^-0.5) embeddings so that the
        # sqrt(d_model) scaling brings them to unit size; the padding row is zero.
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                nn.init.xavier_uniform_(p)
        for emb in {self.src_embed.token, self.tgt_embed.token}:
            nn.init.normal_(emb.weight, std=self.cfg.d_model**-0.5)
            with torch.no_grad():
                emb.weight[PAD_ID].zero_()

    @staticmethod
    def src_mask(src: Tensor) -> Tensor:
        """(B, S) -> (B, 1, 1, S) boolean, True at real tokens: every query may attend there."""
        return (src != PAD_ID)[:, None, None, :]

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, D) and its mask (B, 1, 1, S)."""
        mask = self.src_mask(src)
        x = self.src_embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.end_norm(x, self.encoder_norm), mask

    @staticmethod
    def end_norm(x: Tensor, norm: nn.LayerNorm | None) -> Tensor:
        """A stack's output: pre-norm's final LayerNorm applied, when there is one."""
        return x if norm is None else norm(x)

    def decode(
        self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, *, features_only: bool = False
    ) -> Tensor:
        """Teacher-forced decoder: tgt_in (B, T) -> logits (B, T, V), or with
        `features_only` the last layer's output (B, T, D) before the pre-softmax projection
        (training projects it inside the loss: `aiayn.training.loss.generator_loss`).

        Target padding needs no mask: it only ever follows real tokens, and the causal mask
        already keeps every real position from seeing later ones.
        """
        y = self.tgt_embed(tgt_in)
        for layer in self.decoder:
            y = layer(y, memory, src_mask)
        y = self.end_norm(y, self.decoder_norm)
        return y if features_only else self.generator(y)

    def forward(self, src: Tensor, tgt_in: Tensor, *, features_only: bool = False) -> Tensor:
        memory, mask = self.encode(src)
        return self.decode(tgt_in, memory, mask, features_only=features_only)

    # -- incremental decoding (section 6.1 inference) ---------------------------------
    def init_state(self, memory: Tensor, max_len: int) -> list[LayerState]:
        """Per-layer state for incremental decoding: encoder K/V once, empty self caches.
        `max_len` is the output cap (this cache grows as it goes)."""
        b, cfg = memory.size(0), self.cfg
        states = []
        for layer in cast(Iterable[DecoderLayer], self.decoder):
            cache = KVCache(b, cfg.h, cfg.d_k, cfg.d_v, memory.device, memory.dtype)
            # contiguous once here, or the CPU's bf16 matrix products copy them every step
            k, v = layer.cross_attn.project_kv(memory)
            states.append(LayerState(cache, (k.contiguous(), v.contiguous())))
        return states

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list[LayerState]) -> Tensor:
        """One step: the newest tokens (B, 1) -> logits for the next token (B, V).

        Equals the last row of `decode` on the whole prefix (tested), at O(T) cost per step.
        """
        y = self.tgt_embed(tokens, offset=states[0].self_cache.length)
        for layer, state in zip(self.decoder, states, strict=True):
            y = layer(y, None, src_mask, state)
        return self.generator(self.end_norm(y[:, -1], self.decoder_norm))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_formula(cfg: ModelConfig) -> int:
    """Closed-form parameter count of `Transformer(cfg)`, from the shapes in section 3."""
    D, V = cfg.d_model, cfg.vocab_size
    attn = D * cfg.h * (2 * cfg.d_k + cfg.d_v) + cfg.h * cfg.d_v * D
    ffn = D * cfg.d_ff + cfg.d_ff + cfg.d_ff * D + D
    norm = 2 * D
    enc_layer = attn + ffn + 2 * norm
    dec_layer = 2 * attn + ffn + 3 * norm
    matrices = 1 if cfg.share_embeddings else 2 if cfg.share_target_embeddings else 3
    embeddings = matrices * V * D
    positions = cfg.max_positions * D * 2 if cfg.positional == "learned" else 0
    final_norms = 2 * norm if cfg.norm == "pre" else 0
    return embeddings + positions + cfg.N * (enc_layer + dec_layer) + final_norms
