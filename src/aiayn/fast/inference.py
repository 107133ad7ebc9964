"""Inference precisions for decoding: bf16 weights packed for oneDNN once, and int8
layers (dynamic quantization without `torch.ao`), made by `cast` (which precision to use
is `machine.cast_for_inference`'s decision)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.fast import native
from aiayn.fast.cpu_ops import onednn_bf16
from aiayn.fast.int8_ops import Int8Weight, quantize_per_row
from aiayn.fast.layers import accelerate
from aiayn.model import Transformer

logger = logging.getLogger(__name__)


#: The inference precisions; "auto" is this machine's fastest (`machine.cast_for_inference`).
INFERENCE_DTYPES = ("auto", "fp32", "bf16", "int8")


class PackedLinear(nn.Module):
    """A bf16 `nn.Linear` for CPU inference whose weight oneDNN has reordered once.

    `F.linear` on bf16 CPU tensors runs oneDNN's AMX matmul on the plain (out, in) weight,
    which it repacks into AMX's blocked layout on every call; in a beam search the same
    weights are used ~20 times per batch. Packed once, the products of a decoding step
    skip that repacking, with the same results but for an occasional last-bit difference
    in some shapes (the reduction is blocked differently; measured: docs/performance.md,
    "bf16 packed weights"). Inference only: there is no gradient, and changing `weight`
    afterwards does not change the packed copy. `weight` and `bias` stay parameters, so
    state_dict keys and tied embeddings are unchanged.
    """

    #: rows the packed layout is tuned for (beam 4 x 64 sentences); any row count works
    ROWS_HINT = 256

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._pack()

    def _pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.ROWS_HINT)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    # oneDNN's opaque tensors cannot be copied or pickled: drop the packed copy, repack
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_packed", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pack()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, packed=onednn"
        )


#: int32 products per block of `Int8Linear.lse_topk` (a block of columns for all the rows):
#: about a core's L2 cache, so that the beam step reads each block from cache; smaller
#: blocks pay more per-product call costs, larger ones spill (block sizes measured:
#: docs/performance.md, "int8 layers").
LSE_TOPK_BLOCK_BYTES = 1024 * 1024


class Int8Linear(nn.Module):
    """An `nn.Linear` for CPU inference with int8 weights and int8 activations (dynamic
    quantization): y ~ s_x s_w (q_x q_W^T) + b.

    The weight is quantized once, symmetrically, with one scale per output column
    (s_w = max|W_j| / 127); each input row gets its own scale at run time (s_x =
    max|x_i| / 127). The integer product is exact (int8 x int8 -> int32): `torch._int_mm`
    (oneDNN's s8 GEMM) where the CPU has VNNI, aiayn's kernel where oneDNN's would
    saturate (`int8_ops.backend`); the passes before and after it are
    `native.quantize_rows` / `native.dequantize_rows` (PyTorch ops without the compiled
    library). This replaces `torch.ao.quantization.quantize_dynamic`, which PyTorch has
    deprecated (it printed a warning on every run) and whose activations share one scale
    per call. float32 in and out; no gradient.
    """

    weight_int8: Tensor  # (out, in) int8
    weight_scale: Tensor  # (out,) float32
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_int8, weight_scale = quantize_per_row(linear.weight.detach().float())
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self._weight = Int8Weight(self.weight_int8)

    # The product's copy of the weight (packed for aiayn's kernel) follows the buffer:
    # `.to()` and friends replace it, load_state_dict writes into it.
    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        self._weight = Int8Weight(self.weight_int8)
        return out

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._weight = Int8Weight(self.weight_int8)

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, relu=False)

    def forward_relu(self, x: Tensor) -> Tensor:
        """max(0, forward(x)), the ReLU applied in the dequantizing pass (the FFN's first
        layer, `model.PositionwiseFeedForward`): the same values as torch.relu after it."""
        return self._forward(x, relu=True)

    def _quantized(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized: (rows, in) int8 and each row's
        scale."""
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or x2.dtype != torch.float32:
            x2 = x2.float().contiguous()
        return native.quantize_rows(x2) or quantize_per_row(x2)

    def _products(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The rows of x (..., in_features) quantized and multiplied: the (rows, out)
        int32 products and each row's scale."""
        x_int8, x_scale = self._quantized(x)
        return self._weight.matmul(x_int8), x_scale

    def _forward(self, x: Tensor, relu: bool) -> Tensor:
        lead = x.shape[:-1]
        acc, x_scale = self._products(x)
        y = native.dequantize_rows(acc, x_scale, self.weight_scale, self.bias, relu)
        if y is None:
            y = acc.float().mul_(x_scale[:, None]).mul_(self.weight_scale)
            if self.bias is not None:
                y.add_(self.bias)
            if relu:
                y.relu_()
        return y.view(*lead, self.out_features)

    def lse_topk(self, x: Tensor, k: int, exclude: tuple[int, ...]) -> tuple[Tensor, Tensor] | None:
        """As the output layer of a beam search: `native.lse_topk` of this layer's outputs
        for the rows x (R, in_features), the logits scaled from the int32 products as they
        are read, without writing them out (`native.lse_topk_int8_blocked`). The products
        are made `LSE_TOPK_BLOCK_BYTES` of int32 at a time (a block of the vocabulary's
        columns for all the rows) and consumed while in cache, instead of a (R, V) table
        written to memory and read back. The k logits and columns are those of the
        layer's float outputs; the normaliser may differ in its last bits (the sum of
        exponentials runs block by block). None where that does not apply (no compiled
        library): the caller then calls the layer."""
        if native.library() is None or x.dim() != 2:
            return None
        x_int8, x_scale = self._quantized(x)
        rows, v = x_int8.size(0), self.out_features
        block = min(v, max(64, LSE_TOPK_BLOCK_BYTES // (4 * max(rows, 1)) // 64 * 64))
        # one buffer for every block: each is consumed before the next is made, and its
        # pages stay in cache
        flat = torch.empty(rows * block, dtype=torch.int32)

        def products(c0: int, c1: int) -> Tensor:
            out = flat[: rows * (c1 - c0)].view(rows, -1)
            return self._weight.matmul(x_int8, c0, c1, out=out)

        return native.lse_topk_int8_blocked(
            products, rows, v, x_scale, self.weight_scale, self.bias, k, exclude, block
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, int8"
        )


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every CPU `nn.Linear` of `model` by an `Int8Linear`, in place (a tied
    embedding keeps its float weight; the output projection gets an int8 copy)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(module, name, Int8Linear(child))
    return model


@functools.cache
def can_pack_bf16() -> bool:
    """Whether this PyTorch build and CPU run oneDNN's packed bf16 linear (x86 CPUs with
    AVX-512 or AMX): the ops must exist and give nn.Linear's result on a small product."""
    if not onednn_bf16():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=gen).to(torch.bfloat16)
        x = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 5)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), (x.float() @ w.float().t()), rtol=1e-2, atol=1e-2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every bf16 CPU `nn.Linear` of `model` by a `PackedLinear`, in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (
                type(child) is nn.Linear
                and child.weight.dtype == torch.bfloat16
                and child.weight.device.type == "cpu"
            ):
                setattr(module, name, PackedLinear(child))
    return model


def cast(model: Transformer, dtype: str) -> Transformer:
    """The model in a concrete inference precision ("fp32", "bf16" or "int8"; see
    `machine.cast_for_inference`, which also resolves "auto" and warns): the fast model
    (`aiayn.fast.accelerate`), no gradients, bf16 weights packed for oneDNN where it
    packs, int8 layers (`Int8Linear`, CPU only)."""
    model = accelerate(model)
    model.requires_grad_(False)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        if can_pack_bf16():
            pack_linears(model)
        return model
    if dtype == "int8":
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ValueError(
                f"dtype int8 (dynamic quantization) runs on the CPU only, not on "
                f"{device}: use bf16 there"
            )
        quantize_linears(model)
    return model
