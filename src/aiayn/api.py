"""The Python API: what the `aiayn` command does, from Python (docs/api.md).

    import aiayn
    t = aiayn.Translator.load("runs/en-de/checkpoint_avg.pt")
    t.translate(["A man rides a bike."])                # ['Ein Mann fährt Fahrrad.']
    t.translate(["A man rides a bike."], beam=4, nbest=2)  # [[Translation(text, score), x2]]
    t.sample(["A man rides a bike."], n=3, top_p=0.9)   # [[Translation, x3]]
    t.score(["A man rides a bike."], ["Ein Mann fährt Fahrrad."])  # [PairScore]
    aiayn.Parser.load("runs/parse/checkpoint_avg.pt").parse(["The cat sat ."])
    aiayn.train("configs/multi30k-en-de.toml", "data/multi30k-en-de", "runs/en-de")

Each method runs the code the command line runs (`translate`, `score`, `parse`, `train`)
with the same defaults: the checkpoint's decoding options, which are the paper's unless
its config changed them. This module, and the names `aiayn` re-exports from it, are the
public surface; everything else in the package may change between versions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import aiayn.fast  # noqa: F401  # the speed paths on for the library's users (aiayn.speed)
from aiayn.config import Config, DecodeConfig, apply_overrides, get_preset, load_experiment
from aiayn.decoding.sampling import SamplingOptions
from aiayn.decoding.score import PairScore
from aiayn.decoding.translate import Translation
from aiayn.training.state import Hooks, TrainResult

__all__ = ["Parser", "PairScore", "TrainResult", "Translation", "Translator", "train"]

PathLike = str | Path


def _lines(lines: Sequence[str], what: str) -> list[str]:
    """A list of lines; a lone string is refused (it would be read as its characters)."""
    if isinstance(lines, str):
        raise TypeError(f"{what} takes a list of lines, not a str: {what}([text])")
    return list(lines)


class _Loaded:
    """A model (or ensemble) loaded for decoding, its vocabulary, config and device."""

    def __init__(self, model: Any, tokenizer: Any, config: Config, device: str) -> None:
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device

    @classmethod
    def _load(
        cls, path: PathLike | Sequence[PathLike], device: str, dtype: str
    ) -> tuple[Any, Any, Config]:
        from aiayn.checkpoints import load_ensemble
        from aiayn.decoding.ensemble import as_decoder
        from aiayn.fast.machine import cast_for_inference

        paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
        models, tokenizer, cfg = load_ensemble(paths, device=device)
        model = as_decoder([cast_for_inference(m, dtype) for m in models])
        return model, tokenizer, cfg

    def _decode_config(self, **options: Any) -> DecodeConfig:
        """The checkpoint's decoding options with those given (not None) replaced."""
        given = {k: v for k, v in options.items() if v is not None}
        cfg = dataclasses.replace(self.config.decode, **given)
        cfg.validate()
        return cfg


