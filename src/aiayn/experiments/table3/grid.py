"""The experiment file of `aiayn table3`: a recipe as the base row, the sweep's settings,
the rows."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiayn.config import (
    Config,
    ConfigError,
    DecodeConfig,
    apply_overrides,
    did_you_mean,
)
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.table3.paper import (
    PAPER_TABLE3,
    _describe,
    _same_way,
    moves,
    paper_analog,
    paper_settings,
    settings_of,
)
from aiayn.experiments.tasks import load_recipe
from aiayn.files import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, the same parser
    import tomli as tomllib


@dataclass(frozen=True)
class RowSpec:
    """One row of the experiment file: config keys changed from the base row (as `--set`
    takes them), the paper row it stands for (None: none), a note."""

    name: str
    overrides: dict[str, Any]
    paper: str | None
    note: str = ""


@dataclass(frozen=True)
class Table3Experiment:
    """A Table 3 experiment file, resolved: the base row's config (the recipe with the
    sweep's settings), the recipe table, the rows, how dev BLEU decodes, seeds per row."""

    path: Path
    recipe_path: Path
    base: Config
    recipe: RecipeConfig
    rows: tuple[RowSpec, ...]
    dev_decode: str = "beam"
    seeds: int = 1
    scale: str = ""

    def row(self, name: str) -> RowSpec:
        for spec in self.rows:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def config(self, spec: RowSpec, seed: int) -> Config:
        """The row's training config for one seed."""
        cfg = apply_overrides(self.base, spec.overrides)
        return replace(cfg, train=replace(cfg.train, seed=seed))

    def seed_list(self, seeds: int | None = None) -> list[int]:
        first = self.base.train.seed
        return [first + i for i in range(seeds or self.seeds)]

    def decode(self) -> DecodeConfig:
        """The decode settings dev BLEU uses."""
        if self.dev_decode == "greedy":
            return replace(self.base.decode, beam=1, nbest=1)
        return self.base.decode


_SWEEP_KEYS = ("recipe", "scale", "dev_decode", "seeds", "set")
_ROW_META = ("paper", "note")
#: Row keys that would need data of their own or clash with --seeds.
_FIXED_FOR_ROWS = ("max_len", "max_len_ratio", "seed", "vocab_size")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"max_steps": 1}} -> {"train.max_steps": 1} (TOML dotted keys)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_table3(path: str | Path, overrides: dict[str, Any] | None = None) -> Table3Experiment:
    """Read a Table 3 experiment file (see configs/table3-multi30k.toml):

        [sweep]
        recipe = "multi30k-en-de.toml"  # the base row: an experiment file, beside this one
        dev_decode = "beam"             # or "greedy"
        seeds = 1
        [sweep.set]                     # every row: the scale and budget, as --set
        train.max_steps = 4000
        [rows]
        base = {}
        A1 = { h = 1, d_k = 128, d_v = 128 }   # paper = "A1" by its name
        mine = { d_ff = 512, paper = "C7", note = "..." }

    `overrides` (--set KEY=VALUE) apply after [sweep.set], to every row.

    Raises:
        ConfigError: naming the file and key, for a bad table, key or value, a row whose
            changes do not go the way its paper row's do, or no `base` row.
    """
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    for key in doc:
        if key not in ("sweep", "rows"):
            raise ConfigError(
                f"{path}: unknown table {key!r}{did_you_mean(key, ['sweep', 'rows'])}; "
                "a Table 3 file has [sweep] and [rows]"
            )
    sweep = doc.get("sweep")
    if not isinstance(sweep, dict) or "recipe" not in sweep:
        raise ConfigError(f'{path}: needs a [sweep] table with recipe = "FILE.toml"')
    for key in sweep:
        if key not in _SWEEP_KEYS:
            raise ConfigError(f"{path}: unknown key sweep.{key}{did_you_mean(key, _SWEEP_KEYS)}")
    recipe_path = path.parent / str(sweep["recipe"])
    sets = _flatten(sweep.get("set", {}))
    sets.update(overrides or {})
    try:
        base, recipe = load_recipe(recipe_path, sets)
    except ConfigError as e:
        raise ConfigError(f"{path}: sweep.recipe: {e}") from None
    if recipe.dataset != "multi30k":
        raise ConfigError(f"{path}: Table 3 sweeps translation recipes, not {recipe.dataset!r}")
    if recipe.ensemble != 1:
        raise ConfigError(f"{path}: recipe.ensemble must be 1 (Table 3's rows are single models)")
    dev_decode = str(sweep.get("dev_decode", "beam"))
    if dev_decode not in ("beam", "greedy"):
        raise ConfigError(
            f"{path}: sweep.dev_decode must be 'beam' or 'greedy', got {dev_decode!r}"
        )
    seeds = sweep.get("seeds", 1)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ConfigError(f"{path}: sweep.seeds must be an integer >= 1, got {seeds!r}")
    rows = _rows(path, doc.get("rows"), base)
    return Table3Experiment(
        path, recipe_path, base, recipe, rows, dev_decode, seeds, str(sweep.get("scale", ""))
    )


