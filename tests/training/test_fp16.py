"""fp16 mixed precision with dynamic loss scaling (`aiayn.training.precision`), on the CPU
with the tests' one-layer d_model-32 model (PyTorch's CPU autocast and GradScaler("cpu")
run float16 the way CUDA does, through slower kernels).

Overflows are forced by a hook that makes one weight's gradient inf while the loss stays
finite: what a loss scale too large does. The scaler's scale is checked against
PyTorch's documented rules, written out here (`expected_scales`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.checkpoints import average_checkpoints, load_checkpoint, load_model, save_checkpoint
from aiayn.config import ConfigError
from aiayn.training import precision
from aiayn.training import trainer as train_mod
from aiayn.training.guards import MAX_CONSECUTIVE_NONFINITE
from aiayn.training.persistence import SCALER_KEY, Checkpoints
from aiayn.training.state import StepHook, TrainingError
from aiayn.training.trainer import Trainer
from helpers import SMALL_TRAINING, step_losses, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

INIT_SCALE = 2.0**16  # PyTorch's GradScaler defaults
GROWTH_INTERVAL = 4  # the tests' (PyTorch's is 2000): growth within a short run


def cfg(**over: Any) -> Any:
    return tiny_config(SMALL_TRAINING, **{"dtype": "fp16", "max_steps": 20, **over})


class Overflow(StepHook):
    """Makes the gradient of one weight inf on the first `times` attempts of each step in
    `steps` (the loss stays finite), and keeps the weights as each attempt starts."""

    def __init__(self, steps: set[int] | frozenset[int] = frozenset(), times: int = 1) -> None:
        self.steps, self.times = set(steps), times
        self.fired: dict[int, int] = {}
        self.inject = False
        #: (step, injected, the model's weights as the attempt began), per attempt
        self.attempts: list[tuple[int, bool, dict[str, torch.Tensor]]] = []

    def install(self, model: Any) -> None:
        self.model = model
        weight = model.encoder[0].ffn.w_1.weight
        weight.register_hook(lambda g: torch.full_like(g, math.inf) if self.inject else g)

    def begin_attempt(self, step: int) -> None:
        n = self.fired.get(step, 0)
        self.inject = step in self.steps and n < self.times
        if self.inject:
            self.fired[step] = n + 1
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.attempts.append((step, self.inject, weights))


def expected_scales(
    overflows: list[bool], init: float = INIT_SCALE, interval: int = GROWTH_INTERVAL
) -> tuple[list[float], float, int]:
    """PyTorch's dynamic loss scaling (torch.amp.GradScaler.update), written out: each
    attempt's scale, and the scale and growth tracker after the last. An overflow halves
    the scale and resets the tracker; `interval` clean steps in a row double it."""
    scale, tracker, used = init, 0, []
    for overflow in overflows:
        used.append(scale)
        if overflow:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * 2.0, 0
    return used, scale, tracker


@pytest.fixture
def fast_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's scaler with growth every GROWTH_INTERVAL clean steps (else PyTorch's
    defaults); a resumed one takes the interval from the checkpoint anyway."""

    def make(dtype: str, device: torch.device) -> torch.amp.GradScaler:
        fp16 = precision.resolve_dtype(dtype, device) == "fp16"
        return torch.amp.GradScaler(device.type, growth_interval=GROWTH_INTERVAL, enabled=fp16)

    monkeypatch.setattr(train_mod, "make_scaler", make)


def run(config: Any, data: Path, run_dir: Path, hook: StepHook | None = None) -> Trainer:
    """Train (or resume) in this process with `hook` as the step hook; the finished trainer."""
    t = Trainer(config, data, run_dir)
    if hook is not None:
        t.step_hook = hook
        hook.install(t.model)
    t.run()
    return t


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


def test_scale_backs_off_and_grows_as_pytorch_says_and_overflow_skips_adam(
    small_data: Path, tmp_path: Path, fast_growth: None
) -> None:
    """(1) Forced overflows at steps 6 and 11: the scale of every attempt and the final
    scale and tracker follow PyTorch's rules; an overflowed attempt leaves every weight
    bitwise as it was and Adam's step count unmoved; each is logged with its scales."""
    hook = Overflow({6, 11})
    t = run(cfg(max_steps=12), small_data, tmp_path / "run", hook)
    overflows = [injected for _, injected, _ in hook.attempts]
    assert overflows.count(True) == 2 and len(overflows) == 14
    used, scale, tracker = expected_scales(overflows)
    assert t.scaler.get_scale() == scale and t.scaler.state_dict()["_growth_tracker"] == tracker
    # the scale each clean step ran with, as train_log.jsonl has it
    history = [h["loss_scale"] for h in _step_records(tmp_path / "run")]
    assert history == [s for s, o in zip(used, overflows, strict=True) if not o]
    assert max(history) > INIT_SCALE  # it grew too
    # each overflow: logged, weights untouched, not counted as a step
    got = events(tmp_path / "run", "overflow_skipped")
    assert [(e["step"], e["count"]) for e in got] == [(6, 1), (11, 2)]
    at = [i for i, o in enumerate(overflows) if o]
    for e, i in zip(got, at, strict=True):
        assert (e["loss_scale"], e["new_loss_scale"]) == (used[i], used[i] / 2)
        before, after = hook.attempts[i][2], hook.attempts[i + 1][2]
        assert all(torch.equal(before[k], after[k]) for k in before)
        clean_after = hook.attempts[i + 2][2]  # the step redone cleanly did move them
        assert any(not torch.equal(after[k], clean_after[k]) for k in after)
    adam = t.optimizer.state_dict()["state"]
    assert all(float(v["step"]) == 12 for v in adam.values())
    assert t.state.step == 12 and t.state.overflow_skipped == 2
    assert t.state.nonfinite_skipped == 0


