"""The training loop: each logged loss is the token-weighted mean of its interval, and a run
that max_minutes will end before max_steps says so early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aiayn.training.guards as guards_module
from aiayn import speed
from aiayn.config import apply_overrides, get_preset
from aiayn.training.trainer import Hooks, train
from helpers import SMALL_TRAINING, tiny_config


def test_logged_loss_is_the_interval_mean(small_data: Path, tmp_path: Path):
    cfg = apply_overrides(
        get_preset("tiny"),
        {
            "N": 1,
            "d_model": 32,
            "d_ff": 64,
            "h": 2,
            "d_k": 16,
            "d_v": 16,
            "train.max_tokens": 300,
            "max_steps": 6,
            "log_interval_steps": 3,
            "save_interval_steps": 6,
        },
    )
    result = train(cfg, small_data, tmp_path / "run")
    logged = [
        json.loads(x)
        for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    assert [r["step"] for r in logged] == [3, 6]
    for record, steps in zip(logged, (result.history[:3], result.history[3:]), strict=True):
        tokens = sum(h["tgt_tokens"] for h in steps)
        mean = sum(h["loss"] * h["tgt_tokens"] for h in steps) / tokens
        assert record["loss"] == pytest.approx(mean, rel=1e-12)
        assert record["tgt_tokens"] == steps[-1]["tgt_tokens"]  # the rest is the step's own


@pytest.mark.slow  # compiling takes a minute or more on this CPU
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # bf16: the fused FFN op must stay out
def test_compiled_training_matches_the_plain_loop(small_data: Path, tmp_path: Path, dtype: str):
    """train.compile changes how the forward runs, not what it computes, nor the checkpoint."""
    import torch
    from torch._dynamo.utils import counters

    base = {
        "N": 1,
        "d_model": 32,
        "d_ff": 64,
        "h": 2,
        "d_k": 16,
        "d_v": 16,
        "P_drop": 0.0,
        "train.max_tokens": 300,
        "max_steps": 6,
        "save_interval_steps": 6,
        "train.dtype": dtype,
    }
    # bf16: inductor rounds its fused kernels' intermediates differently
    rel, rtol, atol = (1e-4, 1e-3, 1e-5) if dtype == "fp32" else (1e-2, 1e-2, 1e-3)
    runs = {}
    for compiled in (False, True):
        cfg = apply_overrides(get_preset("tiny"), {**base, "train.compile": compiled})
        counters.clear()
        runs[compiled] = (
            train(cfg, small_data, tmp_path / str(compiled)),
            torch.load(tmp_path / str(compiled) / "checkpoint_6.pt", weights_only=False)["model"],
        )
        assert (counters["stats"]["unique_graphs"] > 0) == compiled  # it did compile
    (plain, plain_w), (comp, comp_w) = runs[False], runs[True]
    assert plain_w.keys() == comp_w.keys()  # no "_orig_mod." prefix: translate loads it
    assert [h["loss"] for h in comp.history] == pytest.approx(
        [h["loss"] for h in plain.history], rel=rel
    )
    assert all(torch.allclose(plain_w[k], comp_w[k], rtol=rtol, atol=atol) for k in plain_w)


def test_training_on_the_real_tokens_matches_the_padded_loop(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """train.pack_padding (the default) leaves padding out of the position-wise layers:
    the same losses and weights as the whole padded batches (False, the recipes' setting),
    up to rounding; and only the default packs."""
    import torch

    from aiayn.fast.packing import Packing

    packed = []
    real_init = Packing.__init__

    def counting_init(self: Packing, tokens: torch.Tensor) -> None:
        real_init(self, tokens)
        packed.append(self.padded)

    monkeypatch.setattr(Packing, "__init__", counting_init)
    base = {
        "N": 1,
        "d_model": 32,
        "d_ff": 64,
        "h": 2,
        "d_k": 16,
        "d_v": 16,
        "P_drop": 0.0,
        "train.max_tokens": 300,
        "max_steps": 6,
        "save_interval_steps": 6,
    }
    runs = {}
    for pack in (False, True):
        packed.clear()
        cfg = apply_overrides(get_preset("tiny"), {**base, "train.pack_padding": pack})
        runs[pack] = (
            train(cfg, small_data, tmp_path / str(pack)),
            torch.load(tmp_path / str(pack) / "checkpoint_6.pt", weights_only=False)["model"],
        )
        assert any(packed) == pack  # some batch was packed, or none was
    (padded, padded_w), (real, real_w) = runs[False], runs[True]
    assert [h["loss"] for h in real.history] == pytest.approx(
        [h["loss"] for h in padded.history], rel=1e-5
    )
    assert all(torch.allclose(padded_w[k], real_w[k], rtol=1e-4, atol=1e-6) for k in padded_w)


def test_cpu_kernels_setting_picks_the_mask_generator_and_the_loss(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """train.cpu_kernels (the default) draws every CPU dropout mask with the compiled
    generator and computes the loss's rows in C; false (the recipes' setting) uses
    PyTorch's generator and ops, as before it existed."""
    from aiayn.fast import cpu_ops, native

    if native.library() is None:
        pytest.skip("no compiled library")
    calls = {"compiled": 0, "torch": 0, "loss": 0}
    real_multiplier, real_mask = native.dropout_multiplier, cpu_ops.cpu_keep_mask
    real_ce = native.smoothed_ce

    def ce(*a, **kw):  # type: ignore[no-untyped-def]
        calls["loss"] += 1
        return real_ce(*a, **kw)

    def multiplier(*a, **kw):  # type: ignore[no-untyped-def]
        calls["compiled"] += 1
        return real_multiplier(*a, **kw)

    def mask(*a, **kw):  # type: ignore[no-untyped-def]
        calls["torch"] += 1
        return real_mask(*a, **kw)

    monkeypatch.setattr(native, "dropout_multiplier", multiplier)
    monkeypatch.setattr(cpu_ops, "cpu_keep_mask", mask)
    monkeypatch.setattr(native, "smoothed_ce", ce)
    base = {
        "N": 1,
        "d_model": 32,
        "d_ff": 64,
        "h": 2,
        "d_k": 16,
        "d_v": 16,
        "P_drop": 0.3,
        "train.max_tokens": 300,
        "max_steps": 2,
        "save_interval_steps": 2,
    }
    for compiled in (True, False):
        calls.update(compiled=0, torch=0, loss=0)
        cfg = apply_overrides(get_preset("tiny"), {**base, "train.cpu_kernels": compiled})
        train(cfg, small_data, tmp_path / str(compiled))
        drawn = "compiled" if compiled else "torch"
        assert calls[drawn] > 0 and calls["compiled" if not compiled else "torch"] == 0
        assert (calls["loss"] > 0) == compiled


