"""The sweep: the data prepared once, every row and seed run (in parallel with --jobs), the
runs aggregated into the table and its files written."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

from aiayn.config import (
    ConfigError,
)
from aiayn.experiments.table3.files import write_outputs
from aiayn.experiments.table3.grid import Table3Experiment, select_rows
from aiayn.experiments.table3.paper import settings_of
from aiayn.experiments.table3.row import (
    _data_id,
    _move_aside,
    _Plan,
    _plan,
    _train_run,
    score_key,
    train_key,
)
from aiayn.experiments.table3.table import RunResult, Table3Report, TableRow
from aiayn.files import write_text_atomic

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass

if TYPE_CHECKING:
    from aiayn.training.trainer import Hooks

log = logging.getLogger(__name__)


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
