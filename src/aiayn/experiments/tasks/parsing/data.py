"""Parsing's data stage: the treebank's splits (`aiayn data ptb`), silver trees mixed in,
prepared with the linearized trees as the target; the tree constraint's limits from the
training trees."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.config import Config
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks.base import TaskData
from aiayn.files import read_lines, write_text_atomic

if TYPE_CHECKING:
    from aiayn.decoding.tree_constraint import TreeLimits

log = logging.getLogger(__name__)


#: The file suffix of the source side: the words (the target's: `ptb.TARGETS`).
SOURCE = "words"


def mix_silver(
    gold: Path, silver: Path, ratio: float, out: Path, target: str = "lin"
) -> dict[str, int | float]:
    """Write OUT.words/.lin: the gold pairs repeated to reach `ratio` silver per gold, then
    every silver pair (the paper's semi-supervised setting mixes both). `gold` and `silver`
    are prefixes of .words files and of target files (suffix `target`).

    Returns:
        Counts: gold, silver, gold_copies, and the ratio reached.
    """
    g = {s: list(read_lines(Path(f"{gold}.{s}"))) for s in (SOURCE, target)}
    v = {s: list(read_lines(Path(f"{silver}.{s}"))) for s in (SOURCE, target)}
    n_gold, n_silver = len(g[SOURCE]), len(v[SOURCE])
    copies = max(1, round(n_silver / (ratio * n_gold))) if n_gold else 1
    for side in (SOURCE, target):
        lines = g[side] * copies + v[side]
        write_text_atomic(Path(f"{out}.{side}"), "".join(f"{x}\n" for x in lines))
    return {
        "gold": n_gold,
        "silver": n_silver,
        "gold_copies": copies,
        "silver_per_gold": n_silver / max(1, n_gold * copies),
    }


def _first_lines(prefix: Path, suffixes: tuple[str, ...], out: Path, n: int) -> None:
    for suffix in suffixes:
        lines = list(read_lines(Path(f"{prefix}.{suffix}")))[:n]
        write_text_atomic(Path(f"{out}.{suffix}"), "".join(f"{x}\n" for x in lines))


def prepare_data(recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None) -> TaskData:
    """The treebank's splits as files, silver mixed in, a smoke run's truncation, prepared.
    TaskData.files: "dev" and "test", the prefixes of their .words, .trees (and target)
    files."""
    from aiayn.data.download import download_ptb_sample
    from aiayn.data.prepare import prepare
    from aiayn.parsing.ptb import TARGETS, prepare_treebank, tree_file_to_pairs

    source = Path(data) if data is not None else download_ptb_sample(out / "data" / "raw")
    ptb = out / "data" / "ptb"
    treebank = prepare_treebank(source, ptb, split=recipe.treebank_split)
    train, dev, test = ptb / "train", ptb / "dev", ptb / "test"
    target = TARGETS[recipe.linearization]
    if recipe.max_train_pairs:  # a smoke run: the first gold trees (silver comes after)
        n = recipe.max_train_pairs
        _first_lines(train, (SOURCE, target), out / "data" / f"train.first{n}", n)
        train = out / "data" / f"train.first{n}"
    silver_counts = None
    if recipe.silver:
        silver = out / "data" / "silver"
        tree_file_to_pairs(
            Path(recipe.silver),
            Path(f"{silver}.{SOURCE}"),
            Path(f"{silver}.{target}"),
            with_words=recipe.linearization == "words",
        )
        mixed = out / "data" / "train.mixed"
        silver_counts = mix_silver(train, silver, recipe.silver_ratio, mixed, target)
        train = mixed
        log.info("training on gold and silver trees: %s", silver_counts)
    if recipe.max_test_pairs:
        n = recipe.max_test_pairs
        for name in ("dev", "test"):
            _first_lines(
                ptb / name, (SOURCE, target, "trees"), out / "data" / f"{name}.first{n}", n
            )
        dev, test = out / "data" / f"dev.first{n}", out / "data" / f"test.first{n}"
    prepared = out / "data" / "prepared"
    manifest = prepare(
        SOURCE,
        target,
        train,
        ptb / "dev",  # validation perplexity on the whole development set
        None,
        prepared,
        vocab_size=recipe.vocab_size,
        max_len=cfg.train.max_len,
        max_len_ratio=cfg.train.max_len_ratio,
        split_by_script=False,  # "(NP" and ")VP" one piece each
    )
    return TaskData(
        prepared,
        manifest,
        files={
            "dev": dev,
            "test": test,
            "train_target": Path(f"{train}.{target}"),
            "train_trees": ptb / "train.trees",
        },
        record={"treebank": treebank, "silver": silver_counts},
    )


def _limits(data: TaskData) -> TreeLimits:
    """The tree constraint's bounds: the training targets' deepest nesting and longest run
    of open brackets (`tree_limits`)."""
    from aiayn.decoding.tree_constraint import TreeLimits, tree_limits

    target = data.files.get("train_target")
    if target is None or not Path(target).is_file():
        return TreeLimits()
    return tree_limits(list(read_lines(Path(target))))