def _step_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "event" not in r]


class Perturb(StepHook):
    """Multiplies every initial weight by (1 + u r), r = +-1 at random (seeded): one
    rounding error of relative size u in each weight, before training."""

    def __init__(self, u: float, seed: int) -> None:
        self.u, self.seed = u, seed

    def install(self, model: Any) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for p in model.parameters():
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
                p.mul_(1 + self.u * sign)


#: float16's unit roundoff (10 stored mantissa bits).
U16 = 2.0**-11


def test_fp16_lowers_the_loss_like_fp32(small_data: Path, tmp_path: Path) -> None:
    """(2) 40 steps from the same initial weights and batches, dropout off: fp16's
    training loss falls as fp32's does, both at least 0.8 below step 1's, and its mean
    over steps 31-40 stays within what rounding errors of fp16's size do to fp32 training.

    That bound is measured here, not assumed: training is chaotic, so single roundings
    grow into trajectories that differ by tenths of a nat per step within 40 steps, and
    by how much depends on the CPU's kernels (a fixed 0.01 held on an AVX-512 EPYC, 0.0014
    and 0.0007 for two seeds, and not on an AVX2 one, 0.068). Four fp32 runs whose initial
    weights each carry one fp16-sized rounding (relative 2^-11) give the spread of late
    means that rounding alone causes; fp16, which rounds at that size all along, must stay
    within three times the widest of them (a run that did not train, or lost its
    gradients to underflow, misses by nats). Dropout is off because on the CPU fp16 draws
    other masks than fp32 (the compiled mask generator takes fp32 and bf16 only)."""
    losses = {}
    for name, dtype, hook in [
        ("fp32", "fp32", None),
        ("fp16", "fp16", None),
        *((f"fp32-perturbed-{i}", "fp32", Perturb(U16, seed=i)) for i in range(4)),
    ]:
        run(cfg(dtype=dtype, max_steps=40, P_drop=0.0), small_data, tmp_path / name, hook)
        losses[name] = dict(step_losses(tmp_path / name))
    late = {d: sum(v[s] for s in range(31, 41)) / 10 for d, v in losses.items()}
    assert abs(losses["fp16"][1] - losses["fp32"][1]) < 1e-3  # the same start
    for d in ("fp32", "fp16"):
        assert late[d] < losses[d][1] - 0.8, (d, losses[d][1], late[d])
    spread = max(abs(late[d] - late["fp32"]) for d in late if d.startswith("fp32-perturbed"))
    assert spread > 0  # the perturbations did change the runs
    assert abs(late["fp16"] - late["fp32"]) <= 3 * spread, (late, spread)
    assert losses["fp16"] != losses["fp32"]  # it did compute in fp16


def _bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            if k != "train_seconds":
                _bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):  # a counter not set yet
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _final(run_dir: Path) -> dict[str, Any]:
    ck = load_checkpoint(run_dir / "checkpoint_last.pt")
    return {k: ck[k] for k in ("model", "optimizer", "train_state", "step", SCALER_KEY)}


