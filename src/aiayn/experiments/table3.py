"""Table 3 of the paper, row by row, at a stated scale (`aiayn table3 FILE.toml --out DIR`).

The paper's Table 3 changes its base model one setting at a time (rows A-E) and reports
each variant's dev perplexity and BLEU (newstest2013). Here an experiment file names a
recipe whose model is the base row (e.g. configs/multi30k-en-de.toml), the settings that
size every row alike (`[sweep.set]`: steps, minutes, checkpoints: the budget per row), and
the rows as changes of that base (`[rows]`). Each row and seed trains in its own run
directory with the recipe's stages (`stages.train_stage`, `check_stopped`,
`average_stage`), then its averaged checkpoint is scored on the validation set:

    DIR/data/                    the corpus and its prepared form, made once for every row
    DIR/ROW/seedS/               one training run: checkpoints, train_log.jsonl, checkpoint_avg.pt
    DIR/ROW/seedS/dev.hyp        the validation set translated by the averaged model
    DIR/ROW/seedS/table3_row.json  the row's scores and the settings that made them; written
                                 last, so a run that has it is done
    DIR/table3.csv, table3.json  every finished row beside the paper's numbers

Scoring: dev PPL is the unsmoothed validation NLL per target subword of the averaged model
(`training.validation.validate`, as the trainer logs it for the raw model), exponentiated;
dev BLEU is sacreBLEU of the validation set decoded with the recipe's decode settings
(beam 4, alpha 0.6: the paper's; no alpha tuning, which would choose on the set scored)
or greedily (`dev_decode = "greedy"`); params counts the model's parameters (shared
embeddings once).

Resuming: a run that has table3_row.json made with the current training settings is not
trained again (only rescored, from its checkpoints, when the scoring settings changed);
one without it resumes from its last checkpoint, as `aiayn recipe` does. A finished (or
started) run whose training settings changed is refused before any work, naming the keys
and the directory; `rerun_changed` moves such directories aside (ROW/seedS.stale-K) and
trains them again.

Directions: each row's change of dev PPL and BLEU from its base row, against the paper's
change for the paper row it stands for. "same" when the two changes have one sign,
"opposite" when not, "tie" when either change rounds to zero at the paper's printed
precision (PPL 0.01, BLEU 0.1): the paper's rows equal to its base (A3's BLEU, E's PPL)
are ties whatever ours do. With several seeds a row's "within spread" says whether its
seeds' range (min-max) overlaps its base row's: a change inside the seed spread. Seeds on
one side are enough: a one-seed row is within the spread of a base row trained with
several when its value lies in their range (seeds for the base row alone measure the
spread at a third of the cost of seeds for every row).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

from aiayn.config import (
    Config,
    ConfigError,
    DecodeConfig,
    apply_overrides,
    did_you_mean,
    get_preset,
)
from aiayn.experiments import stages
from aiayn.experiments.manifest import machine_name
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.tasks import load_recipe
from aiayn.files import UsageError, write_text_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tomli, the same parser
    import tomli as tomllib

if TYPE_CHECKING:
    from aiayn.training.trainer import Hooks

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the paper
@dataclass(frozen=True)
class PaperRow:
    """One line of the paper's Table 3: dev (newstest2013) perplexity and BLEU, and the
    parameters in millions where the paper prints them. The settings are the preset of
    the same name (`aiayn.config.PRESETS`)."""

    ppl: float
    bleu: float
    params_m: float | None = None


#: The paper's Table 3 (../shared/PAPER.md, section 4): dev PPL, dev BLEU, params (M).
PAPER_TABLE3: dict[str, PaperRow] = {
    "base": PaperRow(4.92, 25.8, 65),
    "A1": PaperRow(5.29, 24.9),
    "A2": PaperRow(5.00, 25.5),
    "A3": PaperRow(4.91, 25.8),
    "A4": PaperRow(5.01, 25.4),
    "B1": PaperRow(5.16, 25.1, 58),
    "B2": PaperRow(5.01, 25.4, 60),
    "C1": PaperRow(6.11, 23.7, 36),
    "C2": PaperRow(5.19, 25.3, 50),
    "C3": PaperRow(4.88, 25.5, 80),
    "C4": PaperRow(5.75, 24.5, 28),
    "C5": PaperRow(4.66, 26.0, 168),
    "C6": PaperRow(5.12, 25.4, 53),
    "C7": PaperRow(4.75, 26.2, 90),
    "D1": PaperRow(5.77, 24.6),
    "D2": PaperRow(4.95, 25.5),
    "D3": PaperRow(4.67, 25.3),
    "D4": PaperRow(5.47, 25.7),
    "E": PaperRow(4.92, 25.7),
    "big": PaperRow(4.33, 26.4, 213),
}

#: Table 3's columns of settings, and `positional` (row E: learned instead of sinusoids).
SETTINGS = ("N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls", "positional")
_RATES = ("P_drop", "eps_ls")  # moved by a difference; the sizes by a ratio

#: A change smaller than this is a tie: it rounds to 0 at the paper's printed precision.
TIE = {"ppl": 0.005, "bleu": 0.05}


def settings_of(cfg: Config) -> dict[str, Any]:
    """A config's Table 3 settings, by column."""
    m = cfg.model
    return {
        "N": m.N,
        "d_model": m.d_model,
        "d_ff": m.d_ff,
        "h": m.h,
        "d_k": m.d_k,
        "d_v": m.d_v,
        "P_drop": m.P_drop,
        "eps_ls": cfg.train.eps_ls,
        "positional": m.positional,
    }


def paper_settings(label: str) -> dict[str, Any]:
    """The settings of the paper's row `label` (its preset), and its steps."""
    cfg = get_preset(label)
    return {**settings_of(cfg), "steps": cfg.train.max_steps}


