"""The fast model: subclasses of the paper's modules (`aiayn.model`) with the same
parameters and state_dict, and `accelerate`, the seam that swaps them in.

What each subclass adds, and only where it applies (elsewhere it is the paper's module):
- `FastTransformer`, `FastEmbeddings`, the layers: when training on the CPU, the
  position-wise sublayers run on the real tokens only (`Packing`).
- `FastMultiHeadAttention`: PyTorch's fused attention or the Triton kernel on CUDA
  (`attention.scaled_dot_product_attention`); decoding steps on the CPU in compiled C over
  a cache that beam reorderings never copy (`caches`); beam hypotheses attending to their
  sentence's keys as one block instead of copies.
- `FastFeedForward`: oneDNN's fused product + bias + ReLU under CPU bf16 autocast; int8
  layers' fused ReLU (`inference.Int8Linear`).
- `FastDropout`: CPU masks from a compiled generator (`cpu_ops`).
The outputs equal the paper model's up to rounding (tests/fast/test_seam.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from aiayn import model as paper
from aiayn.fast import decoder_step, native
from aiayn.fast.attention import scaled_dot_product_attention
from aiayn.fast.caches import PathKVCache, compiled_decoding
from aiayn.fast.cpu_ops import FastDropout, LinearReLU, fused_linear_relu_available
from aiayn.fast.packing import Packing


class FastMultiHeadAttention(paper.MultiHeadAttention):
    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        """As the paper's, from the encoder output's real rows (N, D) with their `packing`."""
        kv = self.w_kv(memory)
        if packing is not None:
            kv = packing.unpack(kv)
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self.split_heads(k, self.d_k), self.split_heads(v, self.d_v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        causal: bool = False,
        kv: tuple[Tensor, Tensor] | None = None,
        cache: paper.KVCache | PathKVCache | None = None,
        packing: Packing | None = None,
        memory_packing: Packing | None = None,
    ) -> Tensor:
        """The paper's forward; `packing` / `memory_packing`: x / memory are the real rows
        (N, D) of a padded batch (`Packing`), and so is the result."""
        if self.self_attention:
            qkv = self.w_qkv(x)
            if isinstance(cache, PathKVCache):  # a decoding step on the CPU: compiled Eq. 1
                rows = qkv.squeeze(1)  # (B, H*(2K+Vd)): one new position per row
                cache.add(rows)
                return self.w_o(cache.attend(rows[:, : self.h * self.d_k]).unsqueeze(1))
            if packing is not None:
                qkv = packing.unpack(qkv)
            q, k, v = qkv.split([self.h * self.d_k, self.h * self.d_k, self.h * self.d_v], dim=-1)
            q, k, v = (
                self.split_heads(q, self.d_k),
                self.split_heads(k, self.d_k),
                self.split_heads(v, self.d_v),
            )
            if cache is not None:
                k, v = cache.append(k, v)
                causal = causal and q.size(2) > 1  # a single new query may see all the past
        else:
            q = self.w_q(x)
            if (
                kv is not None
                and mask is not None
                and q.size(1) == 1
                and compiled_decoding(q, self.h, self.d_k, self.d_v)
            ):
                # a decoding step on the CPU: compiled Eq. 1 over each sentence's keys/values
                out = native.memory_attention(q.squeeze(1), *kv, mask.flatten(1).contiguous())
                if out is not None:
                    return self.w_o(out.unsqueeze(1))
            q = self.split_heads(q if packing is None else packing.unpack(q), self.d_k)
            k, v = kv if kv is not None else self.project_kv(memory, memory_packing)  # type: ignore[arg-type]
            if k.size(0) != q.size(0):
                return self.w_o(self._attend_grouped(q, k, v, mask))
        out = self.attend(q, k, v, mask, causal)
        # (B, H, Tq, Vd) -> (B, Tq, H*Vd)
        out = out.transpose(1, 2).flatten(2)
        return self.w_o(out if packing is None else packing.pack(out))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, mask, causal=causal, dropout_p=p)

    def _attend_grouped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Beam search: the g = B / A hypotheses of each of A sentences attend to that
        sentence's keys/values (A, H, S, K), kept once per sentence instead of g copies.

        The g queries become one block of g*Tq queries (Eq. 1 treats each query row on its
        own), so the products are A*H blocks of g rows instead of B*H single rows.
        q: (B, H, Tq, K) with B = A*g, sentence-major; mask: (B, 1, 1, S). -> (B, Tq, H*Vd).
        """
        b, h, tq, d_k = q.shape
        a = k.size(0)
        g = b // a
        if g * a != b:
            raise ValueError(f"{b} query rows do not split into groups over {a} sentences")
        q = q.view(a, g, h, tq, d_k).transpose(1, 2).reshape(a, h, g * tq, d_k)
        if mask is not None:
            mask = mask[::g]  # the rows of one sentence share its source mask
        out = scaled_dot_product_attention(q, k, v, mask)  # (A, H, g*Tq, Vd); eval only
        return out.view(a, h, g, tq, self.d_v).permute(0, 2, 3, 1, 4).reshape(b, tq, h * self.d_v)


