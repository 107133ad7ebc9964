"""A recipe: one experiment file run end to end, data to scores, with a manifest of the run.

One pipeline for every task (`aiayn.experiments.tasks`: translation, parsing), each stage
writing files into one run directory:

    task.prepare   RUN/data/: the corpus (downloaded or copied, verified by sha256), and
                   RUN/data/prepared/: subword model, id tensors, manifest
    train          RUN/checkpoint_*.pt (resumable: rerunning continues); with [recipe]
                   ensemble = K > 1, RUN/member1/ ... memberK/, a training run each
    average        RUN/checkpoint_avg.pt: the average of the last checkpoints (section 6.1)
    task.tune      decoding settings chosen on the development set (RUN/tune_alpha/, RUN/tune/)
    task.test      the test set decoded and scored (RUN/TEST.SRC-TGT.hyp, RUN/test.trees)
    RUN/results.json   scores with signatures, and the run's manifest

The experiment file is a preset plus overrides (see `config.load_experiment`) and a
[recipe] table for what is not a model, training or decoding setting; its `task` picks
the task.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from aiayn.config import Config
from aiayn.experiments.manifest import cpu_kernels, environment
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.stages import RecipeStoppedError, plot_runs, train_and_average
from aiayn.experiments.tasks import TASKS, RunContext, Task, load_experiment, load_recipe
from aiayn.files import sha256_file, write_text_atomic
from aiayn.training.trainer import Hooks

__all__ = [
    "RecipeConfig",
    "RecipeStoppedError",
    "cpu_kernels",
    "format_results",
    "load_recipe",
    "run_recipe",
]

log = logging.getLogger(__name__)


def run_recipe(
    path: str | Path,
    out: str | Path,
    *,
    data: str | Path | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    hooks: Hooks | None = None,
    experiment: tuple[Config, RecipeConfig, Task] | None = None,
) -> dict[str, Any]:
    """Run an experiment file end to end; see the module docstring for the files it writes.

    Args:
        path: the experiment file (TOML) with a [recipe] table.
        out: the run directory; rerunning resumes training and redoes the later stages.
        data: a local copy of the corpus (e.g. ../shared/data/multi30k; for parsing, a
            treebank: ../shared/data/ptb-sample/treebank.zip); None downloads it.
        device: "cpu", "cuda", ...
        overrides: config keys to change (as `--set`), e.g. {"train.max_minutes": 60}.
        hooks: training callbacks (the CLI's progress bar).
        experiment: the file as `load_experiment(path, overrides)` read it already (the
            CLI reads it once, to size its progress bar), or None to read it here.

    Returns:
        The results dictionary also written to RUN/results.json.
    """
    from aiayn.config import ConfigError
    from aiayn.experiments.stages import check_stopped, train_stage
    from aiayn.training.distributed import init_from_env

    cfg, recipe, task = experiment or load_experiment(path, overrides)
    # Under torchrun, every rank runs this function: rank 0 prepares the data while the
    # others wait, every rank trains (one DDP job), and rank 0 alone averages, decodes
    # and scores; the others return once training is done.
    ctx, _ = init_from_env(device)
    if ctx.active and (not task.distributed or recipe.ensemble > 1):
        raise ConfigError(
            f"{path}: under torchrun, `aiayn recipe` runs translation recipes of one model; "
            "run this one in one process (parsing and ensembles train on one device each)"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    clock = time.perf_counter

    if not ctx.is_main:
        ctx.barrier()  # rank 0 has prepared the data
        _, trained = train_stage(recipe, cfg, out / "data" / "prepared", out, device, None)
        check_stopped(trained, out)
        return {"rank": ctx.rank, "world_size": ctx.world_size, "train": trained[0]}
    t0 = clock()
    data_ = task.prepare(recipe, cfg, out, data)
    ctx.barrier()
    wall["data_and_prepare_s"] = clock() - t0
    t = train_and_average(recipe, cfg, data_.prepared, out, device, hooks, wall)

    train_record = {k: v for k, v in t.trained[0].items() if k not in ("flops", "seed")}
    if len(t.runs) > 1:
        # trained side by side: the stage's time is the longest member's, the tokens add up
        train_record.update(
            train_seconds=max(r["train_seconds"] for r in t.trained),
            tokens=sum(r["tokens"] for r in t.trained),
        )
    run = RunContext(recipe, cfg, out, device, wall, train_record)
    decode, tuning = task.tune(t, data_, cfg.decode, run)
    outcome = task.test(t, data_, decode, run)
    train_record.update(outcome.train)

    flops = sum(r["flops"] for r in t.trained)
    train_seconds = train_record["train_seconds"]
    results = {
        "task": task.name,
        "experiment": str(path),
        "test_split": task.test_split(recipe),
        "scores": outcome.scores,
        "averaged": t.averaged[0],
        "train": train_record,
        "flops": {
            "counted_from_model": flops,
            "estimated_time_x_devices_x_peak": train_seconds * t.peak,
            "sustained_peak_flop_s": t.peak,
            "peak_dtype": str(t.peak_dtype),
            "model_flop_s": flops / max(train_seconds, 1e-9),
        },
        "wall_seconds": wall,
        **outcome.results,
        task.tuning_key: tuning,
        "parameters": sum(p.numel() for p in t.models[0].parameters()),
        "ensemble": len(t.models),
        "seed": cfg.train.seed,
        "recipe": asdict(recipe),
        # the decode settings the test set was decoded with (as tuned)
        "config": replace(t.cfg, decode=decode).to_dict(),
        "data": {
            "prepared_manifest_sha256": sha256_file(data_.prepared / "manifest.json"),
            "vocab_sha256": data_.manifest["spm_model"]["sha256"],
            **data_.record,
            **outcome.data,
        },
        **environment(),
    }
    write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    plot_runs(out, t.runs, t.trained, task.label(recipe), str(path))
    return results


def format_results(results: dict[str, Any]) -> str:
    """The results of `run_recipe` for the terminal, as their task writes them (every BLEU
    convention with its signature; a parsing run's F1 by both scorers)."""
    return TASKS[results.get("task", "translate")].format(results)
