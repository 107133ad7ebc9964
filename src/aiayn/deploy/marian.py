"""Export an aiayn model to Hugging Face transformers' MarianMT (`aiayn export --to marian`).

MarianMT is the paper's Transformer as Hugging Face runs it: post-norm encoder and decoder
layers, ReLU feed-forward layers (set by the config), embeddings scaled by sqrt(d_model)
(`scale_embedding`), a sinusoidal table added to them, one matrix shared by the source and
target embeddings and the output layer. The export writes a directory that
`MarianMTModel.from_pretrained(DIR)` and `MarianTokenizer.from_pretrained(DIR)` load:
`config.json`, `generation_config.json`, `model.safetensors`, `source.spm` and
`target.spm` (both the checkpoint's sentencepiece model), `vocab.json`,
`tokenizer_config.json`, and `aiayn_export.json` and a README.md saying how to call it.

How aiayn's model maps onto Marian's, exactly:

- Positions. Marian's table puts the sines in the first half of the coordinates and the
  cosines in the second (`MarianSinusoidalPositionalEmbedding`), aiayn's interleaves them
  (`aiayn.model.sinusoidal_positions`: sin at 2i, cos at 2i+1), with the same frequencies.
  Marian's coordinate m is aiayn's `marian_order(d_model)[m]`, and the export permutes
  the d_model coordinates of the whole model that way: the columns of the embeddings and
  of every matrix that reads the residual stream, the rows (and biases) of every matrix
  that writes it, each LayerNorm's gain and bias. LayerNorm, the attention scores and ReLU do not
  depend on the order of the coordinates, so the function is the same. Both tables start
  at position 0 (Marian has no padding offset), the decoder's start symbol included.
- Projections. aiayn's fused self-attention `w_qkv` is split into Marian's q, k and v
  projections, the encoder-decoder `w_kv` into k and v; both have heads laid out the same
  way (h blocks of d_k). Marian's projections have biases: zero. `final_logits_bias`: 0.
- LayerNorm epsilon: both 1e-5 (`torch.nn.LayerNorm`'s default; Marian's is fixed there),
  so the export is exact; a model with another epsilon is refused.
- Special ids. `vocab.json` maps each sentencepiece piece to its aiayn id (pad 0, unk 1,
  <s> 2, </s> 3); `MarianTokenizer` encodes with `source.spm` and appends `</s>`, which
  is aiayn's source (subwords, then EOS). The decoder starts from <s> (aiayn's BOS:
  `decoder_start_token_id` 2, where Marian's own models reuse the padding id), padding is
  id 0, and `forced_eos_token_id` is unset (aiayn ends a capped output without EOS).
- Never generated: `generation_config.json` has `bad_words_ids` [[0], [2]] (padding, <s>).
  transformers applies it after the log-softmax in beam search, so the other tokens keep
  aiayn's log-probabilities (the normalizer still covers every token, as in aiayn).

What differs: greedy search (`num_beams=1`) is aiayn's, token for token (fp32; a length
cap aside, see below). Beam search is not: transformers divides a hypothesis' log P by
|Y| ** length_penalty (|Y| counting the EOS), aiayn by GNMT's ((5 + |Y|) / 6) ** alpha,
and transformers refills its beam from 2 x num_beams candidates where aiayn leaves a
finished slot empty for one step; the export sets length_penalty = alpha, the nearest.
aiayn caps each output at floor(max_len_a * (subwords + 1) + max_len_b) tokens, `generate`
at one `max_new_tokens` per call (the export's default: 256): `marian_translate` passes
each sentence its own cap. `MarianTokenizer.decode(..., skip_special_tokens=True)` drops
<unk>, where aiayn writes " ⁇ ": `marian_translate` decodes with sentencepiece as aiayn
does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.decoding.search import NEVER_GENERATED
from aiayn.deploy.export import (
    EXPORT_INFO,
    cap_groups,
    export_info,
    length_caps,
    load_for_export,
    read_export_info,
    write_export,
)
from aiayn.model import Transformer

if TYPE_CHECKING:
    from aiayn.config import Config
    from aiayn.data.tokenizer import Vocabulary

#: Marian's LayerNorm epsilon (`torch.nn.LayerNorm`'s default, fixed in its layers).
MARIAN_LAYER_NORM_EPS = 1e-5

#: `max_new_tokens` in the export's generation_config.json (CTranslate2's default cap too).
MAX_NEW_TOKENS = 256


def marian_order(d_model: int) -> Tensor:
    """Marian's coordinate m holds aiayn's coordinate `marian_order(d)[m]`: the even ones
    (aiayn's sines), then the odd ones (its cosines)."""
    if d_model % 2:
        raise ValueError(f"d_model must be even, got {d_model}")
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_config(model: Transformer, decode: Any = None) -> Any:
    """The `MarianConfig` of an aiayn model (refusing what Marian cannot express)."""
    from transformers import MarianConfig

    cfg = model.cfg
    if cfg.positional != "sinusoidal":
        raise ValueError("Marian export needs sinusoidal positions (learned: Table 3 E)")
    if cfg.h * cfg.d_k != cfg.d_model or cfg.h * cfg.d_v != cfg.d_model:
        raise ValueError("Marian needs h * d_k == h * d_v == d_model")
    if cfg.norm != "post":
        raise ValueError(
            f"Marian export needs model.norm = 'post': this model is {cfg.norm}-norm, and "
            "Hugging Face's MarianMT has post-norm layers only; --to ctranslate2 takes it"
        )
    eps = {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    if eps != {MARIAN_LAYER_NORM_EPS}:
        raise ValueError(
            f"Marian's LayerNorm epsilon is {MARIAN_LAYER_NORM_EPS}, the model's {eps}"
        )
    return MarianConfig(
        vocab_size=cfg.vocab_size,
        decoder_vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_positions,
        encoder_layers=cfg.N,
        decoder_layers=cfg.N,
        encoder_attention_heads=cfg.h,
        decoder_attention_heads=cfg.h,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        d_model=cfg.d_model,
        activation_function="relu",
        dropout=cfg.P_drop,
        attention_dropout=cfg.attn_dropout,
        activation_dropout=cfg.relu_dropout,
        scale_embedding=True,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.share_embeddings or cfg.share_target_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=None,
    )


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """aiayn's weights under MarianMTModel's names, d_model coordinates in Marian's order."""
    cfg = model.cfg
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    order = marian_order(cfg.d_model)
    d = cfg.h * cfg.d_k
    out: dict[str, Tensor] = {}

    def reads(w: Tensor) -> Tensor:  # a matrix whose input is the residual stream
        return w[:, order].contiguous()

    def writes(w: Tensor) -> Tensor:  # a matrix (or bias) whose output is the residual stream
        return w[order].contiguous()

    def linear(name: str, weight: Tensor, bias: Tensor | None = None) -> None:
        out[f"{name}.weight"] = weight
        out[f"{name}.bias"] = bias if bias is not None else torch.zeros(weight.size(0))

    def norm(name: str, ours: str) -> None:
        out[f"{name}.weight"] = writes(sd[f"{ours}.weight"])
        out[f"{name}.bias"] = writes(sd[f"{ours}.bias"])

    def ffn(name: str, ours: str) -> None:
        linear(f"{name}.fc1", reads(sd[f"{ours}.w_1.weight"]), sd[f"{ours}.w_1.bias"])
        linear(f"{name}.fc2", writes(sd[f"{ours}.w_2.weight"]), writes(sd[f"{ours}.w_2.bias"]))

    def self_attention(name: str, ours: str) -> None:
        q, k, v = sd[f"{ours}.w_qkv.weight"].split([d, d, d])
        linear(f"{name}.q_proj", reads(q))
        linear(f"{name}.k_proj", reads(k))
        linear(f"{name}.v_proj", reads(v))
        linear(f"{name}.out_proj", writes(sd[f"{ours}.w_o.weight"]))

    src = reads(sd["src_embed.token.weight"])
    tgt = reads(sd["tgt_embed.token.weight"])
    if cfg.share_embeddings:
        out["model.shared.weight"] = src
    out["model.encoder.embed_tokens.weight"] = src
    out["model.decoder.embed_tokens.weight"] = tgt
    out["lm_head.weight"] = reads(sd["generator.weight"])
    out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    for i in range(cfg.N):
        p, ours = f"model.encoder.layers.{i}", f"encoder.{i}"
        self_attention(f"{p}.self_attn", f"{ours}.self_attn")
        norm(f"{p}.self_attn_layer_norm", f"{ours}.norm1")
        ffn(p, f"{ours}.ffn")
        norm(f"{p}.final_layer_norm", f"{ours}.norm2")
    for i in range(cfg.N):
        p, ours = f"model.decoder.layers.{i}", f"decoder.{i}"
        self_attention(f"{p}.self_attn", f"{ours}.self_attn")
        norm(f"{p}.self_attn_layer_norm", f"{ours}.norm1")
        kw, vw = sd[f"{ours}.cross_attn.w_kv.weight"].split([d, d])
        linear(f"{p}.encoder_attn.q_proj", reads(sd[f"{ours}.cross_attn.w_q.weight"]))
        linear(f"{p}.encoder_attn.k_proj", reads(kw))
        linear(f"{p}.encoder_attn.v_proj", reads(vw))
        linear(f"{p}.encoder_attn.out_proj", writes(sd[f"{ours}.cross_attn.w_o.weight"]))
        norm(f"{p}.encoder_attn_layer_norm", f"{ours}.norm2")
        ffn(p, f"{ours}.ffn")
        norm(f"{p}.final_layer_norm", f"{ours}.norm3")
    return out


def to_marian_model(model: Transformer) -> Any:
    """A `MarianMTModel` (eval mode, float32) computing what `model` computes."""
    from transformers import MarianMTModel

    hf = MarianMTModel(marian_config(model))
    theirs = hf.state_dict()
    ours = marian_state_dict(model)
    unknown = sorted(set(ours) - set(theirs))
    missing = sorted(k for k in set(theirs) - set(ours) if "embed_positions" not in k)
    if unknown or missing:  # a transformers release that renamed its layers
        raise ValueError(
            f"MarianMTModel's weights differ from the export's: missing {missing[:3]}, "
            f"unknown {unknown[:3]}"
        )
    for key, value in ours.items():
        if theirs[key].shape != value.shape:
            raise ValueError(
                f"{key}: shape {tuple(value.shape)}, Marian's {tuple(theirs[key].shape)}"
            )
    hf.load_state_dict(ours, strict=False)  # the sinusoidal tables are Marian's own
    return hf.eval()


def generation_config(decode: Any) -> Any:
    """aiayn's decoding settings as far as `generate` has them (see the module docstring)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=None,
        bad_words_ids=[[t] for t in NEVER_GENERATED],
        num_beams=decode.beam,
        length_penalty=decode.alpha,
        max_new_tokens=MAX_NEW_TOKENS,
    )


def write_tokenizer(tokenizer: Vocabulary, out: Path) -> None:
    """source.spm, target.spm, vocab.json (piece -> aiayn id) and tokenizer_config.json;
    with separate vocabularies (`PairTokenizer`) each side's model, and the target's
    pieces in target_vocab.json (MarianTokenizer's `separate_vocabs`)."""
    from transformers import MarianTokenizer

    from aiayn.data.tokenizer import PairTokenizer, side_tokenizers

    sides = dict(zip(("source", "target"), side_tokenizers(tokenizer), strict=True))
    separate = isinstance(tokenizer, PairTokenizer)
    for side, tok in sides.items():
        (out / f"{side}.spm").write_bytes(tok.to_bytes())
        vocab = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
        if len(vocab) != tok.vocab_size:
            raise ValueError(f"the {side} vocabulary has duplicate pieces")
        for token, i in (("<pad>", PAD_ID), ("<unk>", UNK_ID), ("</s>", EOS_ID)):
            if vocab.get(token) != i:
                raise ValueError(f"{token} is not id {i} in the {side} vocabulary")
        name = "vocab.json" if side == "source" else "target_vocab.json"
        if side == "source" or separate:
            (out / name).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    hf_tok = MarianTokenizer(
        str(out / "source.spm"),
        str(out / "target.spm"),
        str(out / "vocab.json"),
        target_vocab_file=str(out / "target_vocab.json") if separate else None,
        separate_vocabs=separate,
        unk_token="<unk>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    hf_tok.save_pretrained(str(out))


MARIAN_README = """\
# {name}: an aiayn model for Hugging Face transformers (MarianMT)

Exported by `aiayn export --to marian` from `{checkpoint}` (float32 weights).

```python
from transformers import MarianMTModel, MarianTokenizer

tok = MarianTokenizer.from_pretrained("{name}")
model = MarianMTModel.from_pretrained("{name}").eval()
batch = tok(["A man rides a bike."], return_tensors="pt", padding=True)
out = model.generate(**batch, num_beams=1)
print(tok.batch_decode(out, skip_special_tokens=True))
```

- `num_beams=1` gives aiayn's greedy output (`aiayn translate --beam 1`) token for token.
- The tokenizer appends `</s>` to the source, as aiayn does; the decoder starts from `<s>`
  (`decoder_start_token_id` 2); `<pad>` and `<s>` are never generated
  (`bad_words_ids` in generation_config.json).
- The default search is beam {beam} with `length_penalty={alpha}`, the nearest to aiayn's
  beam {beam}, alpha {alpha}, not the same: transformers divides by |Y| ** alpha where aiayn
  divides by GNMT's ((5 + |Y|) / 6) ** alpha, and refills its beam differently.
- aiayn caps each output at floor({a:g} x (pieces + 1) + {b:g}) tokens; generate at
  `max_new_tokens` ({max_new}), which matters only for an output that never ends.
- `skip_special_tokens=True` drops `<unk>`; aiayn writes it as " ⁇ ".
- `aiayn.deploy.marian.marian_translate("{name}", texts, beam=1)` does all of the above,
  with each sentence's own length cap, and decodes as aiayn does.

`aiayn_export.json` records the checkpoint, its vocabulary's sha256 and aiayn's decoding
settings.
"""


def to_marian(
    model: Transformer, tokenizer: Vocabulary, out_dir: str | Path, cfg: Config, checkpoint: str
) -> Path:
    """Write `model` and `tokenizer` as a MarianMT directory (see the module docstring)."""
    hf = to_marian_model(model)
    out = Path(out_dir)

    def write(tmp: Path) -> None:
        from transformers.utils import logging as hf_logging

        hf.generation_config = generation_config(cfg.decode)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" on stderr, for one file
        try:
            hf.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        write_tokenizer(tokenizer, tmp)
        info = export_info(
            "marian",
            checkpoint,
            tokenizer,
            cfg,
            sentencepiece="source.spm",
            sentencepiece_target="target.spm",
            generate={"num_beams": 1},  # aiayn's greedy search; the default is its beam
        )
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        d = cfg.decode
        readme = MARIAN_README.format(
            name=out.name,
            checkpoint=checkpoint,
            beam=d.beam,
            alpha=d.alpha,
            a=d.max_len_a,
            b=d.max_len_b,
            max_new=MAX_NEW_TOKENS,
        )
        (tmp / "README.md").write_text(readme, encoding="utf-8")

    return write_export(out, write)


def export_marian(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """`aiayn export --to marian`: the checkpoint as a directory that
    `MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load."""
    model, tokenizer, cfg = load_for_export(checkpoint)
    return to_marian(model, tokenizer, out_dir, cfg, Path(checkpoint).name)


# --------------------------------------------------------------------------- translating
def generated_ids(sequences: Tensor) -> list[list[int]]:
    """`generate`'s output rows as aiayn's hypotheses: without the start symbol, cut at
    the first EOS, padding dropped."""
    out = []
    for row in sequences.tolist():
        ids = []
        for t in row[1:]:
            if t == EOS_ID:
                break
            if t != PAD_ID:
                ids.append(t)
        out.append(ids)
    return out


def marian_translate(
    model_dir: str | Path,
    lines: Sequence[str],
    *,
    beam: int = 1,
    alpha: float | None = None,
    max_len_a: float | None = None,
    max_len_b: float | None = None,
    model: Any = None,
    tokenizer: Any = None,
    **options: Any,
) -> list[str]:
    """Translate `lines` with a directory `export_marian` wrote, as aiayn would.

    Each sentence gets aiayn's length cap (defaults: the checkpoint's max_len_a and
    max_len_b, from aiayn_export.json) as `max_new_tokens`; `alpha` (default: the
    checkpoint's) is the length penalty, the nearest to aiayn's (beam outputs may
    differ); the output is decoded with sentencepiece as aiayn decodes (<unk> as " ⁇ ").
    A blank line gives "". `model`, `tokenizer`: already loaded from `model_dir`;
    `options` go to `generate`. With beam=1 the outputs are aiayn's greedy ones.
    """
    import sentencepiece as spm
    from transformers import MarianMTModel, MarianTokenizer

    info = read_export_info(model_dir)
    d = info["decode"]
    a = d["max_len_a"] if max_len_a is None else max_len_a
    b = d["max_len_b"] if max_len_b is None else max_len_b
    penalty = d["alpha"] if alpha is None else alpha
    tok = tokenizer if tokenizer is not None else MarianTokenizer.from_pretrained(str(model_dir))
    hf = model if model is not None else MarianMTModel.from_pretrained(str(model_dir)).eval()
    # aiayn decodes the output with the target side's model (the source's, where shared)
    target = info.get("sentencepiece_target", info["sentencepiece"])
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / target))
    limit = min(d["max_input_len"], info["max_positions"] - 1)  # as aiayn truncates
    sources = [tok(line)["input_ids"][:-1][:limit] + [EOS_ID] for line in lines]
    kept = [i for i, line in enumerate(lines) if line.strip()]
    out = [""] * len(lines)
    caps = length_caps([len(sources[i]) - 1 for i in kept], a, b, info["max_positions"])
    for cap, rows in cap_groups(caps, beam).items():
        ids = [sources[kept[r]] for r in rows]
        longest = max(map(len, ids))
        input_ids = torch.tensor([s + [PAD_ID] * (longest - len(s)) for s in ids])
        with torch.inference_mode():
            generated = hf.generate(
                input_ids=input_ids,
                attention_mask=input_ids != PAD_ID,
                **{
                    "num_beams": beam,
                    "max_new_tokens": cap,
                    **({"length_penalty": penalty} if beam > 1 else {}),
                    **options,
                },
            )
        for r, hyp in zip(rows, generated_ids(generated), strict=True):
            out[kept[r]] = str(sp.decode(hyp[: caps[r]]))
    return out