@pytest.mark.parametrize("max_steps", [12, 1_000_000])
def test_warns_early_when_max_minutes_will_end_the_run(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    max_steps: int,
):
    # The pace of steps 2..6 projects the run: 12 steps fit a minute, a million do not.
    monkeypatch.setattr(guards_module, "PACE_FROM_STEP", 2)
    monkeypatch.setattr(guards_module, "PACE_AT_STEP", 6)
    budget_min = 1.0 if max_steps == 12 else 0.03
    cfg = apply_overrides(
        get_preset("tiny"),
        {
            "N": 1,
            "d_model": 32,
            "d_ff": 64,
            "h": 2,
            "d_k": 16,
            "d_v": 16,
            "train.max_tokens": 300,
            "max_steps": max_steps,
            "max_minutes": budget_min,
            "save_interval_steps": 0,
            "valid_interval_steps": 1_000_000,
        },
    )
    with caplog.at_level("WARNING", logger="aiayn.training.trainer"):
        result = train(cfg, small_data, tmp_path / "run")
    events = [
        json.loads(x)
        for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()
        if "budget_ends_first" in x
    ]
    if max_steps == 12:
        assert result.stopped_by == "max_steps" and not events
        assert "max_minutes" not in caplog.text
    else:
        assert result.stopped_by == "max_minutes"
        assert [e["step"] for e in events] == [6] and "will stop this run near step" in caplog.text
        per_step = events[0]["seconds_per_step"]
        assert per_step > 0
        assert events[0]["projected_minutes"] > budget_min
        # the projection is the measured pace: it names a last step near where it stopped
        assert result.state.step / 3 <= events[0]["projected_last_step"] <= 3 * result.state.step


@pytest.mark.parametrize("slow", [True, False])
def test_bf16_training_warns_where_bf16_is_slower_than_fp32(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    slow: bool,
):
    # The check itself is tested on real (restricted) kernels in test_bench.py; here, that
    # the trainer asks it for bf16 runs only, and says what it found in the log and the file.
    asked: list[str] = []

    def check(device: object) -> str | None:
        asked.append(str(device))
        return "bf16 matrix products run at 1 GFLOP/s" if slow else None

    monkeypatch.setitem(speed.IMPLEMENTATIONS, "slow_bf16_warning", check)  # asked through the seam
    for dtype in ("fp32", "bf16"):
        cfg = apply_overrides(
            get_preset("tiny"),
            {
                "N": 1,
                "d_model": 32,
                "d_ff": 64,
                "h": 2,
                "d_k": 16,
                "d_v": 16,
                "dtype": dtype,
                "train.max_tokens": 300,
                "max_steps": 2,
                "save_interval_steps": 0,
            },
        )
        with caplog.at_level("WARNING", logger="aiayn.training.trainer"):
            train(cfg, small_data, tmp_path / dtype)
        events = [
            json.loads(x)
            for x in (tmp_path / dtype / "train_log.jsonl").read_text().splitlines()
            if "slow_bf16" in x
        ]
        if dtype == "bf16" and slow:
            assert [e["step"] for e in events] == [0]
            assert "1 GFLOP/s" in events[0]["message"]
        else:
            assert not events
    assert asked == ["cpu"]  # once, for the bf16 run
    assert ("1 GFLOP/s" in caplog.text) == slow


