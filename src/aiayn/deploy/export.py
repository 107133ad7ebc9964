"""Export an aiayn model to CTranslate2, the inference engine users deploy NMT models with.

The paper's Transformer maps one to one onto CTranslate2's post-norm `TransformerSpec`:
fused Q/K/V (self-attention) and K/V (encoder-decoder attention) projections without
biases, LayerNorm after each residual, the sinusoidal table added to embeddings scaled by
sqrt(d_model), one matrix for both embeddings and the pre-softmax projection. The export
lets `benchmarks/compare.py` run CTranslate2 on exactly aiayn's weights, and lets a user
serve a trained checkpoint with it. The LayerNorm epsilon is carried over from the model.
In float32 the converted model's sentence log-probabilities agree with aiayn's to within
1e-4 (tests/deploy/test_export.py; 3e-6 measured on its copy model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.model import Transformer, sinusoidal_positions

SPECIAL = {PAD_ID: "<blank>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}


def vocabulary(vocab_size: int, pieces: list[str] | None = None) -> list[str]:
    """CTranslate2's token list for aiayn ids: its special tokens where aiayn has its own,
    then the sentencepiece pieces (or placeholders `<id>` for a model without a vocabulary)."""
    tokens = []
    for i in range(vocab_size):
        if i in SPECIAL:
            tokens.append(SPECIAL[i])
        else:
            tokens.append(pieces[i] if pieces is not None else f"<{i}>")
    if len(set(tokens)) != len(tokens):
        raise ValueError("the vocabulary has duplicate tokens; CTranslate2 needs them unique")
    return tokens


def to_ctranslate2(
    model: Transformer,
    out_dir: str | Path,
    tokens: list[str] | None = None,
    quantization: str | None = None,
) -> Path:
    """Write `model` as a CTranslate2 model directory and return its path.

    tokens: one string per id (default: `vocabulary(vocab_size)`); quantization: as in
    CTranslate2's converters ("int8", "bfloat16", ...), or None for float32 weights.
    """
    import ctranslate2.specs.transformer_spec as ts

    cfg = model.cfg
    if cfg.positional != "sinusoidal":
        raise ValueError("CTranslate2 export needs sinusoidal positions (learned: Table 3 E)")
    if cfg.h * cfg.d_k != cfg.d_model or cfg.h * cfg.d_v != cfg.d_model:
        raise ValueError("CTranslate2 needs h * d_k == h * d_v == d_model")
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    spec = ts.TransformerSpec.from_config((cfg.N, cfg.N), cfg.h, pre_norm=False)
    pe = sinusoidal_positions(cfg.max_positions, cfg.d_model).numpy()

    def norm(s: Any, name: str) -> None:
        s.gamma, s.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def linear(s: Any, name: str) -> None:
        s.weight = sd[f"{name}.weight"]
        if f"{name}.bias" in sd:
            s.bias = sd[f"{name}.bias"]

    def ffn(s: Any, name: str, norm_name: str) -> None:
        linear(s.linear_0, f"{name}.w_1")
        linear(s.linear_1, f"{name}.w_2")
        norm(s.layer_norm, norm_name)

    for side, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        emb = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        emb.weight = sd["src_embed.token.weight" if side == "encoder" else "tgt_embed.token.weight"]
        stack.position_encodings.encodings = pe
        stack.scale_embeddings = True
    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.w_qkv")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.w_o")
        norm(layer.self_attention.layer_norm, f"{p}.norm1")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.norm2")
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        linear(layer.self_attention.linear[0], f"{p}.self_attn.w_qkv")
        linear(layer.self_attention.linear[1], f"{p}.self_attn.w_o")
        norm(layer.self_attention.layer_norm, f"{p}.norm1")
        linear(layer.attention.linear[0], f"{p}.cross_attn.w_q")
        linear(layer.attention.linear[1], f"{p}.cross_attn.w_kv")
        linear(layer.attention.linear[2], f"{p}.cross_attn.w_o")
        norm(layer.attention.layer_norm, f"{p}.norm2")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.norm3")
    linear(spec.decoder.projection, "generator")

    tokens = tokens if tokens is not None else vocabulary(cfg.vocab_size)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    spec.config.unk_token, spec.config.bos_token = SPECIAL[UNK_ID], SPECIAL[BOS_ID]
    spec.config.eos_token, spec.config.decoder_start_token = SPECIAL[EOS_ID], SPECIAL[BOS_ID]
    spec.config.layer_norm_epsilon = next(
        m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
    )
    spec.validate()
    if quantization:
        spec.optimize(quantization=quantization)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))
    return out
