"""Export an aiayn model to CTranslate2, the inference engine users deploy NMT models with.

The paper's Transformer maps one to one onto CTranslate2's post-norm `TransformerSpec` (and
a `model.norm = "pre"` model onto its pre-norm one, final LayerNorms included):
fused Q/K/V (self-attention) and K/V (encoder-decoder attention) projections without
biases, LayerNorm after each residual, the sinusoidal table added to embeddings scaled by
sqrt(d_model), one matrix for both embeddings and the pre-softmax projection. The export
lets `benchmarks/compare.py` run CTranslate2 on exactly aiayn's weights, and lets a user
serve a trained checkpoint with it. The LayerNorm epsilon is carried over from the model.
In float32 the converted model's sentence log-probabilities agree with aiayn's to within
1e-4 (tests/deploy/test_export.py; 3e-6 measured on its copy model).

`export_ctranslate2` (`aiayn export --to ctranslate2`) exports a checkpoint so that plain
`ctranslate2.Translator(DIR).translate_batch(pieces, beam_size=1, min_decoding_length=0)`
translates as `aiayn translate --beam 1` does, token for token:

- the vocabulary is the checkpoint's sentencepiece pieces at aiayn's ids, and the
  sentencepiece model is copied into DIR as `sentencepiece.model` (the source is
  `sp.encode(text, out_type=str)`, the output `sp.decode(pieces)`);
- aiayn's source is the subwords followed by EOS: the model's `config.json` says
  `add_source_eos`, so CTranslate2 appends `</s>` itself (a caller must not add it);
- aiayn never generates PAD or BOS. CTranslate2 4.x reads no list of forbidden tokens
  from a model directory (`suppress_sequences` is an option of each call only; its
  `config.json` has only the special tokens and `add_source_bos`/`add_source_eos`), so
  the export gives the output layer a bias of `NEVER_BIAS` (-1e4) at those two ids and 0
  elsewhere: their probability is exp(-1e4) = 0 in float32, float16 and bfloat16 alike.
  This is what `suppress_sequences=[["<blank>"], ["<s>"]]` does per call: CTranslate2
  masks the logits before its log-softmax, so the other tokens' probabilities are
  renormalized in both cases (aiayn keeps PAD's and BOS's mass in the normalizer; greedy
  search is unaffected, beam scores shift by that mass, log(1 - p(PAD) - p(BOS))).

What no configuration can carry (DIR's README.md says so): the minimum length, the length
cap and the length penalty. aiayn allows an empty output, CTranslate2 by default not
(`min_decoding_length=1`: the documented call passes 0). aiayn caps each output at
floor(max_len_a * (subwords + 1) + max_len_b) tokens, CTranslate2 at one
`max_decoding_length` per call (default 256). aiayn's beam search divides by GNMT's
((5 + |Y|) / 6) ** alpha, CTranslate2's by |Y| ** length_penalty, and it refills the beam
from 2 x beam candidates where aiayn leaves a finished slot empty for a step.
`ct2_translate` passes each sentence its aiayn cap (so greedy outputs are equal even where
a model loops) and alpha as the length penalty; beam outputs agree on most lines, not all
(docs/deploy.md gives the measured rates).
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from aiayn.decoding.search import NEVER_GENERATED
from aiayn.model import Transformer, sinusoidal_positions

if TYPE_CHECKING:
    from aiayn.config import Config
    from aiayn.data.tokenizer import Vocabulary

SPECIAL = {PAD_ID: "<blank>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}

#: The output-layer bias that keeps a token from ever being generated: exp(-1e4) is 0 in
#: every float type, and -1e4 is finite in float16 (whose largest magnitude is 65504).
NEVER_BIAS = -1e4

#: The file in an export directory that says what was exported and how to call it.
EXPORT_INFO = "aiayn_export.json"

#: The sentencepiece model's name in a CTranslate2 export directory.
CT2_SPM = "sentencepiece.model"
#: The target side's model, where the vocabularies are separate (prepare --vocab separate).
CT2_SPM_TARGET = "sentencepiece.target.model"

#: CTranslate2's quantization types (`ctranslate2.Translator(compute_type=...)` too).
CT2_QUANTIZATIONS = (
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)


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
    *,
    add_source_eos: bool = False,
    never_generate: Sequence[int] = (),
    target_tokens: list[str] | None = None,
) -> Path:
    """Write `model` as a CTranslate2 model directory and return its path.

    tokens: one string per id (default: `vocabulary(vocab_size)`); quantization: as in
    CTranslate2's converters ("int8", "bfloat16", ...), or None for float32 weights.
    add_source_eos: CTranslate2 appends `</s>` to each source itself (aiayn's sources end
    in EOS); False: callers pass it. never_generate: ids given the output bias NEVER_BIAS,
    so that no search ever picks them (`export_ctranslate2` passes PAD and BOS); empty:
    the output layer has no bias and scores are aiayn's log-probabilities exactly.
    target_tokens: the target side's strings where the vocabularies are separate
    (default: `tokens`, one shared vocabulary).
    """
    import ctranslate2.specs.transformer_spec as ts

    cfg = model.cfg
    if cfg.positional != "sinusoidal":
        raise ValueError("CTranslate2 export needs sinusoidal positions (learned: Table 3 E)")
    if cfg.h * cfg.d_k != cfg.d_model or cfg.h * cfg.d_v != cfg.d_model:
        raise ValueError("CTranslate2 needs h * d_k == h * d_v == d_model")
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    # model.norm "pre" is CTranslate2's pre_norm: the same LayerNorms read before each
    # sublayer, and a final one ending each stack
    spec = ts.TransformerSpec.from_config((cfg.N, cfg.N), cfg.h, pre_norm=cfg.norm == "pre")
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
    if cfg.norm == "pre":
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")
    linear(spec.decoder.projection, "generator")
    if never_generate:
        bias = torch.zeros(cfg.vocab_size)
        bias[list(never_generate)] = NEVER_BIAS
        spec.decoder.projection.bias = bias.numpy()

    tokens = tokens if tokens is not None else vocabulary(cfg.vocab_size)
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(target_tokens if target_tokens is not None else tokens)
    spec.config.unk_token, spec.config.bos_token = SPECIAL[UNK_ID], SPECIAL[BOS_ID]
    spec.config.eos_token, spec.config.decoder_start_token = SPECIAL[EOS_ID], SPECIAL[BOS_ID]
    spec.config.add_source_eos = add_source_eos
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


# --------------------------------------------------------------------------- checkpoints
def load_for_export(checkpoint: str | Path) -> tuple[Transformer, Vocabulary, Config]:
    """The paper's model (without the speed paths), its vocabulary and config, in float32."""
    from aiayn.checkpoints import CheckpointError, load_model

    model, tokenizer, cfg = load_model(checkpoint, fast=False)
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise CheckpointError(
            f"{checkpoint}: its vocabulary has {tokenizer.vocab_size} pieces, its model "
            f"{model.cfg.vocab_size} rows"
        )
    return model.float().eval(), tokenizer, cfg