class FastFeedForward(paper.PositionwiseFeedForward):
    def forward(self, x: Tensor) -> Tensor:
        # Not under torch.compile: inductor could not lower this op (a LoweringException
        # in bf16 training); it generates its own code for the bias and ReLU.
        if (
            x.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and type(self.w_1) is nn.Linear
            and fused_linear_relu_available()
        ):
            bf16 = torch.bfloat16
            hidden = LinearReLU.apply(x.to(bf16), self.w_1.weight.to(bf16), self.w_1.bias.to(bf16))
        elif (fused := getattr(self.w_1, "forward_relu", None)) is not None:
            hidden = fused(x)  # int8 decoding (inference.Int8Linear): ReLU while dequantizing
        else:
            hidden = torch.relu(self.w_1(x))
        return self.w_2(self.relu_dropout(hidden))


class FastEncoderLayer(paper.EncoderLayer):
    def forward(self, x: Tensor, src_mask: Tensor, packing: Packing | None = None) -> Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.norm1(x), mask=src_mask, packing=packing))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.self_attn(x, mask=src_mask, packing=packing)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class FastDecoderLayer(paper.DecoderLayer):
    def forward(
        self,
        y: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        state: paper.LayerState | None = None,
        packing: Packing | None = None,
        memory_packing: Packing | None = None,
    ) -> Tensor:
        cache = state.self_cache if state is not None else None
        kv = state.memory_kv if state is not None else None
        if self.pre_norm:
            h = self.norm1(y)
            y = y + self.dropout(self.self_attn(h, causal=True, cache=cache, packing=packing))
            h = self.norm2(y)
            y = y + self.dropout(
                self.cross_attn(
                    h, memory, src_mask, kv=kv, packing=packing, memory_packing=memory_packing
                )
            )
            return y + self.dropout(self.ffn(self.norm3(y)))
        y = self.norm1(
            y + self.dropout(self.self_attn(y, causal=True, cache=cache, packing=packing))
        )
        y = self.norm2(
            y
            + self.dropout(
                self.cross_attn(
                    y, memory, src_mask, kv=kv, packing=packing, memory_packing=memory_packing
                )
            )
        )
        return self.norm3(y + self.dropout(self.ffn(y)))


class FastEmbeddings(paper.Embeddings):
    def forward(self, tokens: Tensor, offset: int = 0, packing: Packing | None = None) -> Tensor:
        """The paper's; with `packing`, the real tokens' rows only: (N, D)."""
        if packing is None:
            return super().forward(tokens, offset)
        t = tokens.size(1)
        self.check_length(offset + t)
        ids = tokens.flatten().index_select(0, packing.rows)
        pos = self.positions().index_select(0, packing.rows % t + offset)
        return self.dropout(self.token(ids) * self.scale + pos)