def test_a_run_too_slow_to_reach_the_pace_step_is_projected_by_time(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    # As for bf16 on a CPU that emulates it (~6 s a step): step PACE_AT_STEP would come with
    # the end of the budget, so the projection comes once 10% of max_minutes is spent.
    monkeypatch.setattr(guards_module, "PACE_FROM_STEP", 10**6)
    monkeypatch.setattr(guards_module, "PACE_AT_STEP", 2 * 10**6)
    monkeypatch.setattr(guards_module, "PACE_EARLY_STEP", 2)
    budget_min = 0.03
    cfg = apply_overrides(
        get_preset("tiny"),
        {
            "N": 1,
            "d_model": 32,
            "d_ff": 64,
            "h": 2,
            "d_k": 16,
            "d_v": 16,
            "train.max_tokens": 300,
            "max_steps": 10**6,
            "max_minutes": budget_min,
            "save_interval_steps": 0,
            "valid_interval_steps": 1_000_000,
        },
    )
    with caplog.at_level("WARNING", logger="aiayn.training.trainer"):
        result = train(cfg, small_data, tmp_path / "run")
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    events = [e for e in log if e.get("event") == "budget_ends_first"]
    assert result.stopped_by == "max_minutes" and len(events) == 1
    assert 4 <= events[0]["step"] < result.state.step
    assert "will stop this run near step" in caplog.text
    # it came early in the budget, not at its end, and projects about where the run stopped
    assert events[0]["step"] <= result.state.step / 2
    assert result.state.step / 3 <= events[0]["projected_last_step"] <= 3 * result.state.step


def test_pace_is_checked_once_from_the_right_marks(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(guards_module, "PACE_EARLY_STEP", 10)
    monkeypatch.setattr(guards_module, "PACE_FROM_STEP", 200)
    monkeypatch.setattr(guards_module, "PACE_AT_STEP", 600)
    # a fast run: checked at step 600, from step 200's mark, never again
    pace = guards_module.Pace(budget_s=3600.0, start_s=0.0)
    seen = {d: pace.seconds_per_step(d, 0.25 * d) for d in range(1, 1000)}
    assert {d: v for d, v in seen.items() if v is not None} == {600: pytest.approx(0.25)}
    # a slow run: checked once 10% of the budget (360 s) is spent, from step 10's mark
    pace = guards_module.Pace(budget_s=3600.0, start_s=100.0)
    seen = {d: pace.seconds_per_step(d, 100.0 + 6.0 * d) for d in range(1, 600)}
    assert {d: v for d, v in seen.items() if v is not None} == {60: pytest.approx(6.0)}


def test_rdrop_training_without_dropout_is_the_plain_objective(small_data: Path, tmp_path: Path):
    """train.rdrop_alpha doubles each batch; with P_drop 0 the two passes agree, so the
    run must follow the plain run's losses and weights; with dropout it must not."""
    import torch

    base = {
        "N": 1,
        "d_model": 32,
        "d_ff": 64,
        "h": 2,
        "d_k": 16,
        "d_v": 16,
        "train.max_tokens": 300,
        "max_steps": 4,
        "save_interval_steps": 4,
    }
    runs = {}
    for name, extra in {
        "plain": {"P_drop": 0.0},
        "rdrop": {"P_drop": 0.0, "train.rdrop_alpha": 5.0},
        "rdrop_dropout": {"P_drop": 0.3, "train.rdrop_alpha": 5.0},
        "plain_dropout": {"P_drop": 0.3},
    }.items():
        cfg = apply_overrides(get_preset("tiny"), {**base, **extra})
        result = train(cfg, small_data, tmp_path / name)
        weights = torch.load(tmp_path / name / "checkpoint_4.pt", weights_only=True)["model"]
        runs[name] = (
            [h["loss"] for h in result.history],
            weights,
            [h["tgt_tokens"] for h in result.history],
        )
    plain, rdrop = runs["plain"], runs["rdrop"]
    assert rdrop[2] == plain[2]  # tokens are counted once, not twice
    assert rdrop[0] == pytest.approx(plain[0], rel=1e-5)
    assert all(torch.allclose(plain[1][k], rdrop[1][k], rtol=1e-4, atol=1e-6) for k in plain[1])
    # with dropout the passes differ: the KL term and the second masks change the loss
    assert runs["rdrop_dropout"][0][0] != pytest.approx(runs["plain_dropout"][0][0], rel=1e-3)


def test_prefetched_batches_train_the_same_run_and_resume_alike(small_data: Path, tmp_path: Path):
    """Batches built ahead on a thread (`Trainer.prefetch`, on by default on GPUs) are the
    same batches in the same order: the same losses and bit-identical weights with
    dropout on (its masks come from the main thread's generator), across epoch ends and
    a stop-and-resume; and the thread is gone when the run ends."""
    import threading

    import torch

    from aiayn.training.trainer import Trainer

    cfg = apply_overrides(
        get_preset("tiny"),
        {
            "N": 1,
            "d_model": 32,
            "d_ff": 64,
            "h": 2,
            "d_k": 16,
            "d_v": 16,
            "P_drop": 0.3,
            "train.max_tokens": 600,
            "max_steps": 30,
            "save_interval_steps": 10,
            "log_interval_steps": 1,
        },
    )

    def run(out: Path, prefetch: bool, max_steps: int) -> list[float]:
        seen: list[list[int]] = []
        trainer = Trainer(
            apply_overrides(cfg, {"max_steps": max_steps}),
            small_data,
            out,
            hooks=Hooks(on_batch=lambda step, e, p, ids: seen.append(ids.tolist())),
        )
        trainer.prefetch = prefetch
        try:
            result = trainer.run()
        finally:
            trainer.close()
        assert not any(t.name == "aiayn-prefetch" for t in threading.enumerate())
        return [h["loss"] for h in result.history], seen

    plain, plain_ids = run(tmp_path / "plain", False, 30)
    ahead, ahead_ids = run(tmp_path / "ahead", True, 30)
    first, first_ids = run(tmp_path / "resumed", True, 12)
    rest, rest_ids = run(tmp_path / "resumed", True, 30)
    records = [
        json.loads(line)
        for line in (tmp_path / "plain" / "train_log.jsonl").read_text().splitlines()
    ]
    assert max(r.get("epoch", 0) for r in records) >= 1  # the runs crossed an epoch's end
    assert ahead_ids == plain_ids == first_ids + rest_ids
    assert ahead == plain == first + rest
    weights = [
        torch.load(tmp_path / d / "checkpoint_30.pt", weights_only=False)["model"]
        for d in ("plain", "ahead", "resumed")
    ]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])


