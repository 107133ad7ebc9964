"""The attention figures (Figures 3-5 of the paper and its appendix): every head's weights
for one sentence and the model's own translation of it.

The sentence is translated by the decoding aiayn uses (`aiayn.decoding.search`: beam
search with the checkpoint's options, or greedy), then the model runs once more,
teacher-forced on (source, translation), observed from outside (`AttentionObserver`: a
forward hook on every attention layer, which recomputes the softmax of Eq. 1, masks
applied, from the layer's inputs and its own projections). The model holds no recording
code; the outputs are unchanged, and the hooks are removed afterwards.

The decoder's rows and columns are its inputs, `<s>` y_1 .. y_m: row t is the position
that predicts y_{t+1} (so in encoder-decoder attention, the source words a head looks at
while choosing the next word). Layers and heads are numbered from 1, as in the paper
("layer 5 of 6").
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from aiayn.analysis import plots
from aiayn.config import BOS_ID, EOS_ID, DecodeConfig
from aiayn.data.tokenizer import Vocabulary, side_tokenizers
from aiayn.decoding.search import beam_search
from aiayn.fast.caches import PathKVCache
from aiayn.files import UsageError, write_text_atomic
from aiayn.model import MultiHeadAttention, Transformer, attention_weights, causal_mask

#: The three kinds of attention in the model (section 3.2.3), as the JSON names them.
KINDS = ("encoder_self", "decoder_self", "encoder_decoder")
TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention (masked)",
    "encoder_decoder": "encoder-decoder attention",
}


@dataclass
class AttentionMaps:
    """Every head's weights for one sentence pair.

    `weights[kind][l]` is layer l+1's (H, Tq, Tk) float32 tensor: encoder_self (H, S, S),
    decoder_self (H, T, T), encoder_decoder (H, T, S). The S source ids end in EOS; the T
    target ids are the decoder's inputs, BOS and the translation's subwords.
    """

    source_ids: list[int]
    target_ids: list[int]
    source_tokens: list[str]
    target_tokens: list[str]
    translation: str
    weights: dict[str, list[Tensor]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_ids": self.source_ids,
            "target_ids": self.target_ids,
            "source_tokens": self.source_tokens,
            "target_tokens": self.target_tokens,
            "translation": self.translation,
            "layers": len(self.weights["encoder_self"]),
            "heads": self.weights["encoder_self"][0].size(0),
            **{kind: [w.tolist() for w in self.weights[kind]] for kind in KINDS},
        }


def observed_weights(
    module: MultiHeadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    """The softmax of Eq. 1 (B, H, Tq, Tk) that `module` computed on a call with `args`
    and `kwargs`, masks applied (the causal one too), recomputed from the call's inputs
    with the module's own projections: the same products on the same inputs, so the same
    numbers. Read after the call: a self-attention cache then holds this step's keys."""
    call = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    if call.get("packing") is not None or call.get("memory_packing") is not None:
        raise ValueError("attention is observed on padded batches (evaluation), not packed rows")
    x, mask, causal = call["x"], call.get("mask"), bool(call.get("causal", False))
    h, d_k, d_v = module.h, module.d_k, module.d_v
    if module.self_attention:
        q, k, _ = module.w_qkv(x).split([h * d_k, h * d_k, h * d_v], dim=-1)
        q, k = module.split_heads(q, d_k), module.split_heads(k, d_k)
        cache = call.get("cache")
        if cache is not None:  # every position decoded so far, this one included
            k = cache.keys_values()[0] if isinstance(cache, PathKVCache) else cache.k
            causal = causal and q.size(2) > 1  # a single new query may see all the past
    else:
        q = module.split_heads(module.w_q(x), d_k)
        kv = call.get("kv")
        k = kv[0] if kv is not None else module.project_kv(call["memory"])[0]
        if k.size(0) != q.size(0):  # beam search keeps each sentence's keys once
            k = k.repeat_interleave(q.size(0) // k.size(0), dim=0)
    if causal:
        tri = causal_mask(q.size(2), k.size(2), q.device)
        mask = tri if mask is None else mask & tri
    return attention_weights(q, k, mask).detach()


class AttentionObserver:
    """Watches every attention layer of a model (`MultiHeadAttention`) from outside, with
    forward hooks: inside `with AttentionObserver(model) as seen:`, each call's weights
    (`observed_weights`) are kept as `seen.weights[module]` (the latest call's). The
    model's outputs are unchanged; leaving the block removes the hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        self.weights: dict[nn.Module, Tensor] = {}
        self._handles: list[RemovableHandle] = []

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any
    ) -> None:
        assert isinstance(module, MultiHeadAttention)
        self.weights[module] = observed_weights(module, args, kwargs)

    def __enter__(self) -> AttentionObserver:
        self._handles = [
            m.register_forward_hook(self._hook, with_kwargs=True) for m in self.modules
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def record_attention(model: Transformer, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
    """Every head's weights, teacher-forced: src (1, S) and tgt_in (1, T) token ids ->
    {kind: one (H, Tq, Tk) float32 tensor per layer} (see `AttentionMaps`)."""
    with AttentionObserver(model) as seen, torch.inference_mode():
        model(src, tgt_in)

    def weights(m: Tensor | nn.Module) -> Tensor:
        assert isinstance(m, MultiHeadAttention)
        return seen.weights[m][0].float().cpu()

    return {
        "encoder_self": [weights(layer.self_attn) for layer in model.encoder],
        "decoder_self": [weights(layer.self_attn) for layer in model.decoder],
        "encoder_decoder": [weights(layer.cross_attn) for layer in model.decoder],
    }


def attention_maps(
    model: Transformer,
    tokenizer: Vocabulary,
    text: str,
    decode: DecodeConfig,
    device: str | torch.device = "cpu",
) -> AttentionMaps:
    """Translate `text` (beam search with decode.beam and decode.alpha; beam 1 is greedy),
    then record every head on the source and that translation."""
    src_ids = [*tokenizer.encode(text), EOS_ID]
    if len(src_ids) == 1:
        raise UsageError("--text: nothing to translate")
    if len(src_ids) > model.cfg.max_positions:
        raise UsageError(
            f"--text: {len(src_ids) - 1} subwords; the model's positions allow "
            f"{model.cfg.max_positions - 1} (and EOS)"
        )
    src = torch.tensor([src_ids], device=device)
    model.eval()
    hyp = beam_search(model, src, decode.beam, decode.alpha, decode.max_len_a, decode.max_len_b)
    out_ids = hyp[0][0].tokens
    tgt_ids = [BOS_ID, *out_ids]
    weights = record_attention(model, src, torch.tensor([tgt_ids], device=device))
    source, target = side_tokenizers(tokenizer)  # one model, or a separate pair
    return AttentionMaps(
        source_ids=src_ids,
        target_ids=tgt_ids,
        source_tokens=[source.id_to_piece(i) for i in src_ids],
        target_tokens=[target.id_to_piece(i) for i in tgt_ids],
        translation=tokenizer.decode(out_ids),
        weights=weights,
    )


def find_word(tokens: list[str], word: str) -> int:
    """The 0-based position of `word` among the source tokens: a 1-based number, or a
    subword as the tokenizer writes it, with or without its "▁" (the first match)."""
    if word.isdigit():
        if not 1 <= int(word) <= len(tokens):
            raise UsageError(f"--word {word}: the source has tokens 1..{len(tokens)}")
        return int(word) - 1
    for i, token in enumerate(tokens):
        if word in (token, token.lstrip("\u2581")):
            return i
    raise UsageError(f"--word {word!r}: not a source token; they are: {' '.join(tokens)}")


def _pick(value: int | None, count: int, flag: str) -> list[int]:
    """The 0-based indices --layer / --head select: one (1-based on the command line) or all."""
    if value is None:
        return list(range(count))
    if not 1 <= value <= count:
        raise UsageError(f"{flag} {value}: the model has 1..{count}")
    return [value - 1]


def draw(
    maps: AttentionMaps,
    out: Path,
    *,
    layer: int | None = None,
    head: int | None = None,
    word: str | None = None,
) -> list[Path]:
    """The PNGs: per layer, a heat-map grid of the heads of each kind
    (`{kind}_layer{L}.png`), the encoder heads' attention as lines from every word
    (`encoder_lines_layer{L}.png`, Figures 4-5), and with `word` that word's attention
    across heads, a colour per head (`word_layer{L}.png`, Figure 3). `layer` and `head`
    (1-based) restrict them to one."""
    w = maps.weights
    layers = _pick(layer, len(w["encoder_self"]), "--layer")
    heads = _pick(head, w["encoder_self"][0].size(0), "--head")
    query = None if word is None else find_word(maps.source_tokens, word)
    src, tgt = maps.source_tokens, maps.target_tokens
    axes = {"encoder_self": (src, src), "decoder_self": (tgt, tgt), "encoder_decoder": (tgt, src)}
    files = []
    for n in layers:
        for kind, (rows, cols) in axes.items():
            title = f"{TITLES[kind]}, layer {n + 1}"
            files.append(
                plots.plot_heads(
                    w[kind][n], rows, cols, heads, title, out / f"{kind}_layer{n + 1}.png"
                )
            )
        title = f"encoder self-attention, layer {n + 1}: every word"
        files.append(
            plots.plot_head_lines(
                w["encoder_self"][n], src, heads, title, out / f"encoder_lines_layer{n + 1}.png"
            )
        )
        if query is not None:
            title = f"encoder self-attention, layer {n + 1}: {src[query]!r} (token {query + 1})"
            files.append(
                plots.plot_word(
                    w["encoder_self"][n], src, query, heads, title, out / f"word_layer{n + 1}.png"
                )
            )
    return files


def write_json(maps: AttentionMaps, path: Path) -> Path:
    """The tokens, the translation and every weight (float32 values, as the model
    computed them) as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(maps.to_dict()) + "\n")
    return path