class FastTransformer(paper.Transformer):
    #: Run the position-wise sublayers on the real tokens only (`packing`); None: when
    #: training on the CPU; False: always the whole padded batch (train.pack_padding).
    pack_padding: bool | None = None

    def use_cpu_kernels(self, on: bool) -> None:
        """Dropout masks from the compiled generator (`FastDropout.compiled`, the default)
        or from PyTorch's: `train.cpu_kernels`, whose other half, the loss, is an argument
        of `aiayn.training.loss.generator_loss`."""
        for module in self.modules():
            if isinstance(module, FastDropout):
                module.compiled = on

    def packing(self, tokens: Tensor) -> Packing | None:
        """How to run a padded batch on its real tokens only (`Packing`), or None to run it
        as it is: where `pack_padding` says so and the batch has padding to leave out.

        `pack_padding` None means: when training on the CPU, outside torch.compile. A GPU
        would wait for the rows to be found; evaluation and decoding keep the padded
        batch, whose encoder pass is a small part of a search.
        """
        use = self.pack_padding
        if use is None:
            use = (
                self.training and tokens.device.type == "cpu" and not torch.compiler.is_compiling()
            )
        if not use:
            return None
        packing = Packing(tokens)
        return packing if packing.padded else None

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """The paper's; for a search's small batch on the CPU (`decoder_step.encode`), one
        C call."""
        mask = self.src_mask(src)
        if src.device.type == "cpu" and self._own_steps():
            memory = decoder_step.encode(self, src, mask)
            if memory is not None:
                return memory, mask
        packing = self.packing(src)
        memory = self._encode(src, mask, packing)
        return (memory if packing is None else packing.unpack(memory)), mask

    def _encode(self, src: Tensor, mask: Tensor, packing: Packing | None) -> Tensor:
        x = self.src_embed(src, packing=packing)
        for layer in self.encoder:
            x = layer(x, mask, packing)
        return self.end_norm(x, self.encoder_norm)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Tensor,
        src_mask: Tensor,
        *,
        features_only: bool = False,
        memory_packing: Packing | None = None,
    ) -> Tensor:
        """The paper's; `memory` may be the encoder's real rows with their `memory_packing`.
        Positions after a sentence's end mean nothing (mostly zeros when packed)."""
        packing = self.packing(tgt_in)
        y = self.tgt_embed(tgt_in, packing=packing)
        for layer in self.decoder:
            y = layer(y, memory, src_mask, packing=packing, memory_packing=memory_packing)
        y = self.end_norm(y, self.decoder_norm)
        if not features_only:
            y = self.generator(y)
        return y if packing is None else packing.unpack(y)

    def forward(self, src: Tensor, tgt_in: Tensor, *, features_only: bool = False) -> Tensor:
        mask = self.src_mask(src)
        packing = self.packing(src)
        memory = self._encode(src, mask, packing)  # the real rows, when packed
        return self.decode(
            tgt_in, memory, mask, features_only=features_only, memory_packing=packing
        )

    def init_state(self, memory: Tensor, max_len: int) -> list[paper.LayerState]:
        """The paper's, with the compiled cache (`PathKVCache`) on the CPU without gradients
        (decoding); `max_len`, the output cap, sizes its tables of addresses (they grow if
        it is exceeded)."""
        cfg = self.cfg
        if not compiled_decoding(memory, cfg.h, cfg.d_k, cfg.d_v):
            return super().init_state(memory, max_len)
        native_states = (
            decoder_step.init_states(self, memory, max_len) if self._own_steps() else None
        )
        if native_states is not None:  # a small batch: the whole step in one C call
            return native_states  # type: ignore[return-value]
        states = []
        for layer in cast(Iterable[paper.DecoderLayer], self.decoder):
            cache = PathKVCache(cfg.h, cfg.d_k, cfg.d_v, max_len)
            k, v = layer.cross_attn.project_kv(memory)
            states.append(paper.LayerState(cache, (k.contiguous(), v.contiguous())))  # type: ignore[arg-type]
        return states

    def prepare_decoding(self) -> None:
        """Lay out now what decoding on the CPU lays out on first use (the one-call step's
        `DecoderPlan`). Called before forking decoding processes (`translate --workers`,
        `serve`), so that they share it copy-on-write instead of each building its own: for
        float32 a second copy of the decoder's weights (280 MiB for the base model with
        37,000 words)."""
        if self._own_steps():  # plan_for decides where it applies (CPU, eval, no hooks)
            with torch.no_grad():
                decoder_step.plan_for(self, 1)

    def _own_steps(self) -> bool:
        """The decoding methods are this class's: a subclass's own are what they say, not
        compiled."""
        cls = type(self)
        return cls is FastTransformer or all(
            getattr(cls, f) is getattr(FastTransformer, f)
            for f in ("encode", "_encode", "init_state", "decode_step", "decode_hidden")
        )

    def decode_step(
        self, tokens: Tensor, src_mask: Tensor, states: list[paper.LayerState]
    ) -> Tensor:
        """The paper's; with the compiled step's states (`decoder_step.NativeStates`), one C
        call."""
        if isinstance(states, decoder_step.NativeStates):
            return states.logits(tokens, src_mask)
        return super().decode_step(tokens, src_mask, states)

    def decode_hidden(
        self, tokens: Tensor, src_mask: Tensor, states: list[paper.LayerState]
    ) -> Tensor:
        """`decode_step` before the output layer: the decoder's last output (B, d_model),
        for an output layer that finds the beam's best tokens itself (`Int8Linear.lse_topk`,
        through `registry.step_topk`)."""
        if isinstance(states, decoder_step.NativeStates):
            return states.hidden(tokens, src_mask)
        y = self.tgt_embed(tokens, offset=states[0].self_cache.length)
        for layer, state in zip(self.decoder, states, strict=True):
            y = layer(y, None, src_mask, state)
        return self.end_norm(y[:, -1], self.decoder_norm)  # pre-LN's final norm; else as is