def moves(base: dict[str, Any], row: dict[str, Any]) -> dict[str, float]:
    """The settings `row` changes from `base`: log ratio for sizes, difference for P_drop
    and eps_ls, 1 for positional."""
    out: dict[str, float] = {}
    for key in SETTINGS:
        a, b = base[key], row[key]
        if a == b:
            continue
        if key == "positional":
            out[key] = 1.0
        elif key in _RATES:
            out[key] = float(b) - float(a)
        else:
            out[key] = math.log(b / a)
    return out


def _same_way(ours: dict[str, float], theirs: dict[str, float]) -> bool:
    return set(ours) == set(theirs) and all((ours[k] > 0) == (theirs[k] > 0) for k in ours)


def paper_analog(base: dict[str, Any], row: dict[str, Any]) -> str | None:
    """The paper's row that changes the same settings in the same directions as `row` does
    from `base`, the nearest in size (the sum of the moves' distances); "base" for no
    change, None when no paper row changes those settings so (e.g. two rows' at once)."""
    ours = moves(base, row)
    if not ours:
        return "base"
    paper_base = paper_settings("base")
    best: tuple[float, str] | None = None
    for label in PAPER_TABLE3:
        if label == "base":
            continue
        theirs = moves(paper_base, paper_settings(label))
        if not _same_way(ours, theirs):
            continue
        distance = sum(abs(ours[k] - theirs[k]) for k in ours)
        if best is None or distance < best[0]:
            best = (distance, label)
    return None if best is None else best[1]


def _describe(m: dict[str, float]) -> str:
    return ", ".join(f"{k} {'up' if v > 0 else 'down'}" for k, v in m.items()) or "nothing"


# --------------------------------------------------------------------------- the experiment file
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


# --------------------------------------------------------------------------- one row, one seed
#: A run's done marker, written last.
ROW_FILE = "table3_row.json"
#: Training settings that change nothing a finished row measured.
_INERT_TRAIN_KEYS = frozenset(
    {
        "log_interval_steps",
        "valid_interval_steps",
        "preflight",
        "keep_last",
        # watching the run (aiayn.training.watch): logs and files, not the weights
        "valid_bleu_interval_steps",
        "valid_bleu_sentences",
        "valid_bleu_beam",
        "best_metric",
        "tensorboard",
    }
)


@dataclass
class RunResult:
    """One row, one seed: what training did and what the averaged model scored on dev."""

    row: str
    seed: int
    run_dir: str
    steps: int
    stopped_by: str
    train_seconds: float
    params: int
    dev_ppl: float
    dev_nll: float
    dev_bleu: float  # sacreBLEU
    dev_tok_bleu: float
    dev_chrf: float
    bleu_signature: str
    trainer_valid_ppl: float | None  # the trainer's last validation (raw model, not averaged)
    averaged: list[str]
    train_key: dict[str, Any] = field(default_factory=dict)
    score_key: dict[str, Any] = field(default_factory=dict)
    machine: str = ""  # `manifest.machine_name`; "" for runs scored before it was kept


def _data_id(prepared: Path) -> dict[str, Any]:
    """What identifies the prepared data: the vocabulary's and input texts' hashes."""
    from aiayn.data.corpus import load_manifest

    m = load_manifest(prepared)
    return {
        "vocab_sha256": m["spm_model"]["sha256"],
        "inputs": {
            split: {side: v["sha256"] for side, v in sides.items()}
            for split, sides in sorted(m["inputs"].items())
        },
    }


def train_key(cfg: Config, data_id: dict[str, Any]) -> dict[str, Any]:
    """What a finished row's training depended on."""
    d = cfg.to_dict()
    return {
        "model": d["model"],
        "train": {k: v for k, v in d["train"].items() if k not in _INERT_TRAIN_KEYS},
        "data": data_id,
    }


def score_key(exp: Table3Experiment) -> dict[str, Any]:
    """What a row's scores depended on beyond its training."""
    return {
        "decode": asdict(exp.decode()),
        "average_last": exp.recipe.average_last,
        "dev_decode": exp.dev_decode,
    }


