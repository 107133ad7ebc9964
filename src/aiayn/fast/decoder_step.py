"""The decoder's incremental step as one compiled call (csrc/decoder_step.c), for small
batches on the CPU; likewise the encoder and the decoder's keys and values of its output.

Why: at batch 1 a beam step of a small model is ~50 PyTorch operators of a few
microseconds of arithmetic each plus the Python between them; dispatch and the
interpreter, not the arithmetic, set the time (measured: docs/performance.md, "A step at
batch 1"). `DecoderPlan` lays the decoder's weights out once (int8 layers packed for
aiayn's int8 kernel); `NativeStates` is a search's incremental state, and each step is
one C call: embeddings, every layer, the output layer and the beam's top-k (or the
logits). Unconstrained greedy and beam search then run whole in one more call
(`NativeStates.search`, csrc/beam_search.c: search.py's loop in C, the same hypotheses).

Where it applies (`plan_for`, asked by `FastTransformer.init_state` where the class's
decoding step is its own): the fast model (`aiayn.fast.accelerate`) in float32 or
int8 (`inference.Int8Linear`, any mix of the two per layer) on the CPU, without
gradients, forward hooks (someone watching the modules: attention pictures) or an
overridden decoding step; bf16 models take the PyTorch path. Which batches: every batch
of an int8 model on one thread (a server's or `translate --workers`' processes) or where
aiayn's kernel computes the int8 products (`int8_ops.backend()`: CPUs without VNNI, where
the one-thread call beat the per-layer path on two threads: docs/performance.md); up to
`MAX_SENTENCES` sentences a search otherwise, larger batches being faster through MKL's
float32 products and oneDNN's second thread (the per-layer path).
The encoder (`encode`, from `FastTransformer.encode`) and the encoder-decoder keys and
values (`DecoderPlan.memory_kv`) take one call each under the same rule, in float32 only
up to `MAX_ENCODER_ROWS` source positions (MKL's products win beyond).
`AIAYN_NATIVE_STEP=1`: every batch, `0`: none. Where a run takes both paths (float32, or
more than one thread), a sentence's scores may differ in their last float bits between a
small and a large batch.

Long because the C structs' mirror, the plan that fills them and the state that drives the
step change together with csrc/decoder_step.c's layout; split, each part would restate it.

The outputs are the PyTorch path's up to float rounding: an int8 layer's arithmetic is
the same C code (`Int8Linear`); float32 products, attention and LayerNorm sum in another
order, so an int8 layer may round a value to the neighbouring step (tests/fast/
test_decoder_step.py compares both with the paper model's search).
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import BOS_ID, EOS_ID
from aiayn.decoding.search import NEVER_GENERATED, Hypothesis, excluded
from aiayn.fast import int8_ops, native
from aiayn.fast.int8_ops import LSE_TOPK_BLOCK_BYTES, Int8Linear

#: Sentences a search up to which the compiled step is used by default (measured:
#: docs/performance.md, "A step at batch 1").
MAX_SENTENCES = 16
#: Source positions (sentences x length) up to which a float32 encoder, and the decoder's
#: keys and values of its output, run in one call (measured: docs/performance.md, "A step
#: at batch 1").
MAX_ENCODER_ROWS = 64
#: aiayn_linear.int8 for int8 weights with 7-bit inputs (INT8_R7 in csrc/decoder_step.h).
INT8_R7 = 2

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [
        ("n", _I64),
        ("k", _I64),
        ("int8", _INT),
        ("w", _P),
        ("packed", _P),
        ("scale", _P),
        ("bias", _P),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("self_o", _Linear),
        ("cross_q", _Linear),
        ("cross_o", _Linear),
        ("ff1", _Linear),
        ("ff2", _Linear),
        ("norm_w", _P * 3),
        ("norm_b", _P * 3),
        ("mem_k", _P),
        ("mem_v", _P),
        ("cross_kv", _Linear),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        ("layers", _I64),
        ("d_model", _I64),
        ("h", _I64),
        ("d_k", _I64),
        ("d_v", _I64),
        ("d_ff", _I64),
        ("vocab", _I64),
        ("max_positions", _I64),
        ("pre_norm", _INT),
        ("eps", _F),
        ("emb_scale", _F),
        ("emb", _P),
        ("pe", _P),
        ("final_w", _P),
        ("final_b", _P),
        ("out", _Linear),
        ("out_block", _I64),
        ("layer", ctypes.POINTER(_Layer)),
    ]


@functools.cache
def _functions(lib: ctypes.CDLL) -> tuple[Any, Any]:
    """The step and its workspace size, with their C signatures (and the encoder's): set
    once per library, not per search."""
    step, work = lib.aiayn_decoder_step, lib.aiayn_decoder_workspace
    d = ctypes.POINTER(_Decoder)
    step.argtypes = [d, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _P,
                     _INT, _P, _INT, _P, _P, _P]  # fmt: skip
    step.restype = None
    work.argtypes, work.restype = [d, _I64, _I64, _I64, _I64], _I64
    for name in ("aiayn_encoder_workspace", "aiayn_memory_kv_workspace"):
        f = getattr(lib, name)
        f.argtypes, f.restype = [d, _I64, _I64], _I64
    lib.aiayn_encode.argtypes = [d, _P, _I64, _I64, _P, _P, _P]
    lib.aiayn_encode.restype = None
    lib.aiayn_memory_kv.argtypes = [d, _P, _I64, _I64, _P, _P, _P]
    lib.aiayn_memory_kv.restype = None
    search = lib.aiayn_beam_search
    search.argtypes = [d, _I64, _I64, _P, _P, _INT, ctypes.c_double, _I64, _I64, _I64, _P, _INT,
                       _P, _INT, _I64, _I64, _P, _P, _P, _P, _P]  # fmt: skip
    search.restype = _INT
    return step, work


def _panels(w: Tensor) -> Tensor:
    """A float32 weight (n, k) in the C step's panels of 8 output columns, k-major
    (`gemm_f32_packed`: panel p holds W[8p:8p+8].T, zeros past n)."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 8) * 8, k, dtype=torch.float32)
    padded[:n] = w
    return padded.view(-1, 8, k).transpose(1, 2).contiguous()


def _f32(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


class DecoderPlan:
    """A model laid out for the compiled step and encoder: pointers to its float32
    weights, int8 layers' weights packed once (`decoder`, and `encoder`: the same struct
    over the encoder's layers). Holds references to every tensor it points into."""

    def __init__(self, model: Any) -> None:
        cfg = model.cfg
        self.keep: list[Tensor] = []
        self.encoder_layers = self._encoder_layers(model)
        self.h, self.d_k, self.d_v, self.layers = cfg.h, cfg.d_k, cfg.d_v, cfg.N
        self.vocab = cfg.vocab_size
        layers = (_Layer * cfg.N)()
        for i, layer in enumerate(model.decoder):
            sa, ca = layer.self_attn, layer.cross_attn
            layers[i].qkv = self._linear(sa.w_qkv)
            layers[i].self_o = self._linear(sa.w_o)
            layers[i].cross_q = self._linear(ca.w_q)
            layers[i].cross_o = self._linear(ca.w_o)
            layers[i].ff1 = self._linear(layer.ffn.w_1)
            layers[i].ff2 = self._linear(layer.ffn.w_2)
            layers[i].cross_kv = self._linear(ca.w_kv)
            for j, norm in enumerate((layer.norm1, layer.norm2, layer.norm3)):
                layers[i].norm_w[j] = self._ptr(norm.weight)
                layers[i].norm_b[j] = self._ptr(norm.bias)
        self.layer_structs = layers
        linears = [
            getattr(x, f)
            for x in layers
            for f in ("qkv", "self_o", "cross_q", "cross_o", "ff1", "ff2")
        ]
        self.int8 = all(x.int8 for x in linears) and isinstance(model.generator, Int8Linear)
        emb = model.tgt_embed
        final = model.decoder_norm
        self.decoder = _Decoder(
            layers=cfg.N,
            d_model=cfg.d_model,
            h=cfg.h,
            d_k=cfg.d_k,
            d_v=cfg.d_v,
            d_ff=cfg.d_ff,
            vocab=cfg.vocab_size,
            max_positions=emb.max_positions,
            pre_norm=int(layer.pre_norm),
            eps=float(layer.norm1.eps),
            emb_scale=float(emb.scale),
            emb=self._ptr(emb.token.weight),
            pe=self._ptr(emb.positions()),
            final_w=None if final is None else self._ptr(final.weight),
            final_b=None if final is None else self._ptr(final.bias),
            out=self._linear(model.generator),
            out_block=cfg.vocab_size,
        )
        self.decoder.layer = ctypes.cast(self.layer_structs, ctypes.POINTER(_Layer))
        src, enc_final = model.src_embed, model.encoder_norm
        self.encoder = _Decoder.from_buffer_copy(self.decoder)
        self.encoder.max_positions = src.max_positions
        self.encoder.emb_scale = float(src.scale)
        self.encoder.emb = self._ptr(src.token.weight)
        self.encoder.pe = self._ptr(src.positions())
        self.encoder.final_w = None if enc_final is None else self._ptr(enc_final.weight)
        self.encoder.final_b = None if enc_final is None else self._ptr(enc_final.bias)
        self.encoder.layer = ctypes.cast(self.encoder_layers, ctypes.POINTER(_Layer))
        lib = native.library()
        if lib is None:
            raise ValueError("no compiled library")
        self.lib: ctypes.CDLL = lib
        _functions(lib)  # their C signatures

    def _encoder_layers(self, model: Any) -> Any:
        layers = (_Layer * len(model.encoder))()
        for i, layer in enumerate(model.encoder):
            layers[i].qkv = self._linear(layer.self_attn.w_qkv)
            layers[i].self_o = self._linear(layer.self_attn.w_o)
            layers[i].ff1 = self._linear(layer.ffn.w_1)
            layers[i].ff2 = self._linear(layer.ffn.w_2)
            for j, norm in enumerate((layer.norm1, layer.norm2)):
                layers[i].norm_w[j] = self._ptr(norm.weight)
                layers[i].norm_b[j] = self._ptr(norm.bias)
        return layers

    def encode(self, src: Tensor, mask: Tensor) -> Tensor:
        """The encoder's output (A, S, d_model) for src (A, S), mask (A, 1, 1, S) True at
        real tokens, in one C call (csrc/decoder_step.c, `aiayn_encode`)."""
        a, s = src.shape
        if s > self.encoder.max_positions:
            raise ValueError(
                f"sequence of length {s} exceeds max_positions={self.encoder.max_positions}"
            )
        tokens = (
            src if src.dtype == torch.int64 and src.is_contiguous() else src.long().contiguous()
        )
        bytes_ = mask.reshape(a, s).contiguous()
        enc = ctypes.byref(self.encoder)
        work = torch.empty(self.lib.aiayn_encoder_workspace(enc, a, s), dtype=torch.float32)
        out = torch.empty(a, s, self.encoder.d_model, dtype=torch.float32)
        self.lib.aiayn_encode(
            enc, tokens.data_ptr(), a, s, bytes_.data_ptr(), out.data_ptr(), work.data_ptr()
        )
        return out

    def memory_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every decoder layer's encoder-decoder keys and values of `memory` (A, S, D):
        (A, h, S, d_k) and (A, h, S, d_v) each, as `project_kv` gives them, in one call."""
        a, s, _ = memory.shape
        memory = memory.contiguous()
        dec = ctypes.byref(self.decoder)
        work = torch.empty(self.lib.aiayn_memory_kv_workspace(dec, a, s), dtype=torch.float32)
        k = torch.empty(self.layers, a, self.h, s, self.d_k, dtype=torch.float32)
        v = torch.empty(self.layers, a, self.h, s, self.d_v, dtype=torch.float32)
        self.lib.aiayn_memory_kv(
            dec, memory.data_ptr(), a, s, k.data_ptr(), v.data_ptr(), work.data_ptr()
        )
        return list(zip(k.unbind(0), v.unbind(0), strict=True))

    def _ptr(self, t: Tensor) -> int:
        t = t.detach()
        if not _f32(t):
            raise ValueError("not a contiguous float32 tensor")
        self.keep.append(t)
        return t.data_ptr()

    def _linear(self, layer: nn.Module) -> _Linear:
        if isinstance(layer, Int8Linear):
            packed = native.int8_pack(layer.weight_int8.contiguous())
            if packed is None:
                raise ValueError("no compiled library")
            self.keep.append(packed)
            bias = layer.bias
            return _Linear(
                n=layer.out_features,
                k=layer.in_features,
                int8=INT8_R7 if layer.act_bits == 7 else 1,  # ff2: 8 bits in the C step too
                packed=packed.data_ptr(),
                scale=self._ptr(layer.weight_scale),
                bias=None if bias is None else self._ptr(bias),
            )
        if type(layer) is not nn.Linear:
            raise ValueError(f"{type(layer).__name__} is not a float32 or int8 linear layer")
        assert isinstance(layer, nn.Linear)
        return _Linear(
            n=layer.out_features,
            k=layer.in_features,
            int8=0,
            w=self._ptr(layer.weight),
            # a copy in panels only of weights no optimizer can be updating: fused Adam
            # writes in place without bumping the version counter the plan's key reads
            packed=None
            if layer.weight.requires_grad
            else self._ptr(_panels(layer.weight.detach())),
            bias=None if layer.bias is None else self._ptr(layer.bias),
        )


def _key(model: nn.Module) -> tuple[Any, ...] | None:
    """Which modules hold which weights, how often those were written in place, and
    whether they are trainable, so that a plan made for other weights (a layer swapped,
    weights loaded) is made again; None where a module has forward hooks (someone watching
    it: the per-layer path). In-place writes that do not count (fused Adam's) reach the
    plan only through its pointers into the live weights: it copies (packs) float32
    weights only where `requires_grad` is off, as `inference.cast` leaves them.

    One plain walk over `_modules`, several times faster than `nn.Module.modules()` (which
    dedupes and names): it runs once per search."""
    key: list[Any] = []
    todo = [model]
    while todo:
        m = todo.pop()
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        key.append((id(m), m.__dict__.get("act_bits")))  # an int8 layer's input bits
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:  # inference tensors have no version counter
                v = 0 if t.is_inference() else t._version
                key.append((t.data_ptr(), v, t.requires_grad))  # trainable: no packed copies
        todo.extend(c for c in m._modules.values() if c is not None)
    return tuple(key)


def plan_for(model: Any, sentences: int) -> DecoderPlan | None:
    """The model's `DecoderPlan` (made once, again if its weights changed) if the compiled
    step applies to a search over `sentences` sentences, else None (see the module doc)."""
    choice = os.environ.get("AIAYN_NATIVE_STEP", "")
    if choice == "0":
        return None
    if (
        model.training
        or torch.is_grad_enabled()
        or native.library() is None
        or not native.attention_applies(torch.float32, model.cfg.h, model.cfg.d_k, model.cfg.d_v)
        or torch.nn.modules.module._global_forward_hooks
        or torch.nn.modules.module._global_forward_pre_hooks
    ):
        return None
    key = _key(model)
    if key is None or any(t.device.type != "cpu" for t in model.generator.parameters()):
        return None
    cached = getattr(model, "_decoder_plan", None)
    if cached is not None and cached[0] == key:
        plan = cached[1]
    else:
        try:
            plan = DecoderPlan(model)
        except ValueError:  # bf16 weights, another kind of layer
            plan = None
        model.__dict__["_decoder_plan"] = (key, plan)  # not a submodule or buffer
    if plan is None or choice == "1" or sentences <= MAX_SENTENCES:
        return plan
    # a large batch: int8 is faster in one call on one thread, and on any number where
    # aiayn's kernel multiplies (no VNNI: its per-layer products on two threads lost to the
    # one-thread call); float32 products and a second thread, and PyTorch's VNNI int8
    # products, are faster through MKL and oneDNN (the per-layer path)
    one_call = torch.get_num_threads() == 1 or int8_ops.backend() == "aiayn"
    return plan if plan.int8 and one_call else None


class NativeStates:
    """A search's incremental decoder state for the compiled step: the cache (one table
    of every layer's fused projection per step, and each row's path through them, as
    `caches.PathKVCache`) and the encoder's keys and values per layer, once per sentence.
    Iterating gives the one state the search reorders (`reorder`)."""

    def __init__(self, plan: DecoderPlan, kv: list[tuple[Tensor, Tensor]], capacity: int) -> None:
        self.plan = plan
        self.decoder = _Decoder.from_buffer_copy(plan.decoder)  # this search's pointers
        self.layers = (_Layer * plan.layers)(
            *[_Layer.from_buffer_copy(x) for x in plan.layer_structs]
        )
        self.decoder.layer = ctypes.cast(self.layers, ctypes.POINTER(_Layer))
        self._dec = ctypes.byref(self.decoder)
        self._set_kv(kv)
        capacity = max(1, capacity)
        self.tables: list[Tensor] = []
        self.addresses = (ctypes.c_int64 * capacity)()  # step i's table, for the C code
        self.path = torch.empty(0, capacity, dtype=torch.int64)
        self.index: Tensor | None = None
        self._rows = 0
        self._width = plan.layers * plan.h * (2 * plan.d_k + plan.d_v)
        self._mask: tuple[Tensor, Tensor] | None = None  # (the search's mask, as C reads it)
        self._excluded: dict[tuple[int, ...], Tensor] = {}
        self.work = torch.empty(0, dtype=torch.float32)
        self.spent = False  # a whole search ran: its encoder keys and values were moved
        self.step_fn, self.work_fn = _functions(native.library())  # type: ignore[arg-type]

    def _set_kv(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        self.kv = [(k.float().contiguous(), v.float().contiguous()) for k, v in kv]
        self._sentences = self.kv[0][0].size(0)
        for layer, (k, v) in zip(self.layers, self.kv, strict=True):
            layer.mem_k, layer.mem_v = k.data_ptr(), v.data_ptr()

    def __iter__(self) -> Any:
        return iter((self,))

    @property
    def length(self) -> int:
        return len(self.tables)

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep hypothesis rows `index` (applied at the next step) and, if given, sentences
        `sentences` of the encoder keys and values."""
        self.index = index if self.index is None else self.index.index_select(0, index)
        if sentences is not None:
            self._set_kv(
                [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.kv]
            )

    def _c_mask(self, src_mask: Tensor, rows: int) -> Tensor:
        """The search's source mask as bytes, one row per hypothesis row, unit column
        stride; converted once per mask the search passes (it passes the same one every
        step until it drops sentences)."""
        if self._mask is not None and self._mask[0] is src_mask:
            return self._mask[1]
        mask = src_mask.reshape(rows, -1)
        if mask.dtype != torch.bool or mask.stride(1) != 1:
            mask = mask.to(torch.bool).contiguous()
        self._mask = (src_mask, mask)
        return mask

    def _run(
        self,
        tokens: Tensor,
        src_mask: Tensor,
        logits: Tensor | None,
        k: int = 0,
        excl: Tensor | None = None,
        val: Tensor | None = None,
        idx: Tensor | None = None,
    ) -> None:
        """One step for every row (the C function's arguments made here; see
        csrc/decoder_step.c). Kept to a few Python operations: at batch 1 they are a
        visible part of the step."""
        rows, t = tokens.size(0), len(self.tables)
        dec = self.decoder
        if self.spent:
            raise ValueError("this state served a whole search: start a new one")
        if t >= dec.max_positions:
            raise ValueError(
                f"sequence of length {t + 1} exceeds max_positions={dec.max_positions}"
            )
        if t == len(self.addresses):  # more steps than planned: twice the room
            grown = (ctypes.c_int64 * (2 * t))()
            ctypes.memmove(grown, self.addresses, 8 * t)
            self.addresses = grown
            self.path = torch.cat([self.path, torch.empty_like(self.path)], dim=1)
        if rows > self.path.size(0):
            grown_path = torch.empty(rows, self.path.size(1), dtype=torch.int64)
            grown_path[: self.path.size(0)] = self.path
            self.path = grown_path
        index = self.index
        if index is not None:
            if index.dtype != torch.int64 or not index.is_contiguous():
                index = index.to(torch.int64).contiguous()
            if index.numel() != rows:
                raise ValueError(f"{rows} rows after a reordering to {index.numel()}")
        elif t > 0 and rows != self._rows:
            raise ValueError(f"{rows} new rows for a cache of {self._rows}")
        table = torch.empty(rows, self._width, dtype=torch.float32)
        self.addresses[t] = table.data_ptr()
        mask = self._c_mask(src_mask, rows)
        g, s = rows // self._sentences, mask.size(1)
        if logits is None:
            dec.out_block = self._out_block(rows)
        need = self.work_fn(self._dec, rows, t, g, s)
        if self.work.numel() < need:
            self.work = torch.empty(2 * need, dtype=torch.float32)
        tok = tokens.reshape(rows)
        if tok.dtype != torch.int64 or not tok.is_contiguous():
            tok = tok.to(torch.int64).contiguous()
        self._call(
            tok.data_ptr(),
            rows,
            t,
            table.data_ptr(),
            self.addresses,
            self.path.data_ptr(),
            self.path.stride(0),
            None if index is None else index.data_ptr(),
            mask.data_ptr(),
            mask.stride(0),
            g,
            s,
            None if logits is None else logits.data_ptr(),
            k,
            None if excl is None else excl.data_ptr(),
            0 if excl is None else excl.numel(),
            None if val is None else val.data_ptr(),
            None if idx is None else idx.data_ptr(),
            self.work.data_ptr(),
        )
        self.tables.append(table)
        self.index = None
        self._rows = rows

    def _call(self, *args: Any) -> None:
        """The C step itself (its own method so that benchmarks/step_breakdown.py can time
        it apart from the Python around it)."""
        self.step_fn(self._dec, *args)

    def _out_block(self, rows: int) -> int:
        """Columns of int8 products per block of the output layer: `Int8Linear.lse_topk`'s."""
        v = self.plan.vocab
        return min(v, max(64, LSE_TOPK_BLOCK_BYTES // (4 * max(rows, 1)) // 64 * 64))

    def search(
        self, src_mask: Tensor, caps: list[int], beam: int, alpha: float, min_len: int
    ) -> list[list[Hypothesis]] | None:
        """The whole beam search of `search.beam_search` (beam 1: its greedy search) in one C
        call (csrc/beam_search.c): each sentence's `beam` best hypotheses, best first
        (fewer if fewer finished); None where it does not apply (a state already stepped,
        fewer than `beam` tokens to choose from, a cap past the position table), and the
        caller runs the search in Python. Moves the encoder keys and values in place: the
        state serves this one search."""
        v, dec = self.plan.vocab, self.decoder
        short = native._columns(excluded(0, min_len), v)
        if (
            self.spent
            or self.tables
            or self.index is not None
            or v - short.numel() < beam
            or max(caps) > dec.max_positions
        ):
            return None
        a = len(caps)
        mask = src_mask.reshape(a, -1).to(torch.bool).contiguous()
        never = native._columns(NEVER_GENERATED, v)
        cap = torch.tensor(caps, dtype=torch.int64)
        width = max(caps)
        count = torch.zeros(a, dtype=torch.int64)
        lengths = torch.zeros(a, beam, dtype=torch.int64)
        tokens = torch.zeros(a, beam, width, dtype=torch.int64)
        score = torch.zeros(a, beam, dtype=torch.float64)
        log_prob = torch.zeros(a, beam, dtype=torch.float64)
        status = self.plan.lib.aiayn_beam_search(
            self._dec, a, mask.size(1), mask.data_ptr(), cap.data_ptr(), beam, alpha, min_len,
            BOS_ID, EOS_ID, never.data_ptr(), never.numel(), short.data_ptr(), short.numel(),
            LSE_TOPK_BLOCK_BYTES, width, count.data_ptr(), lengths.data_ptr(),
            tokens.data_ptr(), score.data_ptr(), log_prob.data_ptr(),
        )  # fmt: skip
        self.spent = True
        if status != 0:
            raise MemoryError("the compiled beam search ran out of memory")
        rows = zip(count.tolist(), lengths.tolist(), tokens.tolist(), score.tolist(),
                   log_prob.tolist(), strict=True)  # fmt: skip
        out = []
        for c, ns, seqs, ss, ls in rows:
            out.append([Hypothesis(seqs[j][: ns[j]], ss[j], ls[j]) for j in range(c)])
        return out

    def logits(self, tokens: Tensor, src_mask: Tensor) -> Tensor:
        """`decode_step`: the next-token logits (R, V) float32."""
        out = torch.empty(tokens.size(0), self.plan.vocab, dtype=torch.float32)
        self._run(tokens, src_mask, out)
        return out

    def hidden(self, tokens: Tensor, src_mask: Tensor) -> Tensor:
        """`decode_hidden`: the decoder's last output (R, d_model) float32, before the
        output layer."""
        out = torch.empty(tokens.size(0), self.plan.decoder.d_model, dtype=torch.float32)
        self._run(tokens, src_mask, out, -1)
        return out

    def topk(
        self, tokens: Tensor, src_mask: Tensor, k: int, exclude: tuple[int, ...]
    ) -> tuple[Tensor, Tensor] | None:
        """The search's `best_next_tokens`: (R, k) log P and tokens; None where the C
        top-k does not apply (fewer than k eligible tokens: the caller takes the logits)."""
        excl = self._excluded.get(exclude)
        if excl is None:
            excl = self._excluded[exclude] = native._columns(exclude, self.plan.vocab)
        if self.plan.vocab - len(excl) < k or k < 1:
            return None
        rows = tokens.size(0)
        val = torch.empty(rows, k, dtype=torch.float32)
        idx = torch.empty(rows, k, dtype=torch.int64)
        self._run(tokens, src_mask, None, k, excl, val, idx)
        return val, idx


def init_states(model: Any, memory: Tensor, max_len: int) -> NativeStates | None:
    """`NativeStates` for a search of `model` over `memory` (A, S, D), or None where the
    compiled step does not apply (`plan_for`)."""
    encoded = model.__dict__.pop("_encoded", None)
    if encoded is not None and encoded[0]() is memory:  # this search's encoder output
        plan = encoded[1]
    else:
        plan = plan_for(model, memory.size(0))
    if plan is None or memory.dtype != torch.float32:
        return None
    if _encoder_applies(plan, memory.size(0) * memory.size(1)):
        kv = plan.memory_kv(memory)
    else:  # float32 products of many positions: MKL's are faster
        kv = [layer.cross_attn.project_kv(memory) for layer in model.decoder]
    return NativeStates(plan, kv, max_len)


def encode(model: Any, src: Tensor, mask: Tensor) -> Tensor | None:
    """The encoder's output for src (A, S) in one C call (`DecoderPlan.encode`), or None
    where the compiled step does not apply to a search over these sentences (`plan_for`)
    or the batch has more than `MAX_ENCODER_ROWS` positions in float32 (MKL's products
    are faster there)."""
    plan = plan_for(model, src.size(0))
    if plan is None or not _encoder_applies(plan, src.numel()):
        return None
    memory = plan.encode(src, mask)
    # the search's init_state next takes this plan instead of walking the model again
    model.__dict__["_encoded"] = (weakref.ref(memory), plan)
    return memory


def _encoder_applies(plan: DecoderPlan, positions: int) -> bool:
    """Whether the encoder's side (`encode`, `memory_kv`) takes one call for a batch of
    `positions` source positions: int8 always, float32 up to `MAX_ENCODER_ROWS`, every
    batch with `AIAYN_NATIVE_STEP=1`."""
    return (
        plan.int8 or positions <= MAX_ENCODER_ROWS or os.environ.get("AIAYN_NATIVE_STEP", "") == "1"
    )