class Translator(_Loaded):
    """A translation model loaded for decoding: `Translator.load(path)`."""

    @classmethod
    def load(
        cls, path: PathLike | Sequence[PathLike], *, device: str = "cpu", dtype: str = "auto"
    ) -> Translator:
        """Load a checkpoint, verified (several: an ensemble with one vocabulary).

        Args:
            dtype: inference precision: "auto" (this machine's fastest, as `aiayn
                translate --dtype auto`), "fp32", "bf16" or "int8" (CPU).
        Raises:
            CheckpointError naming the file: missing, corrupt, or not an aiayn checkpoint.
        """
        return cls(*cls._load(path, device, dtype), device)

    @overload
    def translate(  # type: ignore[overload-overlap]  # nbest=1 is the common case
        self,
        lines: Sequence[str],
        *,
        beam: int | None = None,
        nbest: Literal[1] = 1,
        alpha: float | None = None,
        max_len_a: float | None = None,
        max_len_b: int | None = None,
        max_tokens: int | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[str]: ...

    @overload
    def translate(
        self,
        lines: Sequence[str],
        *,
        beam: int | None = None,
        nbest: int,
        alpha: float | None = None,
        max_len_a: float | None = None,
        max_len_b: int | None = None,
        max_tokens: int | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[list[Translation]]: ...

    def translate(
        self,
        lines: Sequence[str],
        *,
        beam: int | None = None,
        nbest: int = 1,
        alpha: float | None = None,
        max_len_a: float | None = None,
        max_len_b: int | None = None,
        max_tokens: int | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[str] | list[list[Translation]]:
        """Beam search, as `aiayn translate`: the best translation of each line, in input
        order ("" for a blank line); with nbest > 1, each line's `nbest` best outputs as
        Translation(text, score), best first ([] for a blank line), the score being the
        length-normalised log-probability log P / ((5 + |Y|) / 6) ** alpha.

        Options default to the checkpoint's (the paper's: beam 4, alpha 0.6, output at
        most input + 50 subwords); beam defaults to at least nbest. `prefixes`: one target
        text per line that its outputs begin with (`aiayn translate --prefix`; "" leaves
        the line free).
        """
        from aiayn.decoding.translate import prefix_constraint, translate_nbest

        lines = _lines(lines, "translate")
        if beam is not None and nbest > beam:
            raise ValueError(f"nbest {nbest} > beam {beam}: a beam keeps at most beam outputs")
        cfg = self._decode_config(
            beam=beam if beam is not None else max(self.config.decode.beam, nbest),
            nbest=nbest,
            alpha=alpha,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
            max_tokens=max_tokens,
        )
        constraint_for = None
        if prefixes is not None:
            prefixes = _lines(prefixes, "translate")
            if len(prefixes) != len(lines):
                raise ValueError(f"{len(prefixes)} prefixes for {len(lines)} lines")
            vocab = int(self.tokenizer.vocab_size)
            constraint_for = prefix_constraint(self.tokenizer, prefixes, vocab, self.device)
        outputs, _ = translate_nbest(
            self.model, self.tokenizer, lines, cfg, self.device, constraint_for=constraint_for
        )
        if nbest == 1:
            return [o[0].text if o else "" for o in outputs]
        return outputs

    def sample(
        self,
        lines: Sequence[str],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        max_len_a: float | None = None,
        max_len_b: int | None = None,
    ) -> list[list[Translation]]:
        """`n` outputs of each line drawn from the model (`aiayn.decoding.sampling`):
        temperature, then top-k (0: all), then nucleus top-p (1: all). The same seed gives
        the same samples, however the lines are batched. Each Translation's score is the
        sample's log-probability under the model, length-normalised as the search's."""
        from aiayn.decoding.translate import translate_nbest

        opts = SamplingOptions(n, temperature, top_k, top_p, seed)
        cfg = self._decode_config(max_len_a=max_len_a, max_len_b=max_len_b, nbest=1)
        outputs, _ = translate_nbest(
            self.model, self.tokenizer, _lines(lines, "sample"), cfg, self.device, sampling=opts
        )
        return outputs

    def score(
        self, src: Sequence[str], ref: Sequence[str], *, alpha: float | None = None
    ) -> list[PairScore]:
        """Each (source, reference) pair's log-probability under the model, by teacher
        forcing (`aiayn.decoding.score`): total, per token and length-normalised."""
        from aiayn.decoding.score import score_lines

        cfg = self._decode_config(alpha=alpha)
        return score_lines(
            self.model,
            self.tokenizer,
            _lines(src, "score"),
            _lines(ref, "score"),
            cfg,
            self.device,
        )


class Parser(_Loaded):
    """A constituency parsing model (section 6.3) loaded for decoding: `Parser.load(path)`."""

    @classmethod
    def load(
        cls, path: PathLike | Sequence[PathLike], *, device: str = "cpu", dtype: str = "auto"
    ) -> Parser:
        """Load a parsing checkpoint; see `Translator.load`."""
        return cls(*cls._load(path, device, dtype), device)

    def parse(
        self,
        sentences: Sequence[str | Sequence[str]],
        *,
        beam: int | None = None,
        constrained: bool = True,
        tree_form: Literal["words", "gafl"] = "words",
        word_mass: bool = False,
    ) -> list[str]:
        """A well-formed bracketed tree for each sentence, over exactly its words, as
        `aiayn parse` writes it.

        Args:
            sentences: each a string of space-separated words as the treebank tokenizes
                them ("The cat sat ."), or a list of words.
            constrained: decode under the tree constraint (every output a tree by
                construction; needs a parser's vocabulary); False: decode freely and repair.
            tree_form: the model's target, each word in its place ("words", the recipe's)
                or XX ("gafl").
            word_mass: constrained, score each word by the model's probability of writing
                any word there (the tree's structure), not of the input's word.
        Raises:
            InputError: an empty sentence, named by its number; constrained decoding with a
                model whose vocabulary has no bracket pieces.
        """
        from aiayn.decoding.parse import parse_lines

        if isinstance(sentences, str):
            raise TypeError("parse takes a list of sentences, not a str: parse([sentence])")
        lines = [s if isinstance(s, str) else " ".join(s) for s in sentences]
        cfg = self._decode_config(beam=beam, nbest=1)
        return parse_lines(
            self.model,
            self.tokenizer,
            lines,
            cfg,
            self.device,
            constrained=constrained,
            linearization=tree_form,
            word_mass=word_mass,
        ).trees


def train(
    config: Config | PathLike,
    data: PathLike,
    out: PathLike,
    *,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    hooks: Hooks | None = None,
) -> TrainResult:
    """Train (or resume) a model, as `aiayn train DATA --out OUT` does.

    Args:
        config: a `Config`, a preset's name ("base", "big", "tiny", ...) or an experiment
            file (.toml); `overrides` ({"train.max_steps": 100}) are applied on top, as
            `--set` does.
        data: a directory written by `aiayn prepare`. out: the run directory; a run
            already there is resumed.
    Returns:
        The TrainResult: the final state, last checkpoint and why it stopped.
    """
    from aiayn.training.trainer import train as run_training

    if isinstance(config, Config):
        cfg = config
    elif Path(config).suffix == ".toml" or Path(config).is_file():
        cfg, _ = load_experiment(config)
    else:
        cfg = get_preset(str(config))
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    return run_training(cfg, data, out, device=device, hooks=hooks)