def test_a_run_resumed_after_its_budget_trains_no_further(small_data: Path, tmp_path: Path):
    """A finished run stopped by max_minutes, started again (a recipe rerun to rescore it):
    no step is taken and no checkpoint written; with more minutes it trains on."""
    cfg = tiny_config(
        SMALL_TRAINING,
        max_steps=1_000_000,
        max_minutes=0.002,
        save_interval_steps=0,
        valid_interval_steps=1_000_000,
    )
    run = tmp_path / "run"
    first = train(cfg, small_data, run)
    assert first.stopped_by == "max_minutes"
    files = sorted((p.name, p.stat().st_mtime_ns) for p in run.glob("checkpoint_*.pt"))
    again = train(cfg, small_data, run)
    assert again.stopped_by == "max_minutes" and again.state.step == first.state.step
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.glob("checkpoint_*.pt")) == files
    more = train(apply_overrides(cfg, {"max_minutes": 0.004}), small_data, run)
    assert more.state.step > first.state.step


def test_a_run_resumed_after_its_patience_ran_out_trains_no_further(
    small_data: Path, tmp_path: Path
):
    """The same for patience: a run whose last checkpoint counts `patience` validations
    without improvement takes no step when started again; with more patience it goes on."""
    from aiayn.checkpoints.io import load_checkpoint, save_checkpoint_file

    cfg = tiny_config(SMALL_TRAINING, max_steps=3, save_interval_steps=3, valid_interval_steps=3)
    run = tmp_path / "run"
    train(cfg, small_data, run)
    last = run / "checkpoint_3.pt"
    ckpt = load_checkpoint(last)
    ckpt["train_state"]["valid_without_improvement"] = 2  # as a run patience stopped
    save_checkpoint_file(last, ckpt)
    (run / "checkpoint_last.pt").unlink()  # the link to the old file
    again = train(apply_overrides(cfg, {"max_steps": 6, "patience": 2}), small_data, run)
    assert again.stopped_by == "patience" and again.state.step == 3
    assert not (run / "checkpoint_6.pt").exists()
    more = train(apply_overrides(cfg, {"max_steps": 6, "patience": 5}), small_data, run)
    assert more.state.step == 6