def test_resume_just_after_an_overflow_is_bitwise_the_uninterrupted_run(
    small_data: Path, tmp_path: Path, fast_growth: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(3) Overflows at steps 10 (just before the step-10 checkpoint) and 13. Stopped at
    step 10 and resumed, the run repeats the uninterrupted one bit for bit: every step's
    loss, weights, Adam, counters and the scaler's scale and growth tracker. Negative
    control: resumed with a fresh scaler, the scaler state differs."""
    run(cfg(), small_data, tmp_path / "full", Overflow({10, 13}))
    saved = load_checkpoint(tmp_path / "full/checkpoint_10.pt")[SCALER_KEY]
    _, scale, tracker = expected_scales([False] * 9 + [True] + [False])
    assert (saved["scale"], saved["_growth_tracker"]) == (scale, tracker) == (2**17, 1)

    def stopped_and_resumed(name: str) -> Path:
        run(cfg(max_steps=10), small_data, tmp_path / name, Overflow({10, 13}))
        run(cfg(), small_data, tmp_path / name, Overflow({10, 13}))
        return tmp_path / name

    resumed = stopped_and_resumed("resumed")
    assert dict(step_losses(resumed)) == dict(step_losses(tmp_path / "full"))
    _bitwise(_final(tmp_path / "full"), _final(resumed))
    assert len(events(resumed, "overflow_skipped")) == 2
    # without the scaler's state the resumed run's scaler is another one
    monkeypatch.setattr(Checkpoints, "load_scaler", lambda self, saved, path: None)
    forgetful = stopped_and_resumed("forgetful")
    assert _final(forgetful)[SCALER_KEY] != _final(tmp_path / "full")[SCALER_KEY]


def test_an_old_checkpoint_without_scaler_state_resumes_with_a_fresh_one(
    small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(4) A checkpoint without the scaler's state (written before fp16 existed) resumes
    with a fresh scaler and says so; averaging and decoding read fp16 checkpoints and
    ignore the scaler's state."""
    full = tmp_path / "full"
    run(cfg(max_steps=10), small_data, full)
    old = load_checkpoint(full / "checkpoint_10.pt")
    assert old.pop(SCALER_KEY)["_growth_tracker"] == 10
    (tmp_path / "old").mkdir()
    save_checkpoint(tmp_path / "old", old, keep_last=5)
    with caplog.at_level(logging.INFO):
        t = run(cfg(max_steps=12), small_data, tmp_path / "old")
    assert "holds no loss-scaler state" in caplog.text and "fresh scaler" in caplog.text
    assert t.state.step == 12
    assert t.scaler.get_scale() == INIT_SCALE and t.scaler.state_dict()["_growth_tracker"] == 2
    (fresh,) = events(tmp_path / "old", "fresh_loss_scaler")
    assert fresh["step"] == 10 and fresh["loss_scale"] == INIT_SCALE
    # averaging and decoding: the scaler's state is not theirs to read
    avg = average_checkpoints([full / "checkpoint_5.pt", full / "checkpoint_10.pt"])
    assert SCALER_KEY not in avg and avg["step"] == 10
    model, _, config = load_model(full / "checkpoint_10.pt")
    assert config.train.dtype == "fp16" and next(model.parameters()).dtype == torch.float32


def test_overflows_are_not_divergence_but_a_scale_run_down_stops(
    small_data: Path, tmp_path: Path
) -> None:
    """(5) More overflows in a row than the non-finite guard tolerates (C2:
    MAX_CONSECUTIVE_NONFINITE) with the divergence rollback on: no crash, no rollback,
    no non-finite count. 30 in a row (2^16 x 2^-30 < precision.MIN_LOSS_SCALE = 1e-4
    after the 30th, not after the 29th) stop the run with a clear error."""
    n = MAX_CONSECUTIVE_NONFINITE + 1
    config = cfg(max_steps=12, divergence="rollback", divergence_window=4, divergence_short=2)
    t = run(config, small_data, tmp_path / "some", Overflow({5}, times=n))
    assert (t.state.step, t.state.overflow_skipped) == (12, n)
    assert t.state.rollbacks == 0 and t.state.nonfinite_skipped == 0
    assert t.scaler.get_scale() == INIT_SCALE / 2**n
    assert not events(tmp_path / "some", "rollback") and not events(tmp_path / "some", "crash")
    assert INIT_SCALE / 2**29 >= precision.MIN_LOSS_SCALE > INIT_SCALE / 2**30
    with pytest.raises(TrainingError, match=r"fp16 loss scale fell to 6\.10352e-05 .* at step 5"):
        run(config, small_data, tmp_path / "many", Overflow({5}, times=1000))
    assert events(tmp_path / "many", "overflow_skipped")[-1]["count"] == 30


def test_a_nonfinite_loss_in_fp16_is_the_guards_not_the_scalers(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN loss (the forward pass, not the gradient's scale) is a non-finite update as
    in fp32 (C1): counted and logged as such; the scale, which cannot help, is left as is."""
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_step=3")
    t = run(cfg(max_steps=5), small_data, tmp_path / "run")
    assert (t.state.nonfinite_skipped, t.state.overflow_skipped) == (1, 0)
    assert t.scaler.get_scale() == INIT_SCALE
    assert t.scaler.state_dict()["_growth_tracker"] == 5
    assert [e["step"] for e in events(tmp_path / "run", "nonfinite_skipped")] == [3]


def test_auto_resolves_per_device_and_config_accepts_fp16(tmp_path: Path) -> None:
    """ "auto": this machine's choice on the CPU (`machine.best`, checked for every CPU
    class in tests/fast/test_machine.py; CUDA's is the CUDA test's); fp16 and auto are
    valid config values, anything else is refused."""
    from aiayn.fast import machine

    cpu = torch.device("cpu")
    assert precision.resolve_dtype("auto", cpu) == machine.best().train_dtype
    assert [precision.resolve_dtype(d, cpu) for d in ("fp32", "bf16", "fp16")] == [
        "fp32",
        "bf16",
        "fp16",
    ]
    assert not precision.make_scaler("auto", cpu).is_enabled()  # never fp16 on a CPU
    assert precision.make_scaler("fp16", cpu).is_enabled()
    for dtype in ("fp16", "auto"):
        cfg(dtype=dtype).validate()
    with pytest.raises(ConfigError, match="'fp16' or 'auto'"):
        cfg(dtype="float16").validate()