def _rows(path: Path, table: Any, base: Config) -> tuple[RowSpec, ...]:
    if not isinstance(table, dict) or "base" not in table:
        raise ConfigError(f"{path}: needs a [rows] table with a `base = {{}}` row")
    base_settings = settings_of(base)
    rows = []
    for name, raw in table.items():
        where = f"{path}: rows.{name}"
        if not _NAME.match(name):
            raise ConfigError(f"{where}: a row's name is a directory name (letters, digits, ._-)")
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: a row is a table of settings, e.g. {{ d_ff = 512 }}")
        over: dict[str, Any] = {}
        for key, value in _flatten({k: v for k, v in raw.items() if k not in _ROW_META}).items():
            key = "train.max_steps" if key == "steps" else key
            if key.split(".")[0] in ("recipe", "decode") or key.split(".")[-1] in _FIXED_FOR_ROWS:
                raise ConfigError(
                    f"{where}: {key} is the same for every row (set it in [sweep.set]; "
                    "seeds with --seeds)"
                )
            over[key] = value
        if name == "base" and over:
            raise ConfigError(
                f"{where}: the base row is the recipe as [sweep.set] leaves it; "
                f"put {', '.join(over)} into [sweep.set]"
            )
        try:
            cfg = apply_overrides(base, over)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        ours = moves(base_settings, settings_of(cfg))
        paper: str | None
        if "paper" in raw:
            paper = str(raw["paper"]) or None
        else:
            paper = name if name in PAPER_TABLE3 else paper_analog(base_settings, settings_of(cfg))
            paper = None if paper == "base" and name != "base" else paper
        if paper is not None:
            if paper not in PAPER_TABLE3:
                raise ConfigError(
                    f"{where}: paper = {paper!r} is not a row of the paper's Table 3 "
                    f"({', '.join(PAPER_TABLE3)})"
                )
            theirs = moves(paper_settings("base"), paper_settings(paper))
            if not _same_way(ours, theirs):
                raise ConfigError(
                    f"{where}: changes {_describe(ours)} but the paper's {paper} changes "
                    f'{_describe(theirs)}; set paper = "ROW" (or "" for none)'
                )
        rows.append(RowSpec(name, over, paper, str(raw.get("note", ""))))
    return tuple(rows)


def select_rows(exp: Table3Experiment, wanted: Sequence[str] | None) -> list[RowSpec]:
    """The rows `wanted` names, in the file's order, the base row always among them (every
    direction is measured from it). A name is a row's, or a group's letter: "A" is A1-A4.

    Raises:
        UsageError: naming an unknown row.
    """
    if not wanted:
        return list(exp.rows)
    names = {s.name for s in exp.rows}
    chosen = {"base"}
    for token in (t.strip() for t in wanted):
        if not token:
            continue
        group = [n for n in names if re.fullmatch(rf"{re.escape(token)}\d*", n)]
        if token not in names and not group:
            raise UsageError(
                f"--rows: no row {token!r}{did_you_mean(token, sorted(names))}; the file's "
                f"rows: {', '.join(s.name for s in exp.rows)}"
            )
        chosen.update(group or [token])
    return [s for s in exp.rows if s.name in chosen]
