"""RELIABILITY group C: numerical faults and out-of-memory, injected through AIAYN_FAULTS
(aiayn.training.faults) into a real training loop."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.checkpoints import list_checkpoints, load_checkpoint
from aiayn.cli import main
from aiayn.files import sha256_file
from aiayn.training.faults import Faults
from aiayn.training.trainer import Trainer, TrainingError, train
from helpers import SMALL_TRAINING, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {**SMALL_TRAINING, "max_steps": 12, "save_interval_steps": 2, "valid_interval_steps": 100}


def cfg(**over: Any):
    return tiny_config(SMALL, **over)


def events(run: Path, name: str) -> list[dict[str, Any]]:
    recs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == name]


def snapshot(t: Trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    return copy.deepcopy(t.model.state_dict()), copy.deepcopy(t.optimizer.state_dict())


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_fault_spec_is_parsed_strictly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt fault must not silently test nothing."""
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_step=3,nan_times=2,rank=1")
    f = Faults.from_env(rank=1)
    assert f.spec == {"nan_at_step": 3, "nan_times": 2, "rank": 1} and f.active
    assert not Faults.from_env(rank=0).active
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_stp=3")
    with pytest.raises(ValueError, match="nan_at_stp"):
        Faults.from_env()


@pytest.mark.rows("C1")
def test_nan_loss_skips_the_step_and_leaves_everything_untouched(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """C1: a NaN loss at step 3: parameters and optimizer state bitwise unchanged, the
    skip counted and logged, training goes on to max_steps."""
    record_property("faults", {"NaN loss": 1})
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_step=3")
    run = tmp_path / "run"
    t = Trainer(cfg(), small_data, run)
    stream = t._batch_stream()
    t._update(stream), t._update(stream)
    before = snapshot(t)
    stats = t._update(stream)
    assert stats.get("skipped") == 1.0 and not torch.isfinite(torch.tensor(stats["loss"]))
    assert_same(snapshot(t), before)
    assert t.state.step == 2 and t.state.nonfinite_skipped == 1
    result = t.run()
    assert result.state.step == 12 and result.state.nonfinite_skipped == 1
    assert load_checkpoint(run / "checkpoint_last.pt")["train_state"]["nonfinite_skipped"] == 1


@pytest.mark.rows("C1")
def test_skipped_nan_step_is_logged_by_the_loop(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C1 through the loop: the skip appears in train_log.jsonl at the step it hit."""
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_step=5")
    result = train(cfg(), small_data, tmp_path / "run")
    assert result.state.nonfinite_skipped == 1 and result.state.step == 12
    assert [e["step"] for e in events(tmp_path / "run", "nonfinite_skipped")] == [5]


@pytest.mark.rows("C2")
@pytest.mark.parametrize(
    ("module", "named"),
    [
        ("encoder.0.ffn", "module encoder.0.ffn"),
        ("decoder.0.cross_attn", "module decoder.0.cross_attn"),
        (None, "no module: the forward pass is finite"),
    ],
)
def test_repeated_nan_stops_with_crash_file_naming_the_module(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    module: str | None,
    named: str,
    record_property: pytest.RecordProperty,
) -> None:
    """C2: NaN on 5 consecutive attempts at step 5: non-zero exit; crash-5.pt holds the
    last good model (step 4) and is not a checkpoint; the checkpoints are untouched; the
    message names the first module with a non-finite output (or says none has one)."""
    record_property("faults", {"NaN on 5 consecutive steps": 1})
    spec = "nan_at_step=5,nan_times=5" + (f",nan_module={module}" if module else "")
    monkeypatch.setenv("AIAYN_FAULTS", spec)
    run = tmp_path / "run"
    argv = [
        "train",
        str(small_data),
        "--out",
        str(run),
        "--preset",
        "tiny",
        "--no-progress",
        *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "5 consecutive non-finite updates at step 5" in err and named in err
    assert "Traceback" not in err
    crash = load_checkpoint(run / "crash-5.pt")
    good = load_checkpoint(run / "checkpoint_4.pt")
    assert_same(crash["model"], good["model"])
    assert crash["crash"]["first_nonfinite"].startswith(named)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint_2.pt", "checkpoint_4.pt"]
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 4


@pytest.mark.rows("C4")
def test_loss_spike_rolls_back_with_a_lower_learning_rate(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """C4: the LR multiplied by 1000 for 10 steps from step 31 sends the loss up without
    NaN; the divergence guard rolls back to the last checkpoint before the spike, halves
    the learning rate, logs it, and the run finishes with a loss back at the pre-spike
    level. The same run without the guard ends far worse (the control)."""
    record_property("faults", {"loss spike (LR x1000)": 1})
    over = {
        "max_steps": 60,
        "save_interval_steps": 10,
        "divergence_window": 20,
        "divergence_short": 3,
        "warmup_steps": 20,
    }
    monkeypatch.setenv("AIAYN_FAULTS", "lr_mult=1000,lr_mult_at_step=31,lr_mult_steps=10")
    guarded = train(cfg(**over, divergence="rollback"), small_data, tmp_path / "guarded")
    off = train(cfg(**over), small_data, tmp_path / "off")
    (rb,) = events(tmp_path / "guarded", "rollback")
    assert rb["step"] <= 30 and rb["lr_factor"] == 0.5  # a checkpoint from before the spike
    assert "loss diverged" in rb["reason"]
    assert guarded.state.rollbacks == 1 and guarded.state.lr_factor == 0.5
    assert guarded.state.step == off.state.step == 60
    before_spike = [h["loss"] for h in off.history if 21 <= h["step"] <= 30]
    end_guarded = [h["loss"] for h in guarded.history[-10:]]
    end_off = [h["loss"] for h in off.history[-10:]]
    assert sum(end_guarded) / 10 < sum(before_spike) / 10 < sum(end_off) / 10


@pytest.mark.rows("C4")
def test_divergence_stop_mode_ends_the_run(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C4, divergence = "stop": the spike ends the run with an error saying so."""
    monkeypatch.setenv("AIAYN_FAULTS", "lr_mult=1000,lr_mult_at_step=31,lr_mult_steps=10")
    with pytest.raises(TrainingError, match="loss diverged at step 3[1-9].*'stop'"):
        train(
            cfg(
                max_steps=60,
                save_interval_steps=10,
                divergence_window=20,
                divergence_short=3,
                warmup_steps=20,
                divergence="stop",
            ),
            small_data,
            tmp_path / "run",
        )


@pytest.mark.rows("C6")
def test_oom_on_one_batch_is_skipped_and_logged(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """C6: an out-of-memory error on step 3's batch: that batch is skipped and logged with
    its shape and token count, counted, and training reaches max_steps."""
    record_property("faults", {"OOM on one batch": 1})
    monkeypatch.setenv("AIAYN_FAULTS", "oom_at_step=3")
    run = tmp_path / "run"
    result = train(cfg(), small_data, run)
    assert result.state.step == 12 and result.state.oom_skipped == 1
    (ev,) = events(run, "oom_skipped")
    assert ev["step"] == 3 and ev["batch"] == 3 and ev["tokens"] > 0
    assert len(ev["src_shape"]) == 2 and ev["src_shape"][0] > 0


@pytest.mark.rows("C6")
def test_oom_twice_on_the_same_batch_is_fatal(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """C6: the same batch running out of memory again (as after a rollback) stops the run
    with advice, instead of skipping it for ever."""
    record_property("faults", {"OOM twice on one batch": 1})
    monkeypatch.setenv("AIAYN_FAULTS", "oom_at_step=1,oom_times=2")
    t = Trainer(cfg(), small_data, tmp_path / "run")
    item = next(t._batch_stream())
    assert t._update(iter([item])) == {"oom": 1.0}
    with pytest.raises(
        TrainingError,
        match=r"out of memory twice on the same batch 1 of "
        r"epoch 0.*lower train.max_tokens",
    ):
        t._update(iter([item]))


@pytest.mark.rows("C3")
def test_nan_weights_never_reach_a_checkpoint(small_data: Path, tmp_path: Path) -> None:
    """C3 in the loop: weights that became NaN are refused at the save point; the last
    good checkpoint stays as it was."""
    run = tmp_path / "run"
    t = Trainer(cfg(max_steps=2), small_data, run)
    t.run()
    digest = sha256_file(run / "checkpoint_2.pt")
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))
    with pytest.raises(Exception, match="non-finite"):
        t.save()
    assert sha256_file(run / "checkpoint_2.pt") == digest
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 2


@pytest.mark.rows("C7")
def test_largest_batches_are_the_largest_of_the_epoch(small_data: Path) -> None:
    """C7's choice of batches, checked against the padded tensors `collate` builds for every
    batch of the epoch: the most tokens, the most attention weights, the most logits."""
    from aiayn.data.batching import collate, token_batches
    from aiayn.data.corpus import load_corpus
    from aiayn.training.guards import largest_batches

    corpus = load_corpus(small_data, "train")
    order = token_batches(corpus.src_lens, corpus.tgt_lens, 200, seed=3, epoch=1)
    shapes = [
        (b.src.size(0), b.src.size(1), b.tgt_in.size(1))
        for b in (collate(corpus, idx) for idx in order)
    ]
    picked = largest_batches(corpus.src_lens, corpus.tgt_lens, order)
    assert 1 <= len(picked) == len(set(picked)) <= 3
    for measure in (
        lambda b, s, t: b * (s + t),
        lambda b, s, t: b * (s * s + t * t + s * t),
        lambda b, s, t: b * t,
    ):
        best = max(measure(*x) for x in shapes)
        assert any(measure(*shapes[p]) == best for p in picked)
    assert len({s[1:] for s in shapes}) > 3  # the epoch has batches of many shapes


@pytest.mark.rows("C7")
def test_preflight_leaves_the_run_unchanged(small_data: Path, tmp_path: Path) -> None:
    """C7: the pre-flight pass over the largest batches is logged and leaves no trace: the
    same losses and weights, bit for bit, as a run without it."""
    runs = {on: train(cfg(preflight=on), small_data, tmp_path / str(on)) for on in (True, False)}
    assert [h["loss"] for h in runs[True].history] == [h["loss"] for h in runs[False].history]
    assert_same(
        load_checkpoint(list_checkpoints(tmp_path / "True")[-1])["model"],
        load_checkpoint(list_checkpoints(tmp_path / "False")[-1])["model"],
    )
    (ev,) = events(tmp_path / "True", "preflight")
    assert ev["step"] == 0 and 1 <= len(ev["shapes"]) <= 3 and ev["peak_gib"] > 0
    assert ev["not_tried"] == 0
    assert events(tmp_path / "False", "preflight") == []


@pytest.mark.rows("C7")
def test_preflight_is_bounded_in_time(small_data: Path, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past its time budget the check tries no further batch (the first always runs): where
    each large batch took a minute (bf16 emulated on an AVX2 CPU) it cost minutes."""
    from aiayn.training import guards

    monkeypatch.setattr(guards, "PREFLIGHT_SECONDS", 0.0)
    train(cfg(preflight=True, max_steps=2), small_data, tmp_path / "run")
    (ev,) = events(tmp_path / "run", "preflight")
    picked = len(ev["shapes"]) + ev["not_tried"]
    assert len(ev["shapes"]) == 1 and picked >= 2, ev


@pytest.mark.rows("C7")
def test_out_of_memory_in_preflight_stops_before_step_1(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: pytest.RecordProperty,
) -> None:
    """C7: a batch too big for memory ends the run at minute 0 with advice, before any
    update or checkpoint (here the loss's allocation fails, as on a full device)."""
    import aiayn.training.trainer

    record_property("faults", {"OOM in the pre-flight": 1})

    def no_memory(*a: Any, **k: Any) -> Any:
        raise torch.OutOfMemoryError("injected: not enough memory")

    monkeypatch.setattr(aiayn.training.trainer, "generator_loss", no_memory)
    run = tmp_path / "run"
    with pytest.raises(
        TrainingError,
        match=r"out of memory on cpu before training, on the "
        r"largest batches of the epoch \(batch \d+ of epoch 0: \d+ sentences, "
        r"source \(\d+, \d+\).*lower train.max_tokens \(now 400\)",
    ):
        train(cfg(), small_data, run)
    assert list_checkpoints(run) == []
    assert not (run / "train_log.jsonl").exists() or not events(run, "preflight")
