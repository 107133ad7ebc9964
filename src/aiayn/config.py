"""Configuration: the paper's hyperparameters as frozen dataclasses, and the presets of Table 3.

Names follow the paper (section 3, section 5, Table 3): N, d_model, d_ff, h, d_k, d_v, P_drop,
eps_ls, warmup_steps. Only the CLI turns strings into configs (see :func:`apply_overrides`).

Long because it is the one place every setting is written, with its default and a line on
what it is (the CLI's flags are checked against these defaults: tests/test_cli_defaults.py);
the presets of Table 3 sit beside the fields they set.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser (a dependency there only)
    import tomli as tomllib

Positional = Literal["sinusoidal", "learned"]
Norm = Literal["post", "pre"]
DType = Literal["fp32", "bf16", "fp16", "auto"]  # aiayn.training.precision

#: oneDNN's kernel cache as the `aiayn` command sets it (`aiayn.cli.environment`; oneDNN's
#: default is 1,024). On the CPU each bf16 matrix product of a new shape is a kernel compiled
#: once and cached; length-bucketed training batches make several thousand shapes an epoch,
#: so with the default cache every step would recompile its kernels.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 8192

#: Token ids of the shared vocabulary, the same in every run (sentencepiece is trained with them).
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class ConfigError(ValueError):
    """A bad configuration key or value; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture (section 3). Defaults are the paper's base model.

    `vocab_size` is 0 in presets and filled in from the prepared vocabulary.
    """

    N: int = 6  # layers in each of the encoder and decoder stacks
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    d_k: int = 64
    d_v: int = 64
    P_drop: float = 0.1  # residual and embedding dropout (section 5.4)
    # Deviations the paper does not use, off by default (tensor2tensor has both knobs).
    attn_dropout: float = 0.0
    relu_dropout: float = 0.0
    positional: Positional = "sinusoidal"  # "learned" is Table 3 row E
    max_positions: int = 1024  # longest sequence the position table holds
    share_embeddings: bool = True  # one matrix: source, target and pre-softmax (section 3.4)
    # With share_embeddings off: the target embedding and the pre-softmax projection still
    # one matrix (Press and Wolf 2017), as separate vocabularies allow (prepare --vocab
    # separate: training turns it on, and share_embeddings off).
    share_target_embeddings: bool = False
    vocab_size: int = 0
    # Where each sublayer's LayerNorm sits: "post", the paper's LayerNorm(x + Sublayer(x));
    # "pre", x + Sublayer(LayerNorm(x)) with a final LayerNorm ending each stack (Wang et
    # al. 2019, "Learning Deep Transformer Models for MT"; fairseq's --*-normalize-before),
    # stabler at depth and what most train today.
    norm: Norm = "post"

    def validate(self) -> None:
        check_finite("model", self)
        for name in ("N", "d_model", "d_ff", "h", "d_k", "d_v", "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        for name in ("P_drop", "attn_dropout", "relu_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.positional not in ("sinusoidal", "learned"):
            raise ConfigError(
                f"model.positional must be 'sinusoidal' or 'learned', got {self.positional!r}"
            )
        if self.norm not in ("post", "pre"):
            raise ConfigError(f"model.norm must be 'post' or 'pre', got {self.norm!r}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ConfigError("model.d_model must be even for sinusoidal positions")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be >= 0, got {self.vocab_size}")


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe (section 5). Defaults are the paper's base recipe."""

    eps_ls: float = 0.1  # label smoothing (section 5.4)
    warmup_steps: int = 4000
    lr_scale: float = 1.0  # multiplies Eq. 3; 1.0 is the paper
    beta1: float = 0.9
    beta2: float = 0.98
    adam_eps: float = 1e-9
    max_tokens: int = 25000  # per batch and per side, before accumulation (section 5.1)
    update_freq: int = 1  # gradient accumulation: batches per optimizer step
    # The paper's batch as one number, whatever the number of ranks: tokens per side per
    # optimizer step over all ranks and accumulation (section 5.1: ~25,000). The epoch is
    # cut into global batches of this budget (padding included), and each is split into
    # ranks x accumulation slices of equal sentence counts; accumulation is chosen, not
    # given: max(update_freq, ceil(global / (ranks x max_tokens))), so that max_tokens
    # stays a per-rank memory cap and update_freq a floor. Then 8 ranks, 4 ranks x 2 and
    # 1 rank x 8 read the same sentences each step, and a resume on another number of
    # ranks is exact in data (aiayn.training.epochs). 0 = off: max_tokens is per rank
    # and per batch, and the step's batch grows with the ranks.
    global_batch_tokens: int = 0
    max_steps: int = 100_000
    max_minutes: float = 0.0  # wall-clock budget for training; 0 = none
    clip_norm: float = 0.0  # 0 = no clipping (the paper does not clip)
    save_interval_steps: int = 0  # 0 = use save_interval_minutes only
    save_interval_minutes: float = 10.0  # the paper writes checkpoints every 10 minutes
    keep_last: int = 5  # checkpoints kept; the paper averages the last 5 (base)
    valid_interval_steps: int = 1000
    log_interval_steps: int = 50
    max_len: int = 256  # training pairs with a longer side (in subwords) are filtered
    max_len_ratio: float = 9.0  # pairs whose length ratio exceeds this are filtered
    seed: int = 1
    # BPE-dropout (Provilkov et al., 2020; not in the paper, which segments once): every
    # epoch re-segments the training text, each merge step leaving each possible merge out
    # with this probability (data.BPEDropout); 0 = the prepared segmentation. A regulariser
    # for small corpora; validation and decoding never use it. The draws depend on (seed,
    # epoch) only. Measured: docs/results.md, "How the recipe was chosen".
    bpe_dropout: float = 0.0
    # compute precision (autocast; master weights and Adam in fp32): "auto" is what this
    # machine trains fastest in (bf16 on GPUs and CPUs that multiply it natively, fp32 where
    # bf16 would be emulated: aiayn.fast.machine), else "fp32", "bf16" or "fp16"
    dtype: DType = "auto"
    # torch.compile the model's forward (dynamic shapes): fused element-wise kernels and
    # fewer launches, for GPUs (slower on a 2-core CPU). Off by default, as it costs minutes
    # of compiling; measured: docs/performance.md.
    compile: bool = False
    # On the CPU, run every position-wise sublayer (projections, FFN, LayerNorm, dropout)
    # on the real tokens only, not on padding (aiayn.fast.packing.Packing): the same model
    # and gradients, other rounding and dropout draws. On GPUs the padded batch is kept.
    # Measured: docs/performance.md.
    pack_padding: bool = True
    # On the CPU, run parts of the training step in compiled C (aiayn.fast.native): dropout
    # masks from a counter-based generator seeded from PyTorch's (p within 2^-16; other
    # masks, the same distribution) and the loss's pass over the logits (other rounding).
    # The recipes turn it off to reproduce their recorded runs. Measured:
    # docs/performance.md.
    cpu_kernels: bool = True
    # R-Drop (Liang et al., 2021), beyond the paper: every batch passes twice (different
    # dropout masks) and rdrop_alpha x the two predictions' symmetric KL joins the loss
    # (aiayn.training.loss.rdrop_loss); a step costs about twice as much. 0 = off, the
    # paper's objective. Measured: docs/results.md, "How the recipe was chosen".
    rdrop_alpha: float = 0.0
    # Bidirectional training (BiT; Ding et al., 2021), beyond the paper: the first
    # bidirectional_epochs epochs train on every pair in both directions (src->tgt and
    # tgt->src, one shared vocabulary and model, no tags: an epoch is twice as long), the
    # rest on src->tgt only. Ding et al. give the first third of the steps to it.
    # 0 = off, the paper's data.
    bidirectional_epochs: int = 0
    # Word dropout (Sennrich and Zhang, 2019, for low-resource NMT), beyond the paper: each
    # training batch replaces every source token (EOS aside) and every decoder input token
    # (BOS aside) with <unk>, each with this probability; the predicted tokens stay. Drawn
    # from PyTorch's generator after the step's seed, so resumed runs repeat it exactly.
    # 0 = off, the paper's inputs.
    word_dropout: float = 0.0
    # Early stopping: stop after this many validations in a row without a better value of
    # the watched metric, best_metric's (valid BLEU where it is measured, which only the
    # validations with BLEU count), else validation NLL; 0 = never.
    patience: int = 0
    # Watching a long run (aiayn.training.watch), none of it changing the training: every
    # valid_bleu_interval_steps steps (a multiple of valid_interval_steps; 0 = off, as in
    # the recipes) the validation also decodes the first valid_bleu_sentences validation
    # pairs (0 = all) with beam valid_bleu_beam (1 = greedy), output length <=
    # decode.max_len_a x input + decode.max_len_b, and logs their sacreBLEU as valid_bleu.
    valid_bleu_interval_steps: int = 0
    valid_bleu_sentences: int = 500
    valid_bleu_beam: int = 1
    # checkpoint_best.pt, the weights of the best validation so far: by "bleu" (valid
    # BLEU), "ppl" (valid perplexity), "auto" (BLEU where it is measured, else none) or
    # "none". Never deleted by keep_last; the value to beat is in the training state.
    best_metric: str = "auto"
    # TensorBoard event files in RUN/tensorboard/ (rank 0): train_log.jsonl's numbers.
    tensorboard: bool = True
    # Before step 1 (and after a resume), one forward and backward pass over the epoch's
    # largest batches (RELIABILITY C7), so that a batch too big for the device's memory
    # fails at minute 0 with advice, not hours in; no update, and the run is unchanged.
    preflight: bool = True
    # Divergence guard (Marian --throw-on-divergence): the mean loss of the last
    # divergence_short steps above the mean of the divergence_window steps before them by
    # more than divergence_sigma standard deviations. "rollback" reloads the last checkpoint
    # from before the spike and multiplies the learning rate by divergence_lr_factor (at
    # most max_rollbacks times); "stop" ends the run with an error; "off" does nothing.
    divergence: str = "off"
    divergence_window: int = 100
    divergence_short: int = 10
    divergence_sigma: float = 4.0
    divergence_lr_factor: float = 0.5
    max_rollbacks: int = 3

    def validate(self) -> None:
        check_finite("train", self)
        if not 0.0 <= self.eps_ls < 1.0:
            raise ConfigError(f"train.eps_ls must be in [0, 1), got {self.eps_ls}")
        for name in (
            "warmup_steps",
            "max_tokens",
            "update_freq",
            "max_steps",
            "keep_last",
            "valid_interval_steps",
            "log_interval_steps",
            "max_len",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
        for name in ("lr_scale", "adam_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        for name in (
            "max_minutes",
            "clip_norm",
            "save_interval_steps",
            "save_interval_minutes",
            "rdrop_alpha",
            "bidirectional_epochs",
            "global_batch_tokens",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("bpe_dropout", "word_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.max_len_ratio < 1.0:
            raise ConfigError(f"train.max_len_ratio must be >= 1, got {self.max_len_ratio}")
        if self.dtype not in ("fp32", "bf16", "fp16", "auto"):
            raise ConfigError(
                f"train.dtype must be 'fp32', 'bf16', 'fp16' or 'auto', got {self.dtype!r}"
            )
        if self.divergence not in ("off", "rollback", "stop"):
            raise ConfigError(
                f"train.divergence must be 'off', 'rollback' or 'stop', got {self.divergence!r}"
            )
        for name in ("divergence_window", "divergence_short"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be > 0, got {getattr(self, name)}")
        if self.divergence_sigma <= 0:
            raise ConfigError(f"train.divergence_sigma must be > 0, got {self.divergence_sigma}")
        if not 0.0 < self.divergence_lr_factor <= 1.0:
            raise ConfigError(
                f"train.divergence_lr_factor must be in (0, 1], got {self.divergence_lr_factor}"
            )
        for name in ("patience", "max_rollbacks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        self._validate_watch()

    def _validate_watch(self) -> None:
        """The keys of valid BLEU, the best checkpoint and TensorBoard."""
        for name in ("valid_bleu_interval_steps", "valid_bleu_sentences"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.valid_bleu_interval_steps % self.valid_interval_steps:
            raise ConfigError(
                f"train.valid_bleu_interval_steps ({self.valid_bleu_interval_steps}) must be a "
                f"multiple of train.valid_interval_steps ({self.valid_interval_steps}): BLEU "
                "is measured at validations"
            )
        if self.valid_bleu_beam < 1:
            raise ConfigError(f"train.valid_bleu_beam must be >= 1, got {self.valid_bleu_beam}")
        if self.best_metric not in ("auto", "bleu", "ppl", "none"):
            raise ConfigError(
                "train.best_metric must be 'auto', 'bleu', 'ppl' or 'none', got "
                f"{self.best_metric!r}"
            )
        if self.best_metric == "bleu" and not self.valid_bleu_interval_steps:
            raise ConfigError(
                "train.best_metric = 'bleu' needs train.valid_bleu_interval_steps > 0 "
                "(valid BLEU is off)"
            )


@dataclass(frozen=True)
class DecodeConfig:
    """Inference (section 6.1): beam 4, alpha 0.6, output length <= input length + 50."""

    beam: int = 4
    alpha: float = 0.6  # GNMT length penalty ((5 + |Y|) / 6) ** alpha
    max_len_a: float = 1.0  # max output length = max_len_a * input length + max_len_b
    max_len_b: int = 50
    nbest: int = 1
    max_tokens: int = 4000  # source tokens per decoding batch
    max_input_len: int = 1000  # longer inputs are truncated, with a warning naming the line

    def validate(self) -> None:
        check_finite("decode", self)
        if self.beam < 1:
            raise ConfigError(f"decode.beam must be >= 1, got {self.beam}")
        if self.alpha < 0:
            raise ConfigError(f"decode.alpha must be >= 0, got {self.alpha}")
        if not 1 <= self.nbest <= self.beam:
            raise ConfigError(f"decode.nbest must be in [1, beam={self.beam}], got {self.nbest}")
        if self.max_len_a < 0 or self.max_len_b < 1:
            raise ConfigError("decode.max_len_a must be >= 0 and decode.max_len_b >= 1")
        if self.max_tokens < 1 or self.max_input_len < 1:
            raise ConfigError("decode.max_tokens and decode.max_input_len must be >= 1")


@dataclass(frozen=True)
class Config:
    """A preset: model and training settings together, since Table 3 row D changes eps_ls."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def validate(self) -> Config:
        self.model.validate()
        self.train.validate()
        self.decode.validate()
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain dict of plain values: stored in checkpoints (loadable with weights_only)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Any]]) -> Config:
        sections = {f.name: f.type for f in fields(cls)}
        unknown = set(d) - set(sections)
        if unknown:
            raise ConfigError(f"unknown config section(s): {sorted(unknown)}")
        kwargs = {name: _SECTION_TYPES[name](**d.get(name, {})) for name in sections}
        return cls(**kwargs).validate()


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
}

_BASE = Config()


def _row(**model: Any) -> Config:
    return replace(_BASE, model=replace(_BASE.model, **model))


def _row_train(**train: Any) -> Config:
    return replace(_BASE, train=replace(_BASE.train, **train))


#: Presets: the paper's base and big, a CPU-sized tiny, and each Table 3 row as a change of base.
PRESETS: dict[str, Config] = {
    "base": _BASE,
    "big": Config(
        model=ModelConfig(d_model=1024, d_ff=4096, h=16, P_drop=0.3),
        train=replace(_BASE.train, max_steps=300_000),
    ),
    # Small enough to train on Multi30k on a 2-core CPU (not in the paper).
    "tiny": Config(
        model=ModelConfig(N=3, d_model=256, d_ff=1024, h=4, d_k=64, d_v=64, P_drop=0.1),
        train=replace(_BASE.train, warmup_steps=1000, max_tokens=4096, max_steps=10_000),
    ),
    # Section 6.3's parser: 4 layers of d_model 1024, otherwise the base model (d_ff 2048,
    # h = 8, so d_k = d_v = d_model / h = 128); beam 21, alpha 0.3, output length <= input
    # length + 300 (a linearized tree is ~2.5 tokens a word). Training keeps trees up to 512
    # subwords, where translation's 256 would drop the longest sentences' trees.
    "parse": Config(
        model=ModelConfig(N=4, d_model=1024, d_ff=2048, h=8, d_k=128, d_v=128),
        train=replace(_BASE.train, max_len=512),
        decode=replace(_BASE.decode, beam=21, alpha=0.3, max_len_b=300),
    ),
    # (A) number of heads at constant compute
    "A1": _row(h=1, d_k=512, d_v=512),
    "A2": _row(h=4, d_k=128, d_v=128),
    "A3": _row(h=16, d_k=32, d_v=32),
    "A4": _row(h=32, d_k=16, d_v=16),
    # (B) attention key size
    "B1": _row(d_k=16),
    "B2": _row(d_k=32),
    # (C) model size; the paper's row C has seven lines
    "C1": _row(N=2),
    "C2": _row(N=4),
    "C3": _row(N=8),
    "C4": _row(d_model=256, d_k=32, d_v=32),
    "C5": _row(d_model=1024, d_k=128, d_v=128),
    "C6": _row(d_ff=1024),
    "C7": _row(d_ff=4096),
    # (D) regularisation
    "D1": _row(P_drop=0.0),
    "D2": _row(P_drop=0.2),
    "D3": _row_train(eps_ls=0.0),
    "D4": _row_train(eps_ls=0.2),
    # (E) learned positional embedding instead of sinusoids
    "E": _row(positional="learned"),
}


def get_preset(name: str) -> Config:
    """Return a preset by name; an unknown name is an error naming the closest one."""
    if name not in PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
            f"choose from {', '.join(PRESETS)}"
        )
    return PRESETS[name]


def did_you_mean(key: str, candidates: Any) -> str:
    """ " (did you mean 'X'?)" for the known name closest to a mistyped `key`, or "": the one
    hint every configuration reader gives (presets, config keys, [recipe], Table 3 files)."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _all_keys() -> dict[str, tuple[str, type]]:
    """Every settable key, both as 'section.name' and, where unambiguous, as bare 'name'."""
    keys: dict[str, tuple[str, type]] = {}
    bare: dict[str, list[str]] = {}
    for section, typ in _SECTION_TYPES.items():
        for f in fields(typ):
            keys[f"{section}.{f.name}"] = (section, typ)
            bare.setdefault(f.name, []).append(section)
    for name, sections in bare.items():
        if len(sections) == 1:
            keys[name] = (sections[0], _SECTION_TYPES[sections[0]])
    return keys


def check_finite(section: str, obj: Any) -> None:
    """NaN and infinity make sense in no field: a NaN learning-rate scale passes every `<`
    check (all comparisons with NaN are false), trains, and saves NaN weights; an infinite
    budget never ends. Refused, naming the key."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name} must be a finite number, got {value}")


def coerce_value(key: str, current: Any, value: Any) -> Any:
    """Turn a TOML or command-line value into the type of the field it replaces."""
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    try:
        if isinstance(current, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(current, float):
            return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf) from TOML
        raise ConfigError(f"{key} must be a {type(current).__name__}, got {value!r}") from None
    return str(value)


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Apply `key=value` overrides (keys 'section.name' or a bare unambiguous 'name').

    Raises:
        ConfigError: for an unknown key (naming the closest valid one) or a bad value.
    """
    keys = _all_keys()
    sections: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if key not in keys:
            raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, keys)}")
        section, _ = keys[key]
        name = key.split(".")[-1]
        current = getattr(getattr(cfg, section), name)
        sections.setdefault(section, {})[name] = coerce_value(key, current, value)
    new = cfg
    for section, values in sections.items():
        new = replace(new, **{section: replace(getattr(new, section), **values)})
    return new.validate()


def parse_set_args(items: list[str]) -> dict[str, str]:
    """Parse `--set key=value` strings."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


#: Tables an experiment file may hold besides [model], [train] and [decode].
EXTRA_TABLES = ("recipe",)


def load_experiment(path: str | Path) -> tuple[Config, dict[str, Any]]:
    """Read an experiment file: `preset = "tiny"` plus [model]/[train]/[decode] overrides.

    Returns the resolved config and the file's [recipe] table ({} if it has none). Any
    other table is an error naming the closest known one: a misspelt [trian] must not
    leave its settings silently unused.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {path}: is a directory, not an experiment file")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg = get_preset(str(doc.pop("preset", "base")))
    overrides: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _SECTION_TYPES and isinstance(value, dict):
            overrides.update({f"{key}.{k}": v for k, v in value.items()})
        elif key in EXTRA_TABLES and isinstance(value, dict):
            extra[key] = value
        else:
            what = "table" if isinstance(value, dict) else "top-level key"
            raise ConfigError(
                f"{path}: unknown {what} {key!r}"
                f"{did_you_mean(key, [*_SECTION_TYPES, *EXTRA_TABLES, 'preset'])}"
            )
    try:
        return apply_overrides(cfg, overrides), extra
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