def write_export(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` on a new directory beside `out_dir`, then move its files into
    `out_dir`: a failed export leaves no half-written directory behind (`out_dir` is
    created if missing; files of the same names in it are replaced, others are kept)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.mkdir()  # with the umask's permissions, which the directory keeps
    except OSError as e:  # a read-only place: say where (the bare error names no path)
        raise OSError(e.errno, f"cannot write the export in {out.parent}: {e.strerror}") from e
    try:
        try:
            write(tmp)
        except (OSError, RuntimeError) as e:  # a full disk: CTranslate2 says "failed", not where
            why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0][:200]
            raise OSError(
                getattr(e, "errno", None) or errno.EIO, f"export to {out} failed: {why}"
            ) from e
        if not out.exists():
            os.replace(tmp, out)
            return out
        for f in sorted(tmp.iterdir()):
            target = out / f.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)  # only a folder of the export's own (none today)
            os.replace(f, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_info(
    engine: str, checkpoint: str | Path, tokenizer: Vocabulary, cfg: Config, **extra: Any
) -> dict[str, Any]:
    """The content of `aiayn_export.json`: what was exported and aiayn's decoding settings."""
    from aiayn.data.tokenizer import PairTokenizer

    d = cfg.decode
    return {
        "format": "aiayn-export-1",
        "engine": engine,
        "checkpoint": Path(checkpoint).name,
        "vocab_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "vocab": "separate" if isinstance(tokenizer, PairTokenizer) else "shared",
        "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
        "never_generated": list(NEVER_GENERATED),
        "source": "the sentencepiece pieces of the text, then </s>",
        "max_positions": cfg.model.max_positions,
        "decode": {
            "beam": d.beam,
            "alpha": d.alpha,
            "max_len_a": d.max_len_a,
            "max_len_b": d.max_len_b,
            "max_input_len": d.max_input_len,
            "length_cap": "floor(max_len_a * (subwords + 1) + max_len_b) output tokens",
            "length_penalty": "aiayn: log P / ((5 + |Y|) / 6) ** alpha (GNMT)",
        },
        **extra,
    }


CT2_README = """\
# {name}: an aiayn model for CTranslate2

Exported by `aiayn export --to ctranslate2` from `{checkpoint}` ({quantization} weights).

```python
import ctranslate2
import sentencepiece as spm

sp = spm.SentencePieceProcessor(model_file="{name}/sentencepiece.model")
translator = ctranslate2.Translator("{name}")
texts = ["A man rides a bike."]
results = translator.translate_batch(
    [sp.encode(t, out_type=str) for t in texts], beam_size=1, min_decoding_length=0
)
print([sp.decode(r.hypotheses[0]) for r in results])
```

- The source is the sentencepiece pieces alone: `config.json` has `add_source_eos`, so
  CTranslate2 appends `</s>` as aiayn does. Do not add it yourself.
- `<s>` and `<blank>` (padding) are never generated: the output layer has a bias of -1e4
  at their ids, the same as passing `suppress_sequences=[["<blank>"], ["<s>"]]`.
- `beam_size=1` gives aiayn's greedy output (`aiayn translate --beam 1`) token for token{exact}.
  What a directory cannot carry: `min_decoding_length=0` (CTranslate2's default of 1 forbids
  the empty output aiayn allows), and aiayn's length cap, floor({a:g} x (pieces + 1) + {b:g})
  output tokens per sentence, where CTranslate2 has one `max_decoding_length` per call
  (default 256): that matters only for an output that never ends.
- Beam search: `beam_size={beam}, length_penalty={alpha}` is the closest to aiayn's
  (beam {beam}, alpha {alpha}), not the same: CTranslate2 divides by |Y| ** alpha where
  aiayn divides by GNMT's ((5 + |Y|) / 6) ** alpha, and refills its beam differently.
- `aiayn.deploy.export.ct2_translate("{name}", texts, beam=1)` does all of the above,
  with each sentence's own length cap.

`aiayn_export.json` records the checkpoint, its vocabulary's sha256 and aiayn's decoding
settings.
"""


def export_ctranslate2(
    checkpoint: str | Path, out_dir: str | Path, quantization: str | None = None
) -> Path:
    """`aiayn export --to ctranslate2`: the checkpoint's model as a CTranslate2 directory
    with its vocabulary, `sentencepiece.model`, `aiayn_export.json` and a README.md saying
    how to call it (see the module docstring). Returns the directory."""
    if quantization is not None and quantization not in CT2_QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r}: CTranslate2 has {', '.join(CT2_QUANTIZATIONS)}"
        )
    from aiayn.data.tokenizer import PairTokenizer, side_tokenizers

    model, tokenizer, cfg = load_for_export(checkpoint)
    src_tok, tgt_tok = side_tokenizers(tokenizer)
    tokens, target_tokens = (
        vocabulary(t.vocab_size, [t.id_to_piece(i) for i in range(t.vocab_size)])
        for t in (src_tok, tgt_tok)
    )
    separate = isinstance(tokenizer, PairTokenizer)
    out = Path(out_dir)

    def write(tmp: Path) -> None:
        to_ctranslate2(
            model,
            tmp,
            tokens,
            quantization,
            add_source_eos=True,
            never_generate=NEVER_GENERATED,
            target_tokens=target_tokens if separate else None,
        )
        # the source's model; separate vocabularies also have the target's, to decode with
        (tmp / CT2_SPM).write_bytes(src_tok.to_bytes())
        if separate:
            (tmp / CT2_SPM_TARGET).write_bytes(tgt_tok.to_bytes())
        info = export_info(
            "ctranslate2",
            checkpoint,
            tokenizer,
            cfg,
            quantization=quantization or "float32",
            sentencepiece=CT2_SPM,
            **({"sentencepiece_target": CT2_SPM_TARGET} if separate else {}),
            translate_batch={"beam_size": 1, "min_decoding_length": 0},
        )
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        d = cfg.decode
        exact = ""
        if quantization not in (None, "float32"):
            exact = f" in float32; {quantization} weights give outputs close to those, not equal"
        readme = CT2_README.format(
            exact=exact,
            name=out.name,
            checkpoint=Path(checkpoint).name,
            quantization=quantization or "float32",
            a=d.max_len_a,
            b=d.max_len_b,
            beam=d.beam,
            alpha=d.alpha,
        )
        (tmp / "README.md").write_text(readme, encoding="utf-8")

    return write_export(out, write)


# --------------------------------------------------------------------------- translating
def length_caps(
    lengths: Sequence[int], max_len_a: float, max_len_b: float, max_positions: int | None
) -> list[int]:
    """aiayn's output cap per sentence (`aiayn.decoding.search.output_caps`) from the
    number of source subwords, EOS not counted."""
    caps = []
    for n in lengths:
        cap = max(1, math.floor(max_len_a * (n + 1) + max_len_b))
        caps.append(cap if max_positions is None else min(cap, max_positions))
    return caps


def cap_groups(caps: Sequence[int], beam: int) -> dict[int, list[int]]:
    """Sentences (indexes into `caps`) to decode together, by the cap to decode them with.

    A greedy output under a cap is the first cap tokens of its output under a larger
    one, so greedy search decodes all at the largest cap (the caller cuts each output to
    its own); a beam search ends hypotheses at the cap, so each cap is its own group.
    """
    if beam == 1:
        return {max(caps): list(range(len(caps)))} if caps else {}
    groups: dict[int, list[int]] = {}
    for i, cap in enumerate(caps):
        groups.setdefault(cap, []).append(i)
    return groups


def read_export_info(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / EXPORT_INFO
    if not path.is_file():
        raise ValueError(f"{model_dir}: no {EXPORT_INFO}; not a directory `aiayn export` wrote")
    info: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return info


def target_sentencepiece(model_dir: str | Path, info: dict[str, Any]) -> Any:
    """The target side's sentencepiece model of an export with separate vocabularies
    (`info["sentencepiece_target"]`), or None where one model serves both sides."""
    import sentencepiece as spm

    name = info.get("sentencepiece_target")
    return (
        None if name is None else spm.SentencePieceProcessor(model_file=str(Path(model_dir) / name))
    )


def ct2_translate(
    model_dir: str | Path,
    lines: Sequence[str],
    *,
    beam: int = 1,
    alpha: float | None = None,
    max_len_a: float | None = None,
    max_len_b: float | None = None,
    translator: Any = None,
    **options: Any,
) -> list[str]:
    """Translate `lines` with a directory `export_ctranslate2` wrote, as aiayn would.

    The source is the sentencepiece pieces (the model adds `</s>`), truncated as aiayn
    truncates; no minimum length (CTranslate2's default is 1); each sentence gets
    aiayn's length cap (defaults: the checkpoint's max_len_a and max_len_b, from
    aiayn_export.json), which no model directory can carry; `alpha` (default: the
    checkpoint's) is passed as CTranslate2's length penalty, the nearest to aiayn's (not
    the same: beam outputs may differ). A blank line gives "" (as in aiayn). `translator`:
    an open `ctranslate2.Translator` of `model_dir` (default: one on the CPU, float32);
    `options` go to `translate_batch`. With beam=1 the outputs are aiayn's greedy ones.
    """
    import ctranslate2
    import sentencepiece as spm

    info = read_export_info(model_dir)
    d = info["decode"]
    a = d["max_len_a"] if max_len_a is None else max_len_a
    b = d["max_len_b"] if max_len_b is None else max_len_b
    penalty = d["alpha"] if alpha is None else alpha
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / info["sentencepiece"]))
    sp_out = target_sentencepiece(model_dir, info) or sp
    if translator is None:
        translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type="float32")
    limit = min(d["max_input_len"], info["max_positions"] - 1)  # as aiayn truncates
    pieces = [sp.encode(line, out_type=str)[:limit] if line.strip() else [] for line in lines]
    kept = [i for i, p in enumerate(pieces) if p]
    out = [""] * len(lines)
    caps = length_caps([len(pieces[i]) for i in kept], a, b, info["max_positions"])
    for cap, rows in cap_groups(caps, beam).items():
        results = translator.translate_batch(
            [pieces[kept[r]] for r in rows],
            **{
                "beam_size": beam,
                "length_penalty": penalty,
                "max_decoding_length": cap,
                "min_decoding_length": 0,  # aiayn allows an empty output
                "max_input_length": 0,  # truncated above, as aiayn truncates
                **options,
            },
        )
        for r, result in zip(rows, results, strict=True):
            out[kept[r]] = str(sp_out.decode(result.hypotheses[0][: caps[r]]))
    return out