def train_key_diff(
    old: dict[str, Any], new: dict[str, Any], stopped_by: str = "", train_seconds: float = 0.0
) -> list[str]:
    """The training settings that differ, as "section.key: old -> new". A changed
    max_minutes counts only where it would have changed the run: not for a run that ended
    at max_steps within the new budget."""
    diffs = []
    for section in ("model", "train"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if key in _INERT_TRAIN_KEYS or a.get(key) == b.get(key):
                continue
            if (
                (section, key) == ("train", "max_minutes")
                and stopped_by == "max_steps"
                and (not b.get(key) or 60 * b[key] >= train_seconds)
            ):
                continue
            diffs.append(f"{section}.{key}: {a.get(key)!r} -> {b.get(key)!r}")
    if new.get("data") and old.get("data") != new.get("data"):
        diffs.append("the prepared data (vocabulary or texts)")
    return diffs


def _valid_text(prepared: Path) -> tuple[Path, Path]:
    """The validation set's source and reference text, as `prepare` recorded them."""
    from aiayn.data.corpus import load_manifest
    from aiayn.files import InputError, sha256_file

    sides = load_manifest(prepared)["inputs"].get("valid")
    if not sides:
        raise InputError(f"{prepared}: prepared without a validation set; dev scores need one")
    paths = []
    for side in ("src", "tgt"):
        p = Path(sides[side]["path"])
        if not p.is_file() or sha256_file(p) != sides[side]["sha256"]:
            raise InputError(
                f"{p}: the validation text {prepared}/manifest.json names is missing or changed"
            )
        paths.append(p)
    return paths[0], paths[1]


def score_run(
    run_dir: Path, prepared: Path, cfg: Config, exp: Table3Experiment, device: str = "cpu"
) -> dict[str, Any]:
    """Dev PPL and BLEU of a run's checkpoint_avg.pt, and its parameter count."""
    import torch

    from aiayn.checkpoints import load_model
    from aiayn.data.corpus import load_corpus
    from aiayn.decoding.translate import translate_file
    from aiayn.model import count_parameters
    from aiayn.scoring.bleu import score_files
    from aiayn.training.validation import validate

    model, tokenizer, _ = load_model(run_dir / "checkpoint_avg.pt", device)
    v = validate(
        model,
        load_corpus(prepared, "valid"),
        cfg.train.max_tokens,
        torch.device(device),
        cfg.train.dtype,
        cfg.train.cpu_kernels,
    )
    src, ref = _valid_text(prepared)
    hyp = run_dir / "dev.hyp"
    translate_file(model, tokenizer, src, hyp, exp.decode(), device=device)
    s = score_files(hyp, ref, exp.recipe.target_lang)
    return {
        "params": count_parameters(model),
        "dev_ppl": v["valid_ppl"],
        "dev_nll": v["valid_nll"],
        "dev_bleu": s.sacrebleu,
        "dev_tok_bleu": s.tok_bleu,
        "dev_chrf": s.chrf,
        "bleu_signature": s.sacrebleu_signature,
    }


def read_run(run_dir: Path) -> RunResult | None:
    """A run's done marker, or None if it has none (or an unreadable one)."""
    path = run_dir / ROW_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        optional = {"machine"}  # added later: older runs' files lack it
        kept = [f.name for f in fields(RunResult) if f.name in d or f.name not in optional]
        return RunResult(**{name: d[name] for name in kept})
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s: unreadable (%s): the row is trained again", path, e)
        return None


def _train_run(
    exp: Table3Experiment,
    spec: RowSpec,
    cfg: Config,
    run_dir: Path,
    prepared: Path,
    keys: tuple[dict[str, Any], dict[str, Any]],
    device: str,
    hooks: Hooks | None,
    previous: RunResult | None,
) -> RunResult:
    """Train (or resume) one run, average it and score it; with `previous` (its training
    is current, its scoring settings are not), average and score only."""
    if previous is None:
        runs, trained = stages.train_stage(exp.recipe, cfg, prepared, run_dir, device, hooks)
        stages.check_stopped(trained, run_dir)
        t = trained[0]
        stopped_by = "max_steps" if t["stopped_by"] == "already_done" else t["stopped_by"]
        summary = {
            "steps": t["steps"],
            "stopped_by": stopped_by,
            "train_seconds": t["train_seconds"],
            "trainer_valid_ppl": (t.get("last_valid") or {}).get("valid_ppl"),
        }
    else:
        runs = [run_dir]
        summary = {
            "steps": previous.steps,
            "stopped_by": previous.stopped_by,
            "train_seconds": previous.train_seconds,
            "trainer_valid_ppl": previous.trainer_valid_ppl,
        }
    (averaged,) = stages.average_stage(exp.recipe, runs, cfg.train)
    scores = score_run(run_dir, prepared, cfg, exp, device)
    result = RunResult(
        row=spec.name,
        seed=cfg.train.seed,
        run_dir=str(run_dir),
        averaged=averaged,
        train_key=keys[0],
        score_key=keys[1],
        machine=machine_name(device),
        **summary,
        **scores,
    )
    write_text_atomic(run_dir / ROW_FILE, json.dumps(asdict(result), indent=1) + "\n")
    log.info(
        "row %s seed %d: %d steps, dev PPL %.2f, dev BLEU %.2f (%s)",
        spec.name,
        cfg.train.seed,
        result.steps,
        result.dev_ppl,
        result.dev_bleu,
        run_dir,
    )
    return result


@dataclass
class _Plan:
    spec: RowSpec
    cfg: Config
    run_dir: Path
    action: str  # "done", "rescore", "train", "changed"
    previous: RunResult | None = None
    why: str = ""


def _plan(
    spec: RowSpec, cfg: Config, run_dir: Path, keys: tuple[dict[str, Any], dict[str, Any]]
) -> _Plan:
    """What a run needs: nothing, rescoring, training (new or resumed), or a refusal."""
    from aiayn.checkpoints import list_checkpoints
    from aiayn.training.resume import check_resume_compatible
    from aiayn.training.state import TrainingError

    done = read_run(run_dir)
    if done is not None:
        diff = train_key_diff(done.train_key, keys[0], done.stopped_by, done.train_seconds)
        if diff:
            return _Plan(spec, cfg, run_dir, "changed", done, "finished with " + "; ".join(diff))
        if done.score_key != keys[1]:
            return _Plan(spec, cfg, run_dir, "rescore", done)
        return _Plan(spec, cfg, run_dir, "done", done)
    config = run_dir / "config.json"
    if list_checkpoints(run_dir) and config.is_file():
        saved = {"config": json.loads(config.read_text(encoding="utf-8"))}
        # the trainer fills vocab_size in from the data, as the saved config has it
        vocab_size = saved["config"].get("model", {}).get("vocab_size", 0)
        filled = cfg
        if not cfg.model.vocab_size:
            filled = replace(cfg, model=replace(cfg.model, vocab_size=vocab_size))
        try:
            check_resume_compatible(saved, filled, reset_optimizer=False, reset_dataloader=False)
        except TrainingError as e:
            return _Plan(spec, cfg, run_dir, "changed", None, f"started with other settings: {e}")
    return _Plan(spec, cfg, run_dir, "train")


def _move_aside(run_dir: Path) -> Path:
    k = 1
    while (stale := run_dir.with_name(f"{run_dir.name}.stale-{k}")).exists():
        k += 1
    run_dir.rename(stale)
    log.warning("%s: its settings changed; moved to %s, trained again", run_dir, stale)
    return stale


# --------------------------------------------------------------------------- the sweep
def prepare_data(exp: Table3Experiment, out: Path, data: str | Path | None) -> Path:
    """DIR/data/prepared, made once for every row by the recipe's data stage (copy or
    download, prepare); reused while the data settings are the same.

    Raises:
        ConfigError: DIR/data was prepared with other data settings.
    """
    from aiayn.experiments.tasks.translation import prepare_data

    r, t = exp.recipe, exp.base.train
    key = {
        "dataset": r.dataset,
        "pair": f"{r.source_lang}-{r.target_lang}",
        "splits": [r.train_split, r.valid_split],
        "vocab_size": r.vocab_size,
        "max_train_pairs": r.max_train_pairs,
        "lowercase": r.lowercase,
        "max_len": t.max_len,
        "max_len_ratio": t.max_len_ratio,
    }
    stamp, prepared = out / "data" / "table3_data.json", out / "data" / "prepared"
    if stamp.is_file() and (prepared / "manifest.json").is_file():
        old = json.loads(stamp.read_text(encoding="utf-8"))
        if old != key:
            diff = ", ".join(
                f"{k}: {old.get(k)!r} -> {v!r}" for k, v in key.items() if old.get(k) != v
            )
            raise ConfigError(
                f"{out}/data was prepared with other data settings ({diff}): its rows are not "
                "comparable with new ones; use another --out"
            )
        return prepared
    prepare_data(exp.recipe, exp.base, out, data)
    write_text_atomic(stamp, json.dumps(key, indent=1) + "\n")
    return prepared


@dataclass
class Table3Report:
    """A sweep's outcome: the table's rows, every run's result, what is not in the table."""

    rows: list[TableRow]
    runs: list[RunResult]
    missing: list[str]
    files: list[Path] = field(default_factory=list)


def run_table3(
    exp: Table3Experiment,
    out: str | Path,
    *,
    data: str | Path | None = None,
    prepared: str | Path | None = None,
    rows: Sequence[str] | None = None,
    seeds: int | None = None,
    device: str = "cpu",
    hooks_for: Callable[[str, int, int], Hooks | None] | None = None,
    rerun_changed: bool = False,
    train: bool = True,
    extra_rows: Sequence[TableRow] = (),
    jobs: int = 1,
) -> Table3Report:
    """Train and score the rows `rows` names (all by default; the base row always), each
    seed in DIR/ROW/seedS, then write DIR/table3.csv and DIR/table3.json with every
    finished row of the file (and `extra_rows`, e.g. imported probes).

    Args:
        exp: the experiment (`load_table3`).
        out: the sweep's directory; rerun to resume.
        data: a local copy of the corpus (None: download); not read with `prepared`.
        prepared: an already prepared data directory to train every row on, instead of
            DIR/data (its manifest names the validation text that dev BLEU reads).
        rows: row names or group letters (`select_rows`).
        seeds: seeds per row (default: the file's), train.seed, train.seed + 1, ...
        hooks_for: called as (row, seed, max_steps) before a run trains: its Hooks.
        rerun_changed: move runs whose settings changed aside and train them again,
            instead of refusing.
        train: False: train nothing, score nothing; the table of what is finished.
        jobs: runs trained at once, each in its own process (`_run_parallel`): for a GPU,
            which one small row leaves mostly idle, or a CPU whose cores one run's
            small products do not keep busy; `hooks_for` is not called then.

    Raises:
        ConfigError: before any training, for the runs whose settings changed (each
            named with its keys and directory), unless `rerun_changed`.
        RecipeStoppedError: a signal stopped training; the same call resumes.
    """
    out = Path(out)
    if prepared is not None:
        prep = Path(prepared)
    elif train:
        out.mkdir(parents=True, exist_ok=True)
        prep = prepare_data(exp, out, data)
    else:
        prep = out / "data" / "prepared"
    data_id = _data_id(prep) if (prep / "manifest.json").is_file() else {}
    skey = score_key(exp)
    chosen = {s.name for s in select_rows(exp, rows)}
    plans = [
        _plan(spec, cfg, out / spec.name / f"seed{seed}", (train_key(cfg, data_id), skey))
        for spec in exp.rows
        for seed in exp.seed_list(seeds)
        for cfg in [exp.config(spec, seed)]
    ]
    changed = [p for p in plans if p.action == "changed" and p.spec.name in chosen]
    if train and changed and not rerun_changed:
        raise ConfigError(
            "settings changed since these runs (delete their directories or pass "
            "--rerun-changed to move them aside and train them again; or use another --out): "
            + "; ".join(f"{p.run_dir}: {p.why}" for p in changed)
        )
    results: list[RunResult] = []
    queued: list[tuple[_Plan, RunResult | None]] = []
    for p in plans:
        todo = p.spec.name in chosen and train
        if p.action == "done":
            assert p.previous is not None
            results.append(p.previous)
        elif not todo:
            if p.action in ("changed", "rescore"):
                why = p.why or "scored with other settings (sweep.dev_decode, average_last)"
                log.warning(
                    "row %s (%s) is left out of the table: %s; run it again with --rows %s",
                    p.spec.name,
                    p.run_dir,
                    why,
                    p.spec.name,
                )
        else:
            if p.action == "changed":
                _move_aside(p.run_dir)
            queued.append((p, p.previous if p.action == "rescore" else None))
    if jobs > 1 and len(queued) > 1:
        results += _run_parallel(exp, queued, prep, data_id, skey, device, jobs)
        queued = []
    for p, previous in queued:
        hooks = (
            hooks_for(p.spec.name, p.cfg.train.seed, p.cfg.train.max_steps) if hooks_for else None
        )
        results.append(
            _train_run(
                exp,
                p.spec,
                p.cfg,
                p.run_dir,
                prep,
                (train_key(p.cfg, data_id), skey),
                device,
                hooks,
                previous,
            )
        )
    order = {(s.name, seed): k for k, s in enumerate(exp.rows) for seed in exp.seed_list(seeds)}
    results.sort(key=lambda r: order.get((r.row, r.seed), len(order)))
    table = aggregate(exp, results) + list(extra_rows)
    done = {r.row for r in results}
    missing = [s.name for s in exp.rows if s.name not in done]
    report = Table3Report(table, results, missing)
    if train or results:
        out.mkdir(parents=True, exist_ok=True)
        report.files = write_outputs(report, out, exp)
    return report


def _child_init(threads: int) -> None:
    """A worker process of `_run_parallel`: its share of the cores, its log lines on stderr
    with the process's name, SIGINT left to the parent (which stops the workers with
    SIGTERM, so that each saves its run before it exits)."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(processName)s %(message)s", force=True
    )


def _run_parallel(
    exp: Table3Experiment,
    queued: Sequence[tuple[_Plan, RunResult | None]],
    prepared: Path,
    data_id: dict[str, Any],
    skey: dict[str, Any],
    device: str,
    jobs: int,
) -> list[RunResult]:
    """Train (or rescore) the queued runs `jobs` at a time in `jobs` worker processes
    (fresh ones, spawned: each run in a process that has only this sweep's threads), and
    return the results of those that finished, in the order they finished.

    A row of the tiny model keeps a GPU busy for a fraction of each step (the step is
    bound by launching kernels from Python), so several rows in parallel processes share
    one GPU at little cost to each. Each run directory is its own; the table is written
    once, by the caller, when all are done. A signal (SIGTERM, Ctrl-C) to this process
    is passed to the workers, each saves its run, no queued run starts, and
    RecipeStoppedError is raised: the same call resumes.
    """
    import multiprocessing as mp
    import os
    import signal
    from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

    from aiayn.experiments.stages import RecipeStoppedError

    threads = max(1, (os.cpu_count() or 1) // jobs)
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    results: list[RunResult] = []
    failed: list[str] = []
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, len(queued)),
        mp_context=mp.get_context("spawn"),
        initializer=_child_init,
        initargs=(threads,),
    )
    todo = list(queued)
    pending: dict[Future[RunResult], _Plan] = {}

    def submit_next() -> None:
        # one run per free worker, never more: the pool would queue the rest in its
        # workers' queue, from where a worker takes the next run even after a stop
        p, previous = todo.pop(0)
        keys = (train_key(p.cfg, data_id), skey)
        args = (exp, p.spec, p.cfg, p.run_dir, prepared, keys, device, None, previous)
        pending[pool.submit(_train_run, *args)] = p

    try:
        log.info("%d runs, %d at a time (%d threads each)", len(todo), jobs, threads)
        for _ in range(min(jobs, len(todo))):
            submit_next()
        while pending:
            done, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            if received:
                break
            for f in done:
                p = pending.pop(f)
                try:
                    results.append(f.result())
                except Exception as e:  # one row's failure leaves the others running
                    failed.append(f"{p.spec.name} seed {p.cfg.train.seed} ({p.run_dir}): {e}")
                    log.error("row %s seed %d failed: %s", p.spec.name, p.cfg.train.seed, e)
                if todo and not received:
                    submit_next()
        if received:  # every pending run is running: nothing else was handed to the pool
            for proc in list(getattr(pool, "_processes", {}).values()):
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGTERM)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if received:
        name = signal.Signals(received[0]).name
        stopped = RecipeStoppedError(name, 0, prepared)
        stopped.args = (
            f"stopped by {name}: {len(results)} runs finished, the others saved where they "
            "were; rerun the same command to resume",
        )
        raise stopped
    if failed:
        raise RuntimeError("runs failed (the others finished): " + "; ".join(failed))
    return results


def aggregate(exp: Table3Experiment, results: Sequence[RunResult]) -> list[TableRow]:
    """One table row per row of the file that has results: the mean over its seeds, with
    the range."""
    rows = []
    for spec in exp.rows:
        runs = [r for r in results if r.row == spec.name]
        if not runs:
            continue
        s = settings_of(exp.config(spec, exp.base.train.seed))
        ppl = [r.dev_ppl for r in runs]
        bleu = [r.dev_bleu for r in runs]
        rows.append(
            TableRow(
                row=spec.name,
                paper=spec.paper,
                base="base",
                **s,
                steps=min(r.steps for r in runs),
                steps_max=max(r.steps for r in runs),
                seeds=len(runs),
                dev_ppl=mean(ppl),
                dev_ppl_min=min(ppl),
                dev_ppl_max=max(ppl),
                dev_bleu=mean(bleu),
                dev_bleu_min=min(bleu),
                dev_bleu_max=max(bleu),
                bleu_metric="sacreBLEU",
                params=runs[0].params,
                source="sweep",
                note=spec.note,
                machine="; ".join(sorted({r.machine for r in runs if r.machine})),
            )
        )
    return rows


# --------------------------------------------------------------------------- the table
@dataclass
class TableRow:
    """One row of the output table (and of its CSV): settings, our dev scores (mean over
    seeds, and their range), the row it is measured against (`base`) and the paper row
    it stands for (`paper`). What the paper says and the directions are derived from
    these (`compare`), so a CSV read back gives the same table."""

    row: str
    paper: str | None
    base: str
    N: int
    d_model: int
    d_ff: int
    h: int
    d_k: int
    d_v: int
    P_drop: float
    eps_ls: float
    positional: str
    steps: int
    steps_max: int
    seeds: int
    dev_ppl: float | None
    dev_ppl_min: float | None
    dev_ppl_max: float | None
    dev_bleu: float | None
    dev_bleu_min: float | None
    dev_bleu_max: float | None
    bleu_metric: str
    params: int | None
    source: str
    note: str = ""
    machine: str = ""  # where the row trained (`manifest.machine_name`); "" if not recorded


@dataclass(frozen=True)
class Verdict:
    """One metric of one row against its base row: our change, the paper's, the direction
    ("same", "opposite", "tie"; "" when either is unknown), and whether our change lies
    within the seeds' spread (None when the row and its base have one seed each)."""

    ours: float | None
    paper: float | None
    direction: str
    within_spread: bool | None


def direction(paper_delta: float | None, our_delta: float | None, tie: float) -> str:
    """ "same" when both changes have one sign, "opposite" when not, "tie" when either is
    smaller than `tie` (rounds to zero at the paper's precision), "" when one is unknown."""
    if paper_delta is None or our_delta is None:
        return ""
    if abs(paper_delta) < tie or abs(our_delta) < tie:
        return "tie"
    return "same" if (paper_delta > 0) == (our_delta > 0) else "opposite"


def _verdict(row: TableRow, base: TableRow | None, metric: str) -> Verdict:
    value, lo, hi = (getattr(row, f"dev_{metric}{s}") for s in ("", "_min", "_max"))
    paper = PAPER_TABLE3.get(row.paper or "")
    paper_delta = (
        None
        if paper is None
        else round(getattr(paper, metric) - getattr(PAPER_TABLE3["base"], metric), 4)
    )
    if base is None or value is None or getattr(base, f"dev_{metric}") is None:
        return Verdict(None, paper_delta, "", None)
    ours = value - getattr(base, f"dev_{metric}")
    within = None
    # one side's seeds are enough: a one-seed row against the base row's several seeds
    # (the cheap way to measure the spread) is within it when its value is in their range
    if row.seeds > 1 or base.seeds > 1:
        b_lo, b_hi = getattr(base, f"dev_{metric}_min"), getattr(base, f"dev_{metric}_max")
        within = lo <= b_hi and b_lo <= hi
    return Verdict(ours, paper_delta, direction(paper_delta, ours, TIE[metric]), within)


def compare(rows: Sequence[TableRow]) -> dict[str, tuple[Verdict, Verdict]]:
    """Each row (but base rows) by label: its dev PPL and dev BLEU verdicts."""
    by_label = {r.row: r for r in rows}
    return {
        r.row: (_verdict(r, by_label.get(r.base), "ppl"), _verdict(r, by_label.get(r.base), "bleu"))
        for r in rows
        if r.row != r.base
    }


def summary(rows: Sequence[TableRow]) -> list[str]:
    """One line per metric: "dev PPL: N of M rows point the paper's way (...)"."""
    verdicts = compare(rows)
    lines = []
    for i, name in enumerate(("dev PPL", "dev BLEU")):
        judged = {label: v[i] for label, v in verdicts.items() if v[i].direction}
        if not judged:
            continue
        same = [k for k, v in judged.items() if v.direction == "same"]
        opposite = [k for k, v in judged.items() if v.direction == "opposite"]
        ties = [k for k, v in judged.items() if v.direction == "tie"]
        line = (
            f"{name}: {len(same)} of {len(judged)} rows point the paper's way "
            f"({100 * len(same) / len(judged):.0f}%); {len(opposite)} opposite"
        )
        if opposite:
            covered = [k for k in opposite if judged[k].within_spread]
            unjudged = [k for k in opposite if judged[k].within_spread is None]
            line += f" ({', '.join(opposite)}"
            if len(unjudged) < len(opposite):
                line += f"; {len(covered)} of them within the seeds' spread"
                if unjudged:  # one seed for the row and its base: no spread to measure
                    line += f", {', '.join(unjudged)} one seed a side"
            line += ")"
        line += f", {len(ties)} tie{'' if len(ties) == 1 else 's'}"
        line += f" ({', '.join(ties)})" if ties else ""
        lines.append(line)
    return lines


def _score(value: float | None, lo: float | None, hi: float | None, seeds: int) -> str:
    if value is None:
        return ""
    if seeds > 1 and lo is not None and hi is not None:
        return f"{value:.2f} ({lo:.2f}-{hi:.2f})"
    return f"{value:.2f}"


def _way(v: Verdict) -> str:
    if v.direction == "opposite" and v.within_spread:
        return "opposite (in spread)"
    return v.direction


def cells(rows: Sequence[TableRow]) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells, in the paper's layout: a setting equal to the base
    row's is left blank (the base row shows all of them)."""
    verdicts = compare(rows)
    by_label = {r.row: r for r in rows}
    with_paper = any(r.row != r.paper for r in rows)
    with_seeds = any(r.seeds > 1 for r in rows)
    metrics = {r.bleu_metric for r in rows if r.dev_bleu is not None}
    header = ["row"] + (["paper row"] if with_paper else [])
    header += ["N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls", "positional"]
    header += ["steps"] + (["seeds"] if with_seeds else []) + ["dev PPL", "dev BLEU"]
    header += ["BLEU"] if len(metrics) > 1 else []
    header += ["params", "paper PPL", "paper BLEU", "paper params", "PPL way", "BLEU way"]
    with_machine = len({r.machine for r in rows}) > 1
    header += ["machine"] if with_machine else []
    body = []
    for r in rows:
        base = by_label.get(r.base)
        shown = r.row == r.base or base is None
        line = [r.row] + ([r.paper or ""] if with_paper else [])
        for key in SETTINGS:
            value = getattr(r, key)
            if not shown and base is not None and getattr(base, key) == value:
                line.append("")
            else:
                line.append(f"{value:g}" if isinstance(value, float) else str(value))
        steps = str(r.steps) if r.steps == r.steps_max else f"{r.steps}-{r.steps_max}"
        line += [steps] + ([str(r.seeds)] if with_seeds else [])
        line += [
            _score(r.dev_ppl, r.dev_ppl_min, r.dev_ppl_max, r.seeds),
            _score(r.dev_bleu, r.dev_bleu_min, r.dev_bleu_max, r.seeds),
        ]
        line += [r.bleu_metric] if len(metrics) > 1 else []
        paper = PAPER_TABLE3.get(r.paper or "")
        line += [
            "" if r.params is None else f"{r.params / 1e6:.2f}M",
            "" if paper is None else f"{paper.ppl:.2f}",
            "" if paper is None else f"{paper.bleu:.1f}",
            "" if paper is None or paper.params_m is None else f"{paper.params_m:g}M",
        ]
        v = verdicts.get(r.row)
        line += ["", ""] if v is None else [_way(v[0]), _way(v[1])]
        line += [r.machine] if with_machine else []
        body.append(line)
    return header, body


def format_table(rows: Sequence[TableRow], title: str = "") -> str:
    """The table as aligned text, then the summary lines."""
    header, body = cells(rows)
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = [title] if title else []
    for line in [header, *body]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    return "\n".join([*lines, "", *summary(rows)])


def markdown(rows: Sequence[TableRow]) -> str:
    """The table as markdown (docs/results.md), then the summary lines."""
    header, body = cells(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    text = "\n".join(lines)
    return text + "\n\n" + "\n".join(f"{s}." if not s.endswith(".") else s for s in summary(rows))


# --------------------------------------------------------------------------- files
#: TableRow's columns a CSV may lack (written by a version before them): their defaults.
_OPTIONAL_COLUMNS = ("note", "machine")

#: Columns the CSV adds after TableRow's own: derived, ignored when it is read back.
DERIVED = (
    "paper_ppl",
    "paper_bleu",
    "paper_params_m",
    "ppl_change",
    "paper_ppl_change",
    "ppl_way",
    "ppl_within_spread",
    "bleu_change",
    "paper_bleu_change",
    "bleu_way",
    "bleu_within_spread",
)


def _csv_value(x: Any) -> str:
    if x is None:
        return ""
    return repr(x) if isinstance(x, float) else str(x)


def to_csv(rows: Sequence[TableRow]) -> str:
    """The rows as CSV: TableRow's fields, then the paper's numbers and the verdicts."""
    verdicts = compare(rows)
    buf = io.StringIO()
    names = [f.name for f in fields(TableRow)]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(names + list(DERIVED))
    for r in rows:
        paper = PAPER_TABLE3.get(r.paper or "")
        v = verdicts.get(r.row)
        derived: list[Any] = [
            None if paper is None else paper.ppl,
            None if paper is None else paper.bleu,
            None if paper is None else paper.params_m,
        ]
        for i in (0, 1):
            derived += (
                [None] * 4
                if v is None
                else [v[i].ours, v[i].paper, v[i].direction, v[i].within_spread]
            )
        w.writerow([_csv_value(getattr(r, n)) for n in names] + [_csv_value(x) for x in derived])
    return buf.getvalue()


def read_csv(path: str | Path) -> list[TableRow]:
    """A table3.csv read back (its derived columns are recomputed, not read).

    Raises:
        InputError: a missing column or a bad number, naming the file and line.
    """
    from aiayn.files import InputError

    types = {f.name: f.type for f in fields(TableRow)}
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}): not a table3.csv") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.DictReader(f)
        have = set(reader.fieldnames or [])
        missing = [n for n in types if n not in have and n not in _OPTIONAL_COLUMNS]
        if missing:
            raise InputError(f"{path}: not a table3 CSV (no column {', '.join(missing)})")
        for line, raw in enumerate(reader, start=2):
            values: dict[str, Any] = {}
            for name, typ in types.items():
                if name not in have:
                    continue  # an optional column, from before it was written: its default
                text = raw[name]
                try:
                    if text == "" and "None" in str(typ):
                        values[name] = None
                    elif str(typ).startswith("int"):
                        values[name] = int(text)
                    elif str(typ).startswith("float"):
                        values[name] = float(text)
                    else:
                        values[name] = text
                except ValueError:
                    raise InputError(f"{path}, line {line}: {name} = {text!r}") from None
            rows.append(TableRow(**values))
    return rows


def combine(tables: Sequence[tuple[str, Sequence[TableRow]]]) -> list[TableRow]:
    """Several tables (e.g. sweeps on different machines) as one, each row still measured
    against the base row of its own table.

    `tables` is (name, rows) per table, the name a file's for messages. Where more than
    one table has a row called "base", each is renamed "base (MACHINE)", MACHINE being
    the machine its table's base row trained on (or the table's name where none is
    recorded), and the rows that pointed at it follow: a row's change is measured on the
    machine that trained it, where the bf16 kernels (and the base) are its own.

    Raises:
        InputError: a row name (other than "base") in two tables, naming both.
    """
    from aiayn.files import InputError

    bases = sum(1 for _, rows in tables if any(r.row == "base" for r in rows))
    out: list[TableRow] = []
    seen: dict[str, str] = {}
    for name, rows in tables:
        rename: dict[str, str] = {}
        if bases > 1:
            base = next((r for r in rows if r.row == "base"), None)
            if base is not None:
                rename["base"] = f"base ({base.machine or Path(name).stem})"
        for r in rows:
            label = rename.get(r.row, r.row)
            if label in seen:
                raise InputError(
                    f"{name}: row {label} is also in {seen[label]}: a row can be in one table "
                    "only (a machine's second base row needs its own machine name)"
                )
            seen[label] = name
            out.append(replace(r, row=label, base=rename.get(r.base, r.base)))
    return out


def to_json(report: Table3Report, exp: Table3Experiment | None = None) -> dict[str, Any]:
    verdicts = compare(report.rows)
    return {
        "experiment": None if exp is None else str(exp.path),
        "recipe": None if exp is None else str(exp.recipe_path),
        "scale": None if exp is None else exp.scale,
        "dev_decode": None if exp is None else exp.dev_decode,
        "rows": [
            {
                **asdict(r),
                "verdicts": None
                if r.row not in verdicts
                else dict(zip(("ppl", "bleu"), map(asdict, verdicts[r.row]), strict=True)),
            }
            for r in report.rows
        ],
        "summary": summary(report.rows),
        "missing": report.missing,
        "runs": [asdict(r) for r in report.runs],
        "paper": {k: asdict(v) for k, v in PAPER_TABLE3.items()},
        "tie": TIE,
    }


def write_outputs(
    report: Table3Report, out: Path, exp: Table3Experiment | None = None
) -> list[Path]:
    """DIR/table3.csv and DIR/table3.json."""
    paths = [out / "table3.csv", out / "table3.json"]
    write_text_atomic(paths[0], to_csv(report.rows))
    write_text_atomic(paths[1], json.dumps(to_json(report, exp), indent=1) + "\n")
    return paths


# --------------------------------------------------------------------------- the probes
_PROBE_KEYS = r"N|d_model|d_ff|h|d_k|d_v|P_drop|eps_ls"
_PROBE_SETTING = re.compile(
    rf"\b((?:(?:{_PROBE_KEYS})\s*=?\s*)+)(\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+(?:\.\d+)?)"
)


def probe_settings(text: str, base: dict[str, Any]) -> dict[str, Any]:
    """The Table 3 settings a probe's name states ("h = 8, d_k = d_v = 16", "P_drop 0.2",
    "learned positional embeddings ..."), applied to `base`."""
    row = dict(base)
    for names, value in _PROBE_SETTING.findall(text):
        for key in re.findall(rf"\b(?:{_PROBE_KEYS})\b", names):
            number = value.replace(",", "")
            row[key] = float(number) if key in _RATES else int(float(number))
    if re.search(r"learned positional", text, re.I):
        row["positional"] = "learned"
    return row


def import_probes(
    path: str | Path, base_cfg: Config, vocab_size: int
) -> tuple[list[TableRow], list[str]]:
    """The probes of docs/m30k-en-de-probes.csv that are Table 3 rows, as table rows.

    Each probe there is one change to the recipe (`base_cfg`, the En->De recipe) with its
    val tok-BLEU and that of the recipe run it is paired with (same machine, same seed).
    Rows whose `knob` is Table 3's become rows here: their settings read from the probe's
    name, the paper row they stand for inferred (`paper_analog`), dev BLEU their val
    tok-BLEU (alpha chosen on val, as the recipe does; not sacreBLEU), measured against a
    base row per machine made of the paired recipe runs. The CSV records no dev
    perplexity, so these rows have none. Params are counted on the model the settings
    give with a `vocab_size` vocabulary.

    Returns:
        The rows (each machine's base row first), and a line for each Table 3 probe left
        out and why.
    """
    from aiayn.files import InputError

    base = settings_of(base_cfg)
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}): not a table3.csv") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.DictReader(f)
        need = {"probe", "knob", "machine", "seed", "steps", "recipe_val", "arm_val"}
        if not need <= set(reader.fieldnames or []):
            raise InputError(f"{path}: not a probes CSV (columns {', '.join(sorted(need))})")
        for line, raw in enumerate(reader, start=2):
            if not raw["knob"].startswith("Table 3"):
                continue
            g = groups.setdefault(
                (raw["probe"], raw["machine"]),
                {"steps": raw["steps"], "section": raw.get("section", ""), "recipe": [], "arm": []},
            )
            try:
                if raw["recipe_val"] and raw["arm_val"]:
                    g["recipe"].append(float(raw["recipe_val"]))
                    g["arm"].append(float(raw["arm_val"]))
            except ValueError:
                raise InputError(f"{path}, line {line}: a val score is not a number") from None
    bases: dict[tuple[str, tuple[float, ...]], TableRow] = {}
    members: dict[str, list[TableRow]] = {}
    skipped = []
    for (probe, machine), g in groups.items():
        settings = probe_settings(probe, base)
        analog = paper_analog(base, settings)
        if not g["arm"]:
            skipped.append(f"{probe} ({machine}): no val BLEU recorded")
            continue
        if analog is None or analog == "base":
            skipped.append(
                f"{probe} ({machine}): changes {_describe(moves(base, settings))}: "
                "no one row of the paper's Table 3 does"
            )
            continue
        key = (machine, tuple(g["recipe"]))
        if key not in bases:
            n = sum(1 for m, _ in bases if m == machine)
            label = f"recipe ({machine})" + (f" #{n + 1}" if n else "")
            bases[key] = _probe_row(
                label,
                "base",
                label,
                base,
                g["recipe"],
                base_cfg,
                vocab_size,
                base_cfg.train.max_steps,
                f"the paired recipe runs; {machine}",
            )
            members[label] = []
        members[bases[key].row].append(
            _probe_row(
                probe,
                analog,
                bases[key].row,
                settings,
                g["arm"],
                base_cfg,
                vocab_size,
                int(g["steps"]),
                f"{machine}; {g['section']}",
            )
        )
    return [r for b in bases.values() for r in [b, *members[b.row]]], skipped


def _probe_row(
    label: str,
    paper: str,
    base: str,
    settings: dict[str, Any],
    bleu: list[float],
    base_cfg: Config,
    vocab_size: int,
    steps: int,
    note: str,
) -> TableRow:
    from aiayn.model import Transformer, count_parameters

    model = replace(
        base_cfg.model,
        **{k: settings[k] for k in SETTINGS if k != "eps_ls"},
        vocab_size=vocab_size,
    )
    return TableRow(
        row=label,
        paper=paper,
        base=base,
        **settings,
        steps=steps,
        steps_max=steps,
        seeds=len(bleu),
        dev_ppl=None,
        dev_ppl_min=None,
        dev_ppl_max=None,
        dev_bleu=mean(bleu),
        dev_bleu_min=min(bleu),
        dev_bleu_max=max(bleu),
        bleu_metric="tok-BLEU",
        params=count_parameters(Transformer(model)),
        source="probes",
        note=note,
    )
