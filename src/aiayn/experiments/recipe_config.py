"""The [recipe] table of an experiment file: what a recipe needs beyond the model,
training and decoding settings, with `--set recipe.KEY=VALUE` overrides.

This module reads the table and checks what holds for every task; what a task requires of
its own keys (and which keys are whose) is checked by `aiayn.experiments.tasks.load_recipe`,
the loader to call."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from aiayn.config import (
    Config,
    ConfigError,
    apply_overrides,
    coerce_value,
    did_you_mean,
    load_experiment,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecipeConfig:
    """The [recipe] table of an experiment file."""

    # What the recipe does with the model (`aiayn.experiments.tasks.TASKS`): "translate"
    # (sections 5 and 6.1) or "parse" (section 6.3, English constituency parsing).
    task: str = "translate"
    # The corpus: "multi30k" or "wmt14" for translation (section 5.1), "ptb" for parsing.
    dataset: str = "multi30k"
    source_lang: str = "en"
    target_lang: str = "de"
    vocab_size: int = 8000
    # The subword model sentencepiece learns: "bpe" (byte-pair encoding, the paper's En-De
    # vocabulary) or "unigram" (word-piece style, as the paper's En-Fr one).
    vocab_model: str = "bpe"
    train_split: str = "train"
    valid_split: str = "val"
    test_split: str = "test_2016_flickr"
    average_last: int = 5  # checkpoints averaged (section 6.1: 5 for base, 20 for big)
    max_train_pairs: int = 0  # 0 = all; a smaller number makes a quick smoke run
    max_test_pairs: int = 0  # 0 = all; likewise for the test set (and the tune_alpha sentences)
    # Length penalties tried on the validation set once training is done; the one with the
    # best sacreBLEU decodes the test set. Section 6.1: beam size and alpha "were chosen
    # after experimentation on the development set". Empty: decode.alpha as configured.
    tune_alpha: tuple[float, ...] = ()
    # Validation sentences the tuning decodes at most, the first ones (with max_test_pairs,
    # the smaller): all of Multi30k's val (1,014), a bounded share of a larger dev set
    # (newstest2013: 3,000). Before the grid, the first 100 are decoded at its first alpha:
    # a model whose BLEU there is below 1 skips the tuning (`recipe.UNUSABLE_BLEU`).
    tune_alpha_sentences: int = 1500
    # Train, translate and score lowercased text, as many published Multi30k systems do
    # (trained on the shared task's lowercased, tokenized files, scored on lowercased
    # text). The vocabulary lowercases what it encodes, so the checkpoint lowercases any
    # input it translates. Off by default: the translations then have no capitals, and
    # sacreBLEU is computed against lowercased references.
    lowercase: bool = False
    # Beyond the paper (its rows are single models): train this many models at once, seeds
    # train.seed, train.seed + 1, ..., each in its own process on an equal share of the
    # CPU threads, each averaged, and translate with their ensemble (`aiayn.decoding.ensemble`: the
    # mean of their next-token probabilities). The run directory then holds member1/ ...
    # memberK/, each a training run of its own. 1: one model, the paper's recipe.
    ensemble: int = 1
    # Parsing (task = "parse", section 6.3) only; source_lang, target_lang and the split
    # names above are translation's. The treebank's split: "auto" (the NLTK sample's split
    # by file, or the LDC release's sections 02-21 / 22 / 23), "sample" or "ldc".
    treebank_split: str = "auto"
    # The target side: "gafl", Vinyals et al.'s linearization (XX for each word), or "words",
    # the same with each word in place of its XX, which the decoder copies from the source.
    linearization: str = "gafl"
    # The paper's semi-supervised setting: a file of silver trees (one bracketed tree a line,
    # e.g. another parser's high-confidence output) mixed into the gold training trees.
    silver: str = ""
    # Silver trees per gold tree in the training set: the gold trees are repeated
    # round(silver count / (silver_ratio x gold count)) times (at least once); every silver
    # tree is used.
    silver_ratio: float = 1.0
    # Constrained decoding scores a word by the model's probability of writing any word
    # there, not the input's word (which the input fixes): the tree's structure is scored,
    # as with the "gafl" target's XX. False: the input word's own probability, the paper's
    # beam search (better for a model that reads its input well: docs/results.md#parsing).
    word_mass: bool = False
    # Beam sizes tried on the development set, each with every tune_alpha, the best
    # (bracketing F1) decoding the test set; empty: decode.beam. Section 6.3 chose the beam
    # on the development set.
    tune_beam: tuple[int, ...] = ()
    # EVALB's source directory (../shared/tools/EVALB here): built in the run directory and
    # run on the test trees beside aiayn's scorer; empty: aiayn's scorer only.
    evalb: str = ""


def parse_recipe(table: dict[str, Any], where: str) -> RecipeConfig:
    """The [recipe] table as a RecipeConfig; an unknown key is an error naming the closest."""
    names = {f.name: f for f in fields(RecipeConfig)}
    for key in table:
        if key not in names:
            raise ConfigError(f"{where}: unknown key recipe.{key!r}{did_you_mean(key, names)}")
    if "tune_alpha" in table:
        grid = table["tune_alpha"]
        if not isinstance(grid, list | tuple) or not all(
            isinstance(a, int | float) and not isinstance(a, bool) and a >= 0 for a in grid
        ):
            raise ConfigError(
                f"{where}: recipe.tune_alpha must be a list of numbers >= 0, got {grid!r}"
            )
        table = {**table, "tune_alpha": tuple(float(a) for a in grid)}
    if "tune_beam" in table:
        beams = table["tune_beam"]
        if not isinstance(beams, list | tuple) or not all(
            isinstance(b, int | float) and not isinstance(b, bool) and b >= 1 and b == int(b)
            for b in beams
        ):
            raise ConfigError(
                f"{where}: recipe.tune_beam must be a list of integers >= 1, got {beams!r}"
            )
        table = {**table, "tune_beam": tuple(int(b) for b in beams)}
    recipe = RecipeConfig(**table)
    if (
        recipe.average_last < 1
        or recipe.vocab_size < 10
        or recipe.max_train_pairs < 0
        or recipe.max_test_pairs < 0
        or recipe.tune_alpha_sentences < 1
        or recipe.ensemble < 1
    ):
        raise ConfigError(
            f"{where}: recipe.average_last >= 1, vocab_size >= 10, "
            "max_train_pairs >= 0, max_test_pairs >= 0, tune_alpha_sentences >= 1 and "
            "ensemble >= 1 are required"
        )
    return recipe


def type_like(cls: type, key: str, value: Any) -> Any:
    """A --set string as the type of the RecipeConfig field it sets."""
    name = key.removeprefix("recipe.")
    default = {f.name: f.default for f in fields(cls)}.get(name)
    if isinstance(default, tuple) and isinstance(value, str):  # "0.6,1.0" -> [0.6, 1.0]
        if name == "tune_beam":
            try:
                return [int(x) for x in value.split(",") if x.strip()]
            except ValueError:
                raise ConfigError(
                    f"{key} must be comma-separated integers, got {value!r}"
                ) from None
        try:
            return [float(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"{key} must be comma-separated numbers, got {value!r}") from None
    if isinstance(default, bool) and isinstance(value, str):
        return coerce_value(key, default, value)
    if isinstance(default, float) and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if isinstance(default, int) and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {value!r}") from None
    return value


def read_recipe(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[Config, RecipeConfig, frozenset[str]]:
    """Read an experiment file with a [recipe] table; `overrides` are --set values. Also
    returns the [recipe] keys the file or the overrides set (a key set for another task is
    refused by `tasks.load_recipe`)."""
    cfg, extra = load_experiment(path)
    unknown = set(extra) - {"recipe"}
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {sorted(unknown)}")
    overrides = dict(overrides or {})
    table = dict(extra.get("recipe", {}))
    for key in [k for k in overrides if k.startswith("recipe.")]:
        table[key.removeprefix("recipe.")] = type_like(RecipeConfig, key, overrides.pop(key))
    recipe = parse_recipe(table, str(path))
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    if cfg.train.keep_last < recipe.average_last:
        raise ConfigError(
            f"{path}: train.keep_last ({cfg.train.keep_last}) must be at least "
            f"recipe.average_last ({recipe.average_last})"
        )
    return cfg, recipe, frozenset(table)
