"""RELIABILITY group A: a run killed at any step and rerun with the same command continues
bitwise as if never interrupted (losses, weights, optimizer, counters); signals save and
stop; resuming with other settings or other data is refused.

"Bitwise" as in RELIABILITY.md section 2: loss lists compare with == on Python floats,
every tensor of model, optimizer and train state with torch.equal, counters with ==.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.checkpoints import list_checkpoints, load_checkpoint
from aiayn.cli import main
from aiayn.config import apply_overrides, get_preset
from aiayn.data.prepare import prepare
from aiayn.files import read_lines, sha256_file
from aiayn.training import trainer as train_mod
from aiayn.training.persistence import Checkpoints
from aiayn.training.trainer import Hooks, Trainer, train
from helpers import SMALL_TRAINING, step_losses, tiny_config

# Dropout on, so the comparison also covers the random masks; ~8 batches an epoch, so 40
# steps cross 4 epoch boundaries.
SMALL = {**SMALL_TRAINING}
K = SMALL["save_interval_steps"]
ENV = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
TIMING = {"train_seconds"}  # wall time, the one counter that may differ


def cfg(**over: Any):
    return tiny_config(SMALL, **over)


def cli_train(
    data: Path,
    run: Path,
    *,
    faults: str = "",
    extra: tuple[str, ...] = (),
    check: bool = True,
    **over: Any,
) -> subprocess.CompletedProcess[str]:
    sets = [a for k, v in {**SMALL, **over}.items() for a in ("--set", f"{k}={v}")]
    env = {**ENV, "AIAYN_FAULTS": faults} if faults else ENV
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "train",
            str(data),
            "--out",
            str(run),
            "--preset",
            "tiny",
            "--no-progress",
            *sets,
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    """torch.equal on every tensor, == on everything else (train_seconds excepted)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            if k not in TIMING:
                assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def final_state(run: Path) -> dict[str, Any]:
    ck = load_checkpoint(run / "checkpoint_last.pt")
    return {k: ck[k] for k in ("model", "optimizer", "train_state", "step", "epoch")}


