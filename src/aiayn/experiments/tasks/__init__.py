"""The tasks `aiayn recipe` runs, by the [recipe] table's `task`: a plain mapping, as
`config.PRESETS` is for models. Each is one module implementing `base.Task`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiayn.config import Config, ConfigError, did_you_mean
from aiayn.experiments.recipe_config import RecipeConfig, read_recipe
from aiayn.experiments.tasks.base import Outcome, RunContext, Scored, Task, TaskData
from aiayn.experiments.tasks.parsing import PARSING
from aiayn.experiments.tasks.translation import TRANSLATION

__all__ = [
    "TASKS",
    "Outcome",
    "RunContext",
    "Scored",
    "Task",
    "TaskData",
    "datasets",
    "load_experiment",
    "load_recipe",
    "task_for",
    "task_reading",
]

#: The [recipe] table's `task` -> the task.
TASKS: dict[str, Task] = {TRANSLATION.name: TRANSLATION, PARSING.name: PARSING}


def task_reading(dataset: str) -> Task:
    """The task whose data `dataset` is (`aiayn data DATASET`)."""
    for task in TASKS.values():
        if dataset in task.datasets:
            return task
    known = [d for t in TASKS.values() for d in t.datasets]
    raise ConfigError(f"no task reads dataset {dataset!r}{did_you_mean(dataset, known)}")


def datasets() -> list[str]:
    """Every dataset some task reads, as `aiayn data` offers them."""
    return sorted(d for t in TASKS.values() for d in t.datasets)


def task_for(recipe: RecipeConfig, given: frozenset[str], where: str) -> Task:
    """The recipe's task, once its settings are its own: the task known, the dataset one it
    reads, no key set that only another task reads, and the task's own checks passed."""
    task = TASKS.get(recipe.task)
    if task is None:
        raise ConfigError(
            f"{where}: recipe.task must be one of {', '.join(map(repr, TASKS))}, "
            f"got {recipe.task!r}{did_you_mean(recipe.task, TASKS)}"
        )
    if recipe.dataset not in task.datasets:
        readers = [t.name for t in TASKS.values() if recipe.dataset in t.datasets]
        hint = f": set recipe.task = {readers[0]!r}" if readers else ""
        raise ConfigError(
            f"{where}: task {task.name!r} reads recipe.dataset "
            f"{' or '.join(map(repr, task.datasets))}, not {recipe.dataset!r}{hint}"
        )
    for other in TASKS.values():
        foreign = sorted((given & other.own_fields) - task.own_fields)
        if other is not task and foreign:
            raise ConfigError(f"{where}: recipe.{foreign[0]} is for task = {other.name!r} only")
    task.check(recipe, where)
    return task


def load_experiment(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[Config, RecipeConfig, Task]:
    """Read an experiment file with a [recipe] table (`overrides`: --set values), checked
    against its task (`task_for`): the file is read once, and its task comes with it."""
    cfg, recipe, given = read_recipe(path, overrides)
    return cfg, recipe, task_for(recipe, given, str(path))


def load_recipe(
    path: str | Path, overrides: dict[str, Any] | None = None
) -> tuple[Config, RecipeConfig]:
    """`load_experiment` without the task."""
    cfg, recipe, _ = load_experiment(path, overrides)
    return cfg, recipe
