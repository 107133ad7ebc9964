"""Inference precisions for decoding: bf16 weights packed for oneDNN once, and int8
layers (dynamic quantization without `torch.ao`), made by `cast` (which precision to use
is `machine.cast_for_inference`'s decision)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.fast.cpu_ops import onednn_bf16
from aiayn.fast.int8_ops import LSE_TOPK_BLOCK_BYTES, Int8Linear
from aiayn.fast.layers import accelerate
from aiayn.model import PositionwiseFeedForward, Transformer

logger = logging.getLogger(__name__)

__all__ = ["INFERENCE_DTYPES", "LSE_TOPK_BLOCK_BYTES", "Int8Linear", "PackedLinear", "cast"]


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


def int8_activation_bits(default: int = 8) -> int:
    """The bits int8 layers quantize their inputs to: AIAYN_INT8_ACTIVATIONS where set (7 or
    8), else `default` (8, exact to the int8 grid, for an explicit int8; `--dtype auto`
    passes its machine's choice, `machine.Choice.int8_bits`: 7 where aiayn's kernel
    multiplies 7-bit inputs ~1.4x faster, CPUs without VNNI; what PyTorch's fbgemm does on
    x86, its `reduce_range`)."""
    value = os.environ.get("AIAYN_INT8_ACTIVATIONS", "") or str(default)
    if value not in ("7", "8"):
        raise ValueError(f"AIAYN_INT8_ACTIVATIONS must be 7 or 8, got {value!r}")
    return int(value)


def quantize_linears(model: nn.Module, act_bits: int | None = None) -> nn.Module:
    """Replace every CPU `nn.Linear` of `model` by an `Int8Linear`, in place (a tied
    embedding keeps its float weight; the output projection gets an int8 copy). An FFN's
    second layer reads max(0, .) (Eq. 2; dropout keeps the sign): marked `nonneg_input`.
    `act_bits`: the other layers' input bits (default `int8_activation_bits()`)."""
    bits = int8_activation_bits() if act_bits is None else act_bits
    if bits not in (7, 8):
        raise ValueError(f"act_bits must be 7 or 8, got {bits}")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                layer = Int8Linear(child)
                layer.nonneg_input = isinstance(module, PositionwiseFeedForward) and name == "w_2"
                layer.act_bits = bits
                setattr(module, name, layer)
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


def cast(model: Transformer, dtype: str, act_bits: int | None = None) -> Transformer:
    """The model in a concrete inference precision ("fp32", "bf16" or "int8"; see
    `machine.cast_for_inference`, which also resolves "auto" and warns): the fast model
    (`aiayn.fast.accelerate`), no gradients, bf16 weights packed for oneDNN where it
    packs, int8 layers (`Int8Linear`, CPU only; `act_bits` as for `quantize_linears`)."""
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
        quantize_linears(model, act_bits)
    return model