#: paper module -> its fast subclass
FAST_CLASSES: dict[type[nn.Module], type[nn.Module]] = {
    paper.Transformer: FastTransformer,
    paper.Embeddings: FastEmbeddings,
    paper.EncoderLayer: FastEncoderLayer,
    paper.DecoderLayer: FastDecoderLayer,
    paper.MultiHeadAttention: FastMultiHeadAttention,
    paper.PositionwiseFeedForward: FastFeedForward,
    nn.Dropout: FastDropout,
}


@functools.cache
def fast_class(cls: type[nn.Module]) -> type[nn.Module] | None:
    """The fast class for a module of class `cls`, or None (not a paper module, or fast
    already). A subclass of a paper module (a user's model that overrides a method) gets
    a class that keeps its overrides on top of the fast one."""
    if cls in FAST_CLASSES:
        return FAST_CLASSES[cls]
    if issubclass(cls, tuple(FAST_CLASSES.values())):
        return None
    for paper_cls, fast in FAST_CLASSES.items():
        if issubclass(cls, paper_cls) and paper_cls is not nn.Dropout:
            return type(f"Fast{cls.__name__}", (cls, fast), {"__module__": cls.__module__})
    return None


def accelerate(
    model: paper.Transformer, *, pack_padding: bool = True, cpu_kernels: bool = True
) -> FastTransformer:
    """The seam: turn a paper model into the fast one, in place, and return it.

    Each module's class becomes its fast subclass (`FAST_CLASSES`): the parameters,
    buffers and state_dict stay the same objects, so it can be done before or after
    loading weights. `pack_padding`: leave padding out of the position-wise layers when
    training on the CPU (`train.pack_padding`); `cpu_kernels`: dropout masks from the
    compiled generator (`train.cpu_kernels`). Calling it again only changes the options.
    """
    for module in model.modules():
        fast = fast_class(type(module))  # type: ignore[arg-type]  # classes hash
        if fast is not None:
            module.__class__ = fast
    fast_model = cast(FastTransformer, model)
    fast_model.pack_padding = None if pack_padding else False
    fast_model.use_cpu_kernels(cpu_kernels)
    return fast_model


def is_accelerated(model: nn.Module) -> bool:
    return isinstance(model, FastTransformer)
