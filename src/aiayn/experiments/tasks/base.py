"""What a task is to the recipe: the stages that differ between translation and parsing.

`aiayn recipe` runs one pipeline for every task (`aiayn.experiments.recipe.run_recipe`):

    task.fetch        `aiayn data DATASET`: the corpus copied or downloaded, verified
    task.prepare      corpus -> RUN/data/prepared (and the dev/test files the task reads)
    (shared)          train, average the last checkpoints, load them as one decoder
    task.tune         decoding settings chosen on the development set (or those configured)
    task.test         the test set decoded and scored: scores and the task's own results
    task.format       the results for the terminal

and `aiayn evaluate --task NAME` scores a file with `task.score_files`.

A task is a plain object with these methods; `aiayn.experiments.tasks.TASKS` maps the
[recipe] table's `task` to it, as `config.PRESETS` maps preset names. Adding one is one
module (its data and decoding) plus its scorer; see docs/reference.md#adding-a-task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiayn.config import Config, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig

if TYPE_CHECKING:
    from aiayn.experiments.stages import Trained


@dataclass
class TaskData:
    """What a task's data stage made: the prepared directory (what training reads), its
    manifest, and the task's own paths and records (`files`: e.g. the dev and test sets;
    `record`: what results.json keeps under "data" beside the shared hashes)."""

    prepared: Path
    manifest: dict[str, Any]
    files: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """The test stage's result: `scores` (results.json's "scores"), the task's own
    top-level results (`results`, e.g. the decoding summary), extra keys of the training
    record (`train`, e.g. an ensemble's members alone) and of "data" (`data`)."""

    scores: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scored:
    """A scorer's answer for `aiayn evaluate`: the numbers (`values`, printed by --json), the
    summary with signatures (`text`), and the scorer's full report where it has one
    (`report`, e.g. EVALB's)."""

    values: dict[str, Any]
    text: str
    report: str | None = None


@dataclass
class RunContext:
    """What the test stage may need of the run beyond the model: the recipe's settings,
    the run directory, the device, the wall-time record each stage adds its seconds to,
    and the training record (steps, seconds, tokens)."""

    recipe: RecipeConfig
    cfg: Config
    out: Path
    device: str
    wall: dict[str, float]
    train: dict[str, Any]


def refuse_options(dataset: str, options: dict[str, Any], reads: tuple[str, ...]) -> None:
    """A dataset flag given for a dataset that does not read it is an error naming it and
    the datasets that do (`aiayn data`), never silently ignored."""
    from aiayn.files import UsageError

    given = [name for name, value in options.items() if value is not None]
    for name in given:
        if name not in reads:
            takes = f"; {dataset} takes {', '.join('--' + r for r in reads)}" if reads else ""
            raise UsageError(f"--{name} is not an option of {dataset}{takes}")


class Task(Protocol):
    """One kind of experiment a recipe can run (translation, parsing, ...)."""

    #: The [recipe] table's `task` value.
    name: str
    #: The `recipe.dataset` values this task reads.
    datasets: tuple[str, ...]
    #: [recipe] keys only this task reads (another task's file setting one is refused).
    own_fields: frozenset[str]
    #: The key of results.json that keeps what `tune` tried.
    tuning_key: str
    #: Whether it trains under torchrun (one DDP job).
    distributed: bool
    #: The options of `score_files` (`aiayn evaluate --OPTION`); another task's are refused.
    score_options: frozenset[str]

    def fetch(
        self, dataset: str, out: Path, source: Path | None, options: dict[str, Any]
    ) -> list[str]:
        """`aiayn data DATASET`: one of `datasets` copied from `source` (or downloaded), each
        file verified, into `out`. `options`: the dataset flags given (--splits, --langs,
        --pair, --split); one this dataset does not read is refused (UsageError), not
        ignored. Returns the lines to print."""

    def check(self, recipe: RecipeConfig, where: str) -> None:
        """Refuse settings this task cannot run (ConfigError naming `where`), before any
        work: a recipe must not fail after an hour of training on a setting it could have
        read at the start."""

    def prepare(
        self, recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None
    ) -> TaskData:
        """The corpus downloaded (or read from `data`), split, and prepared for training."""

    def tune(
        self,
        trained: Trained,
        data: TaskData,
        decode: DecodeConfig,
        ctx: RunContext,
    ) -> tuple[DecodeConfig, dict[str, Any] | None]:
        """Decoding settings chosen on the development set, and the record of what was
        tried (None where the recipe tunes nothing: `decode` as configured)."""

    def test(
        self,
        trained: Trained,
        data: TaskData,
        decode: DecodeConfig,
        ctx: RunContext,
    ) -> Outcome:
        """The test set decoded with `decode` and scored."""

    def score_files(self, hyp: Path, ref: Path, options: dict[str, Any]) -> Scored:
        """Score a file of outputs against its references (`aiayn evaluate --task NAME`),
        with this task's scorer and `options` (keys of `score_options`, None: the default)."""

    def test_split(self, recipe: RecipeConfig) -> str:
        """The name results.json gives the test set."""

    def label(self, recipe: RecipeConfig) -> str:
        """A short name of the experiment for the training curve's legend (e.g. "en-de")."""

    def format(self, results: dict[str, Any]) -> str:
        """The results for the terminal, every score with its signature."""