def run_attention(
    checkpoint: Path,
    text: str,
    out: Path,
    *,
    layer: int | None = None,
    head: int | None = None,
    word: str | None = None,
    numbers: bool = False,
    beam: int | None = None,
    dtype: str = "fp32",
    device: str = "cpu",
) -> dict[str, Any]:
    """`aiayn attention`: load the checkpoint (its tokenizer and decoding options), translate
    `text` with beam `beam` (default: the checkpoint's), draw the PNGs into `out`, and with
    `numbers` write out/attention.json. Returns the translation, the tokens and the files."""
    from aiayn.checkpoints import load_ensemble
    from aiayn.fast.machine import cast_for_inference

    models, tokenizer, cfg = load_ensemble([checkpoint], device=device)
    model = cast_for_inference(models[0], dtype)
    decode = cfg.decode if beam is None else dataclasses.replace(cfg.decode, beam=beam, nbest=1)
    decode.validate()
    maps = attention_maps(model, tokenizer, text, decode, device)
    files = draw(maps, out, layer=layer, head=head, word=word)
    if numbers:
        files.append(write_json(maps, out / "attention.json"))
    return {
        "translation": maps.translation,
        "source_tokens": maps.source_tokens,
        "target_tokens": maps.target_tokens,
        "files": [str(f) for f in files],
    }
