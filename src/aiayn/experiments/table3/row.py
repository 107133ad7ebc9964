"""One row, one seed: trained and scored in its run directory, resumed, or refused when its
settings changed (the module docstring of `aiayn.experiments.table3` says what each file
holds)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.config import (
    Config,
)
from aiayn.experiments import stages
from aiayn.experiments.manifest import machine_name
from aiayn.experiments.table3.grid import RowSpec, Table3Experiment
from aiayn.experiments.table3.table import RunResult
from aiayn.files import write_text_atomic

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass

if TYPE_CHECKING:
    from aiayn.training.trainer import Hooks

log = logging.getLogger(__name__)


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