@pytest.fixture(scope="module")
def baseline(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 40-step run every resumed run must equal."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    cli_train(small_data, run)
    return run


def _kill_and_resume(small_data: Path, baseline: Path, run: Path, kill_at: int) -> int:
    killed = cli_train(small_data, run, faults=f"kill_at_step={kill_at}", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    saved_before = (kill_at - 1) // K * K  # newest checkpoint the killed run wrote
    resumed = cli_train(small_data, run)  # the same command again
    if saved_before:
        assert (
            f"resumed from {run / f'checkpoint_{saved_before}.pt'}: step {saved_before},"
            in resumed.stderr
        )
    lost = (kill_at - 1) - saved_before
    assert lost < K  # steps redone
    base = dict(step_losses(baseline))
    seen = step_losses(run)
    assert {s for s, _ in seen} == set(range(1, SMALL["max_steps"] + 1))
    for step, loss in seen:  # first passes and replays alike
        assert loss == base[step], (kill_at, step)
    assert_bitwise(final_state(baseline), final_state(run), f"kill at {kill_at}")
    return lost


@pytest.mark.rows("A1")
def test_kill_9_and_rerun_is_bitwise_equal(
    small_data: Path, baseline: Path, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """A1: `kill -9` at random steps (3 draws here, 20 in the slow test), then the same
    command: auto-resume from the newest checkpoint, bitwise equal losses, weights,
    optimizer and counters; fewer than save-interval steps redone."""
    rng = random.Random()
    draws = [rng.randrange(2, SMALL["max_steps"] + 1) for _ in range(3)]
    lost = [
        _kill_and_resume(small_data, baseline, tmp_path / f"r{i}", kill_at)
        for i, kill_at in enumerate(draws)
    ]
    record_property("faults", {"kill -9 during a step": len(draws)})
    record_property("steps_lost", lost)


@pytest.mark.slow
@pytest.mark.rows("A1")
def test_kill_9_and_rerun_20_draws(
    small_data: Path, baseline: Path, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """A1 with the matrix's 20 random kill steps."""
    rng = random.Random()
    lost = [
        _kill_and_resume(small_data, baseline, tmp_path / f"r{i}", rng.randrange(2, 41))
        for i in range(20)
    ]
    record_property("faults", {"kill -9 during a step": 20})
    record_property("steps_lost", lost)


@pytest.mark.slow
@pytest.mark.rows("A1")
def test_kill_9_and_rerun_is_bitwise_equal_in_fp16(
    small_data: Path, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """A1 in fp16 mixed precision (the CPU's float16 autocast and GradScaler): `kill -9`
    at a random step of a 20-step run, then the same command: bitwise equal losses,
    weights, Adam, counters and the loss scaler's scale and growth tracker. (Resuming
    just after an overflow-skipped step: tests/training/test_fp16.py.)"""
    steps = 20
    baseline = tmp_path / "baseline"
    cli_train(small_data, baseline, dtype="fp16", max_steps=steps)
    kill_at = random.Random().randrange(2, steps + 1)
    run = tmp_path / "run"
    killed = cli_train(
        small_data,
        run,
        faults=f"kill_at_step={kill_at}",
        check=False,
        dtype="fp16",
        max_steps=steps,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    cli_train(small_data, run, dtype="fp16", max_steps=steps)
    assert dict(step_losses(run)) == dict(step_losses(baseline))
    a, b = (load_checkpoint(r / "checkpoint_last.pt") for r in (baseline, run))
    assert a["grad_scaler"]["_growth_tracker"] == steps  # no overflow: 20 clean steps
    assert_bitwise(final_state(baseline), final_state(run), f"fp16, kill at {kill_at}")
    assert_bitwise(a["grad_scaler"], b["grad_scaler"], "grad_scaler")
    record_property("faults", {"kill -9 during an fp16 step": 1})


def _crash_at(
    data: Path,
    run: Path,
    step: int,
    monkeypatch: pytest.MonkeyPatch,
    ids: list[tuple[int, list[int]]],
) -> None:
    """Train in this process until a fault raises as `step` starts (a crash)."""
    monkeypatch.setenv("AIAYN_FAULTS", f"raise_at_step={step}")
    hooks = Hooks(on_batch=lambda s, e, p, i: ids.append((s, i.tolist())))
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg(), data, run, hooks=hooks)
    monkeypatch.delenv("AIAYN_FAULTS")


@pytest.mark.rows("A2", "A3")
def test_resume_has_teeth_and_replays_the_data_order(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A3: crash mid-epoch at step 23 and resume: the examples consumed over the whole run
    are the uninterrupted run's, in the same order, none skipped or repeated.
    A2, negative controls in the same process (so only the removed piece differs):
    resuming without the per-step reseeding of the random generator (what restores the
    dropout masks here), or without the data position, must fail the comparison."""
    torch.set_num_threads(1)
    full_ids: list[tuple[int, list[int]]] = []
    train(
        cfg(),
        small_data,
        tmp_path / "full",
        hooks=Hooks(on_batch=lambda s, e, p, i: full_ids.append((s, i.tolist()))),
    )
    base = dict(step_losses(tmp_path / "full"))

    def resumed_run(name: str, patch: Any = None) -> tuple[list, dict[int, float]]:
        run, ids = tmp_path / name, []
        _crash_at(small_data, run, 23, monkeypatch, ids)
        ids = [x for x in ids if x[0] <= 20]  # what the step-20 checkpoint covers
        with monkeypatch.context() as m:
            if patch:
                patch(m)
            train(
                cfg(),
                small_data,
                run,
                hooks=Hooks(on_batch=lambda s, e, p, i: ids.append((s, i.tolist()))),
            )
        return ids, dict(step_losses(run))

    ids, losses = resumed_run("ok")
    assert ids == full_ids  # order, and so the multiset, identical
    assert losses == base
    # A2: no reseeding -> the resumed steps draw other dropout masks
    _, losses = resumed_run(
        "no_rng", lambda m: m.setattr(train_mod, "_seed_step", lambda *a, **k: None)
    )
    assert [s for s in range(21, 41) if losses[s] != base[s]] != []
    assert all(losses[s] == base[s] for s in range(1, 21))
    # A2: the data position not restored -> the epoch starts again
    real = Checkpoints.resume

    def forget_position(self: Checkpoints, *a: Any) -> Any:
        found = real(self, *a)
        if found is not None:
            found[0].batch_in_epoch = 0
        return found

    ids, losses = resumed_run("no_pos", lambda m: m.setattr(Checkpoints, "resume", forget_position))
    assert ids != full_ids and losses[21] != base[21]


@pytest.mark.rows("A4")
def test_resume_restores_every_counter_and_says_so(
    small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A4: after resume, step, epoch, LR, Adam's step, best validation NLL and the patience
    counter equal the saved values, and the log prints them; the first checkpoint after
    the resume is a new file, the newer ones untouched."""
    torch.set_num_threads(1)
    run = tmp_path / "run"
    c = cfg(max_steps=20, patience=50, valid_interval_steps=5)
    train(c, small_data, run)
    saved = load_checkpoint(run / "checkpoint_20.pt")
    digests = {p.name: sha256_file(p) for p in list_checkpoints(run)}
    with caplog.at_level("INFO"):
        t = Trainer(cfg(max_steps=25, patience=50, valid_interval_steps=5), small_data, run)
    st = saved["train_state"]
    assert t.state.to_dict() == st
    assert st["step"] == 20 and st["best_valid_nll"] < float("inf")
    adam = t.optimizer.state_dict()["state"]
    assert all(float(v["step"]) == 20 for v in adam.values())
    assert_bitwise(t.optimizer.state_dict(), saved["optimizer"])
    assert t.lr(21) == train_mod.learning_rate(21, 32, 10)
    msg = caplog.text
    assert "step 20, epoch" in msg and f"best valid nll {st['best_valid_nll']:.4f}" in msg
    assert (
        f"lr {t.lr(21):.3g}" in msg
        and f"{st['valid_without_improvement']} validations without improvement" in msg
    )
    t.run()
    assert {p.name: sha256_file(p) for p in list_checkpoints(run) if p.name in digests} == digests
    assert (run / "checkpoint_25.pt").exists()


@pytest.mark.rows("A4")
def test_patience_stops_after_validations_without_improvement(
    small_data: Path, tmp_path: Path
) -> None:
    """A4's patience counter does its job: with an LR far too small to learn, the
    validation NLL stops improving and the run ends, saying why."""
    torch.set_num_threads(1)
    result = train(
        cfg(max_steps=200, valid_interval_steps=2, patience=2, lr_scale=1e-12),
        small_data,
        tmp_path / "run",
    )
    assert result.stopped_by == "patience"
    assert result.state.valid_without_improvement == 2 and result.state.step < 200


@pytest.mark.rows("A5")
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_finishes_the_step_saves_and_exits(
    small_data: Path,
    tmp_path: Path,
    sig: signal.Signals,
    code: int,
    record_property: pytest.RecordProperty,
) -> None:
    """A5: SIGTERM / SIGINT: the step finishes, a checkpoint is written, the process exits
    with 128 + signal number within 60 s, and the resume redoes no step."""
    run = tmp_path / "run"
    sets = [
        a
        for k, v in {
            **SMALL,
            "max_steps": 1_000_000,
            "save_interval_steps": 0,
            "save_interval_minutes": 0,
        }.items()
        for a in ("--set", f"{k}={v}")
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiayn",
            "train",
            str(small_data),
            "--out",
            str(run),
            "--preset",
            "tiny",
            "--no-progress",
            *sets,
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log_file = run / "train_log.jsonl"
    deadline = time.monotonic() + 120
    while not (log_file.exists() and len(log_file.read_text().splitlines()) >= 15):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(sig)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == code, err[-2000:]
    assert f"stopped ({sig.name})" in out
    last = max(s for s, _ in step_losses(run))
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == last  # 0 steps lost
    record_property("faults", {sig.name: 1})
    record_property("steps_lost", [0])


@pytest.mark.rows("A1", "A5")
def test_sigterm_between_saves_then_rerun_is_bitwise_equal(
    small_data: Path, baseline: Path, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """A5 held to A1's bar: a SIGTERM between two save intervals, in the middle of an epoch,
    saves that very step, and the same command then continues bitwise as if never stopped,
    redoing no step (the checkpoint carries the position inside the epoch)."""
    run = tmp_path / "run"
    at = 13  # not a multiple of the save interval; ~8 batches an epoch, so mid-epoch
    assert at % K
    stopped = cli_train(small_data, run, faults=f"term_at_step={at}", check=False)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    assert "stopped (SIGTERM)" in stopped.stdout
    saved = load_checkpoint(run / "checkpoint_last.pt")
    assert saved["step"] == at and saved["train_state"]["batch_in_epoch"] > 0
    resumed = cli_train(small_data, run)  # the same command again
    assert f"resumed from {run / f'checkpoint_{at}.pt'}: step {at}," in resumed.stderr
    seen = step_losses(run)
    assert [s for s, _ in seen] == list(range(1, SMALL["max_steps"] + 1))  # none redone
    base = dict(step_losses(baseline))
    for step, loss in seen:
        assert loss == base[step], step
    assert_bitwise(final_state(baseline), final_state(run), f"SIGTERM at {at}")
    record_property("faults", {"SIGTERM": 1})
    record_property("steps_lost", [0])


@pytest.mark.rows("A6")
def test_resume_past_max_steps_does_nothing(
    small_data: Path, baseline: Path, tmp_path: Path
) -> None:
    """A6: resuming a finished run says "already at step X >= max_steps Y", exits 0 and
    writes nothing."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(baseline, run)

    def files() -> dict[str, tuple[int, int]]:  # the lock file records its holder's pid
        return {
            p.name: (p.stat().st_mtime_ns, p.stat().st_size)
            for p in run.iterdir()
            if p.name != "trainer.lock"
        }

    before = files()
    proc = cli_train(small_data, run, max_steps=30)
    assert "already at step 40 >= max_steps 30" in proc.stdout
    assert files() == before


@pytest.mark.rows("A7")
@pytest.mark.parametrize(
    ("change", "needs", "listed"),
    [
        ({"lr_scale": 2.0}, "--reset-optimizer", "train.lr_scale: 1.0 -> 2.0"),
        ({"warmup_steps": 20}, "--reset-optimizer", "train.warmup_steps: 10 -> 20"),
        ({"train.max_tokens": 300}, "--reset-dataloader", "train.max_tokens: 400 -> 300"),
        ({"d_ff": 128}, None, "model.d_ff: 64 -> 128"),
    ],
)
def test_resume_with_changed_settings_is_refused(
    small_data: Path,
    baseline: Path,
    tmp_path: Path,
    change: dict[str, Any],
    needs: str | None,
    listed: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A7: a changed optimizer, schedule or batch size is refused listing the differing key,
    and the reset flag lets it through; a model change is refused (exit 2) before the
    trainer starts, naming both values, reset flags or not."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    argv = [
        "train",
        str(small_data),
        "--out",
        str(run),
        "--preset",
        "tiny",
        "--no-progress",
        *[
            a
            for k, v in {**SMALL, **change, "max_steps": 41}.items()
            for a in ("--set", f"{k}={v}")
        ],
    ]
    if needs is None:  # the model: refused before the trainer starts (issue 71), exit 2
        for extra in ([], ["--reset-optimizer", "--reset-dataloader"]):
            assert main([*argv, *extra]) == 2
            err = capsys.readouterr().err
            key, old_new = listed.split(": ")
            old, new = old_new.split(" -> ")
            assert f"{key}={old}" in err and f"{key}={new}" in err and "Traceback" not in err
            assert "cannot change on resume" in err
        return
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and listed in err and "Traceback" not in err
    torch.set_num_threads(1)
    assert main([*argv, needs]) == 0
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 41


@pytest.mark.rows("A8")
def test_resume_after_the_corpus_changed_is_refused(
    small_data: Path, baseline: Path, tmp_path: Path
) -> None:
    """A8: the training data re-prepared (shortened) under the same vocabulary: resume
    stops before any step, naming the file and suggesting --reset-dataloader."""
    from aiayn.data.tokenizer import Tokenizer

    raw = tmp_path / "raw"
    raw.mkdir()
    for lang in ("en", "de"):
        lines = list(read_lines(small_data.parent / f"train.{lang}"))[:150]
        (raw / f"train.{lang}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
    data = tmp_path / "data"
    prepare(
        "en",
        "de",
        raw / "train",
        None,
        None,
        data,
        tokenizer=Tokenizer.load(small_data / "spm.model"),
    )
    import shutil

    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    proc = cli_train(data, run, check=False, max_steps=45)
    assert proc.returncode == 1
    assert f"the training data {data / 'train.pt'} changed" in proc.stderr
    assert "--reset-dataloader" in proc.stderr and "Traceback" not in proc.stderr
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 40


def test_a_key_newer_than_the_checkpoint_counts_as_its_default() -> None:
    """A checkpoint written before a config key existed resumes when the key keeps its
    default (the behaviour it was trained with), and is refused when it does not."""
    from aiayn.config import Config
    from aiayn.training.resume import TrainingError, check_resume_compatible

    cfg = apply_overrides(get_preset("tiny"), SMALL)
    saved = {"config": cfg.to_dict()}
    for key in ("compile", "clip_norm"):
        del saved["config"]["train"][key]
    assert Config().train.clip_norm == 0.0 and not Config().train.compile
    check_resume_compatible(saved, cfg, reset_optimizer=False, reset_dataloader=False)
    # torch.compile changes how the forward runs, not the training: free to toggle
    check_resume_compatible(
        saved,
        apply_overrides(cfg, {"train.compile": True}),
        reset_optimizer=False,
        reset_dataloader=False,
    )
    with pytest.raises(TrainingError, match=r"train.clip_norm: 0.0 -> 1.0"):
        check_resume_compatible(
            saved,
            apply_overrides(cfg, {"clip_norm": 1.0}),
            reset_optimizer=False,
            reset_dataloader=False,
        )


def test_resume_with_a_changed_rdrop_alpha_is_refused() -> None:
    """R-Drop changes the objective: a run trained with it (or without) cannot resume
    with another alpha, whatever reset flag is given; a checkpoint older than the option
    was trained without it."""
    from aiayn.training.resume import TrainingError, check_resume_compatible

    cfg = apply_overrides(get_preset("tiny"), SMALL)
    old = {"config": cfg.to_dict()}
    del old["config"]["train"]["rdrop_alpha"]
    check_resume_compatible(old, cfg, reset_optimizer=False, reset_dataloader=False)
    rdrop = apply_overrides(cfg, {"train.rdrop_alpha": 5.0})
    for saved, new, listed in (
        (old, rdrop, "0.0 -> 5.0"),
        ({"config": rdrop.to_dict()}, cfg, "5.0 -> 0.0"),
    ):
        with pytest.raises(TrainingError, match=rf"train.rdrop_alpha: {listed}"):
            check_resume_compatible(saved, new, reset_optimizer=True, reset_dataloader=True)
