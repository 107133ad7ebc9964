"""The paper's batch as one global number (`train.global_batch_tokens`), over ranks and
accumulation: issue 55's simulations on gloo.

With a global batch G the epoch is one list of global batches, the same on any number of
ranks, and each is split into ranks x accumulation slices (epochs.epoch_order). So with
dropout off, 8 ranks, 4 ranks x 2 and 1 rank x 8 take the same optimizer steps: the same
sentences, the same summed loss, gradients that differ only in float32 summation order
(DDP's all-reduce against the accumulation's running sum). Stated tolerance, as in
test_distributed.py: losses rel 1e-5, weights rtol 1e-4 / atol 3e-5 (Adam normalises tiny
gradient differences; measured here: max |diff| ~1e-6 after 8 steps).

Multi-process runs go through torchrun (as test_distributed.py) running this file as the
worker (`__main__` below): each rank writes the corpus ids of every micro-batch it reads
to IDS.rankR.jsonl, so the tests see what each rank read. The 8-rank runs are slow
(~1-2 minutes each on the 2-core CPU); the default suite runs the pure functions, the
null slices, the resume rules and one 2-rank run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from aiayn.checkpoints import load_checkpoint
from aiayn.config import Config, ConfigError, TrainConfig, apply_overrides, get_preset
from aiayn.data.batching import collate, split_global_batch, token_batches
from aiayn.data.corpus import load_corpus
from aiayn.training.distributed import DistContext
from aiayn.training.epochs import batch_plan, epoch_order, global_batches
from aiayn.training.resume import check_resume_compatible, reshard
from aiayn.training.state import TrainingError, TrainState
from aiayn.training.trainer import Hooks, train

#: A micro model; dropout off, so that layouts differ only in summation order. G = 1600
#: cuts the 200 pairs of `small_data` into 7 global batches (one of 4 pairs: on 8 ranks,
#: 4 null slices); max_tokens = G / 8 gives 8 ranks x 1, 4 x 2, 2 x 4, 1 x 8.
G = 1600
MICRO: dict[str, Any] = {
    "N": 1,
    "d_model": 16,
    "d_ff": 32,
    "h": 2,
    "d_k": 8,
    "d_v": 8,
    "P_drop": 0.0,
    "train.global_batch_tokens": G,
    "train.max_tokens": G // 8,
    "max_steps": 8,
    "warmup_steps": 4,
    "save_interval_steps": 4,
    "log_interval_steps": 1,
    "valid_interval_steps": 100,
    "dtype": "fp32",
    "preflight": False,
}
ENV = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
# a micro model's steps are thread start-up on more than one thread (10x slower here)
pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_of(over: dict[str, Any]) -> Config:
    return apply_overrides(get_preset("tiny"), over)


# ----------------------------------------------------------------------------- the worker
def _worker(spec: dict[str, Any]) -> None:
    """One rank (torchrun sets RANK, WORLD_SIZE): train, logging every micro-batch's ids."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts
    ids_file = open(f"{spec['ids']}.rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def on_batch(step: int, epoch: int, pos: int, ids: torch.Tensor) -> None:
        record = {"step": step, "attempt": attempt, "pos": pos, "ids": ids.tolist()}
        ids_file.write(json.dumps(record) + "\n")
        ids_file.flush()

    train(cfg_of(spec["over"]), spec["data"], spec["run"], hooks=Hooks(on_batch=on_batch))
    ids_file.close()


def torchrun_worker(
    torchrun: list[str],
    data: Path,
    run: Path,
    over: dict[str, Any],
    nproc: int,
    *,
    extra: tuple[str, ...] = (),
    faults: str = "",
    timeout: int = 600,
) -> subprocess.CompletedProcess[str]:
    spec = {"data": str(data), "run": str(run), "over": over, "ids": str(run) + ".ids"}
    env = {**ENV, **({"AIAYN_FAULTS": faults} if faults else {})}
    return subprocess.run(
        [*torchrun, f"--nproc-per-node={nproc}", *extra, __file__, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_ids(run: Path, nproc: int) -> dict[int, dict[int, list[list[int]]]]:
    """rank -> step -> the micro-batches' ids (a step redone after a restart: its last
    attempt's)."""
    out: dict[int, dict[int, list[list[int]]]] = {}
    for rank in range(nproc):
        steps: dict[int, list[list[int]]] = defaultdict(list)
        attempt: dict[int, int] = {}
        for line in Path(f"{run}.ids.rank{rank}.jsonl").read_text().splitlines():
            r = json.loads(line)
            if attempt.get(r["step"], -1) < r["attempt"]:  # a later attempt starts afresh
                steps[r["step"]], attempt[r["step"]] = [], r["attempt"]
            steps[r["step"]].append(r["ids"])
        out[rank] = dict(steps)
    return out


def step_sentences(ids: dict[int, dict[int, list[list[int]]]]) -> dict[int, list[int]]:
    """step -> the sorted ids all ranks read in it."""
    steps: dict[int, list[int]] = defaultdict(list)
    for per_rank in ids.values():
        for step, micro in per_rank.items():
            steps[step].extend(i for m in micro for i in m)
    return {s: sorted(v) for s, v in steps.items()}


def step_losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "event" not in r}


def assert_weights_close(a: Path, b: Path) -> None:
    wa, wb = (load_checkpoint(p)["model"] for p in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=3e-5)


def copy_until(run: Path, step: int, dest: Path) -> None:
    """A run directory holding only `run`'s checkpoint of `step` (to resume from there)."""
    dest.mkdir()
    for p in run.glob(f"checkpoint_{step}.pt*"):
        shutil.copy(p, dest / p.name)


# ------------------------------------------------------------------------- pure functions
def test_split_global_batch_sizes_order_and_null_slices() -> None:
    batch = list(range(10, 21))  # 11 pairs
    parts = split_global_batch(batch, 4)
    assert parts == [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19, 20]]
    assert split_global_batch([5, 6], 4) == [[5], [6], [], []]
    assert split_global_batch([], 2) == [[], []]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_global_batch(batch, 0)


@pytest.mark.parametrize(
    ("global_tokens", "max_tokens", "update_freq", "world", "accumulation", "rank_tokens"),
    [
        (25000, 25000, 1, 8, 1, 3125),  # the paper: 8 GPUs of ~3125 tokens
        (25000, 4096, 1, 8, 1, 3125),
        (25000, 3125, 1, 4, 2, 3125),  # 8 -> 4 ranks: accumulation doubles, not memory
        (25000, 3125, 1, 1, 8, 3125),
        (25000, 25000, 4, 2, 4, 3125),  # update_freq is a floor
        (1600, 200, 1, 3, 3, 177),  # 1600 / 9, rounded down
    ],
)
def test_batch_plan_divides_the_global_batch(
    global_tokens: int,
    max_tokens: int,
    update_freq: int,
    world: int,
    accumulation: int,
    rank_tokens: int,
) -> None:
    t = TrainConfig(
        global_batch_tokens=global_tokens, max_tokens=max_tokens, update_freq=update_freq
    )
    plan = batch_plan(t, world)
    assert (plan.accumulation, plan.rank_tokens, plan.global_tokens) == (
        accumulation,
        rank_tokens,
        global_tokens,
    )
    assert plan.rank_tokens <= max_tokens and plan.fixed
    # off: today's behaviour, the step's batch grows with the ranks
    off = batch_plan(TrainConfig(max_tokens=4096, update_freq=2), 8)
    assert (off.global_tokens, off.accumulation, off.rank_tokens, off.fixed) == (
        4096 * 2 * 8,
        2,
        4096,
        False,
    )


@pytest.mark.parametrize(("world", "update_freq"), [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1), (3, 1)])
def test_every_pair_is_read_by_one_rank_and_steps_read_the_global_batches(
    small_data: Path, world: int, update_freq: int
) -> None:
    """(2) in data: over an epoch, the ranks' batches together are the epoch, each pair
    once; and the slices of each step are that step's global batch, whatever the layout."""
    corpus = load_corpus(small_data, "train")
    t = TrainConfig(global_batch_tokens=G, max_tokens=G, update_freq=update_freq)
    acc = batch_plan(t, world).accumulation
    assert acc == update_freq
    for epoch in (0, 3):
        steps = global_batches(corpus, t, epoch)
        assert steps == token_batches(corpus.src_lens, corpus.tgt_lens, G, seed=1, epoch=epoch)
        per_rank = [epoch_order(corpus, t, epoch, DistContext(r, world)) for r in range(world)]
        assert all(len(order) == len(steps) * acc for order in per_rank)  # ranks in step
        read = sorted(i for order in per_rank for b in order for i in b)
        assert read == list(range(len(corpus)))  # the epoch, no pair twice
        for k, batch in enumerate(steps):
            got = [i for order in per_rank for b in order[k * acc : (k + 1) * acc] for i in b]
            assert sorted(got) == sorted(batch)


def test_the_null_batch_adds_no_loss_and_no_gradient(small_data: Path) -> None:
    from aiayn.fast import accelerate
    from aiayn.model import Transformer
    from aiayn.training.loss import generator_loss

    cfg = cfg_of({**MICRO, "vocab_size": 200})
    null = collate(load_corpus(small_data, "train"), [])
    assert null.ids.numel() == 0 and null.tgt_tokens == 0 and null.src.shape == (1, 1)
    for cpu_kernels in (True, False):
        model = accelerate(Transformer(cfg.model), pack_padding=True, cpu_kernels=cpu_kernels)
        features = model(null.src, null.tgt_in, features_only=True)
        loss, nll = generator_loss(
            features, model.generator.weight, null.tgt_out, 0.1, cpu_kernels=cpu_kernels
        )
        assert float(loss.detach()) == 0.0 and float(nll) == 0.0
        loss.backward()
        # every parameter gets a gradient (DDP's all-reduce waits for each), all zeros
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)


def test_null_slices_leave_the_steps_unchanged(small_data: Path, tmp_path: Path) -> None:
    """One rank reading each global batch in 8 slices trains as one reading it whole,
    also at step 3, whose global batch holds 4 pairs (4 null slices)."""
    steps = {**MICRO, "max_steps": 3, "save_interval_steps": 3, "train.max_tokens": G}
    corpus = load_corpus(small_data, "train")
    assert len(global_batches(corpus, cfg_of(MICRO).train, 0)[2]) == 4
    whole = train(cfg_of(steps), small_data, tmp_path / "whole")
    sliced = train(cfg_of({**steps, "update_freq": 8}), small_data, tmp_path / "s")
    assert [h["loss"] for h in sliced.history] == pytest.approx(
        [h["loss"] for h in whole.history], rel=1e-6
    )
    assert_weights_close(
        tmp_path / "whole" / "checkpoint_last.pt", tmp_path / "s" / "checkpoint_last.pt"
    )


# -------------------------------------------------------------------------- resume rules
def _saved(over: dict[str, Any]) -> dict[str, Any]:
    return {"config": cfg_of(over).to_dict()}


def test_resume_may_resplit_a_global_batch_but_not_change_it() -> None:
    saved = _saved(MICRO)
    # max_tokens and update_freq only resplit each step's pairs: allowed
    check_resume_compatible(
        saved,
        cfg_of({**MICRO, "train.max_tokens": 50, "update_freq": 3}),
        reset_optimizer=False,
        reset_dataloader=False,
    )
    with pytest.raises(TrainingError, match=r"train.global_batch_tokens: 1600 -> 800"):
        check_resume_compatible(
            saved,
            cfg_of({**MICRO, "train.global_batch_tokens": 800}),
            reset_optimizer=False,
            reset_dataloader=False,
        )
    # without a global batch, max_tokens decides the data: still refused
    off = {**MICRO, "train.global_batch_tokens": 0}
    with pytest.raises(TrainingError, match=r"train.max_tokens: 200 -> 50"):
        check_resume_compatible(
            _saved(off),
            cfg_of({**off, "train.max_tokens": 50}),
            reset_optimizer=False,
            reset_dataloader=False,
        )


def test_reshard_keeps_a_global_position_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    state = TrainState(step=5, epoch=1, batch_in_epoch=3, world_size=8, global_batches=True)
    with caplog.at_level(logging.INFO):
        reshard(state, 4)
    assert (state.epoch, state.batch_in_epoch, state.world_size) == (1, 3, 4)
    assert "resuming a 8-rank run on 4 ranks: the global batch and the data position" in (
        caplog.text
    )
    legacy = TrainState(step=5, epoch=1, batch_in_epoch=3, world_size=2)
    with caplog.at_level(logging.INFO):
        reshard(legacy, 4)
    assert (legacy.batch_in_epoch, legacy.world_size) == (1, 4)  # 6 batches: 1 on 4 ranks
    assert "each step's batch becomes 2 times as large" in caplog.text


def test_config_and_cli(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.global_batch_tokens must be >= 0"):
        cfg_of({"train.global_batch_tokens": -1})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "train",
            str(tmp_path),
            "--out",
            str(tmp_path / "run"),
            "--preset",
            "base",
            "--global-batch-tokens",
            "25000",
            "--dump-config",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        check=True,
    ).stdout
    assert json.loads(out)["train"]["global_batch_tokens"] == 25000


# --------------------------------------------------------------------- 2 ranks (default)
@pytest.fixture(scope="module")
def two_ranks(
    small_data: Path, tmp_path_factory: pytest.TempPathFactory, torchrun: list[str]
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """2 ranks x 4 accumulation, 4 steps, saving at 2 and 4."""
    run = tmp_path_factory.mktemp("g2") / "run"
    over = {**MICRO, "train.max_tokens": G // 8, "max_steps": 4, "save_interval_steps": 2}
    proc = torchrun_worker(torchrun, small_data, run, over, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_two_ranks_equal_one_rank_and_resume_on_one_exactly(
    small_data: Path, tmp_path: Path, two_ranks: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    """(1) and (4) at 2 ranks: the same steps as 1 rank x 8; the 2-rank checkpoint of step
    2 resumes on 1 rank reading exactly the global batches the 2 ranks read next."""
    run, proc = two_ranks
    assert (
        f"batch: global {G} tokens per side per step (train.global_batch_tokens) = 2 ranks "
        "x 4 accumulation x ~200 tokens per rank per batch" in proc.stderr
    )
    header = [
        json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines() if "batch" in x
    ][0]
    assert header["event"] == "batch" and header["accumulation"] == 4 and header["ranks"] == 2
    ids = read_ids(run, 2)
    corpus = load_corpus(small_data, "train")
    t = cfg_of(MICRO).train
    epoch0 = global_batches(corpus, t, 0)
    for step in range(1, 5):  # each rank read its slices: r, r + 2, ... of the global batch
        for rank in range(2):
            assert ids[rank][step] == split_global_batch(epoch0[step - 1], 8)[rank::2]
    # one rank, 8 slices of each global batch
    one = tmp_path / "one"
    train(cfg_of({**MICRO, "max_steps": 4, "save_interval_steps": 2}), small_data, one)
    a, b = step_losses(one), step_losses(run)
    assert list(a) == list(b) == [1, 2, 3, 4]
    assert list(a.values()) == pytest.approx(list(b.values()), rel=1e-5)
    assert_weights_close(one / "checkpoint_last.pt", run / "checkpoint_last.pt")
    # 2 -> 1 ranks from step 2: accumulation 4 -> 8, the data goes on where it was
    resumed = tmp_path / "resumed"
    copy_until(run, 2, resumed)
    seen: dict[int, list[int]] = defaultdict(list)
    result = train(
        cfg_of({**MICRO, "max_steps": 4, "save_interval_steps": 2}),
        small_data,
        resumed,
        hooks=Hooks(on_batch=lambda s, e, p, i: seen[s].extend(i.tolist())),
    )
    assert result.state.world_size == 1 and result.state.batch_in_epoch == 4
    assert {s: sorted(v) for s, v in seen.items()} == {
        s: v for s, v in step_sentences(ids).items() if s > 2
    }
    assert_weights_close(resumed / "checkpoint_last.pt", run / "checkpoint_last.pt")


# ---------------------------------------------------------------------- 8 ranks (slow)
@pytest.fixture(scope="module")
def eight_ranks(
    small_data: Path, tmp_path_factory: pytest.TempPathFactory, torchrun: list[str]
) -> Path:
    """8 ranks x 1, 8 steps (the 7 global batches of epoch 0 and one of epoch 1), saving
    at 4 and 8."""
    run = tmp_path_factory.mktemp("g8") / "run"
    proc = torchrun_worker(torchrun, small_data, run, MICRO, 8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "= 8 ranks x 1 accumulation" in proc.stderr
    return run


@pytest.mark.slow
def test_eight_ranks_equal_one_rank_with_eightfold_accumulation(
    small_data: Path, tmp_path: Path, eight_ranks: Path
) -> None:
    """(1): losses per step and final weights of 8 ranks = 1 rank x 8 (tolerance: module
    docstring)."""
    one = tmp_path / "one"
    result = train(cfg_of(MICRO), small_data, one)
    assert result.state.world_size == 1
    a, b = step_losses(one), step_losses(eight_ranks)
    assert list(a) == list(b) == list(range(1, 9))
    assert list(a.values()) == pytest.approx(list(b.values()), rel=1e-5)
    assert_weights_close(one / "checkpoint_last.pt", eight_ranks / "checkpoint_last.pt")


@pytest.mark.slow
def test_eight_ranks_read_each_pair_once_an_epoch(small_data: Path, eight_ranks: Path) -> None:
    """(2) as run: what the 8 ranks read in epoch 0 (steps 1-7) is every pair once; each
    step is one global batch, each rank its slice (the 4-pair batch: 4 ranks a null)."""
    ids = read_ids(eight_ranks, 8)
    corpus = load_corpus(small_data, "train")
    epoch0 = global_batches(corpus, cfg_of(MICRO).train, 0)
    assert len(epoch0) == 7 and min(len(b) for b in epoch0) < 8
    read = [i for rank in ids.values() for s in range(1, 8) for m in rank[s] for i in m]
    assert sorted(read) == list(range(len(corpus)))
    for step in range(1, 8):
        slices = split_global_batch(epoch0[step - 1], 8)
        assert [ids[r][step] for r in range(8)] == [[s] for s in slices]
    assert step_sentences(ids)[8] == sorted(global_batches(corpus, cfg_of(MICRO).train, 1)[0])


@pytest.mark.slow
def test_a_killed_rank_restarts_and_ends_as_the_uninterrupted_run(
    small_data: Path, tmp_path: Path, eight_ranks: Path, torchrun: list[str]
) -> None:
    """(3): rank 5 SIGKILLs itself as step 6 starts; torchrun --max-restarts=1 restarts
    all 8 ranks, which resume from the step-4 checkpoint, read the same sentences in each
    step and end with the counters of the uninterrupted run, and its weights within the
    summation-order tolerance.

    Not bitwise, as the 2-rank test_distributed.py D1 is: a sum of 2 ranks' gradients is
    the same in either order, but gloo's ring all-reduce over 8 ranks sums each element
    in an order set by its offset in DDP's gradient bucket, and a restarted DDP runs its
    first step with the buckets in registration order before rebuilding them in the
    order the gradients come (the uninterrupted run rebuilt them after step 1).
    Measured: two uninterrupted 8-rank runs are bitwise equal; the restarted one equals
    them up to step 6, and its losses of steps 7-8 differ by ~3e-8 relative.
    """
    run = tmp_path / "run"
    proc = torchrun_worker(
        torchrun,
        small_data,
        run,
        MICRO,
        8,
        extra=("--max-restarts=1",),
        faults=f"kill_at_step=6,rank=5,once={tmp_path / 'fired'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "fired").exists()
    assert f"resumed from {run / 'checkpoint_4.pt'}: step 4" in proc.stderr
    assert step_sentences(read_ids(run, 8)) == step_sentences(read_ids(eight_ranks, 8))
    got, base = step_losses(run), step_losses(eight_ranks)  # redone steps: the last pass
    assert list(got) == list(base)
    assert list(got.values()) == pytest.approx(list(base.values()), rel=1e-6)
    assert_weights_close(run / "checkpoint_last.pt", eight_ranks / "checkpoint_last.pt")
    a, b = (load_checkpoint(r / "checkpoint_last.pt") for r in (eight_ranks, run))
    inexact = ("train_seconds", "best_valid_nll")  # a clock; a validation of the weights
    counters = [  # as JSON, so that a NaN equals a NaN
        json.dumps({k: v for k, v in c["train_state"].items() if k not in inexact}) for c in (a, b)
    ]
    assert counters[0] == counters[1]
    assert a["train_state"]["best_valid_nll"] == pytest.approx(
        b["train_state"]["best_valid_nll"], rel=1e-6
    )
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"]) == (8, 1)


@pytest.mark.slow
def test_eight_to_four_ranks_keeps_the_global_batch_and_position(
    small_data: Path, tmp_path: Path, eight_ranks: Path, torchrun: list[str]
) -> None:
    """(4): the 8-rank checkpoint of step 4 resumes on 4 ranks x 2 accumulation: steps
    5-8 read the sentences the 8 ranks read, and end at the 8-rank run's weights (within
    the summation-order tolerance)."""
    run = tmp_path / "run"
    copy_until(eight_ranks, 4, run)
    proc = torchrun_worker(torchrun, small_data, run, MICRO, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming a 8-rank run on 4 ranks: the global batch and the data position" in (
        proc.stderr
    )
    assert "= 4 ranks x 2 accumulation x ~200 tokens per rank per batch" in proc.stderr
    eight = step_sentences(read_ids(eight_ranks, 8))
    four = step_sentences(read_ids(run, 4))
    assert four == {s: v for s, v in eight.items() if s > 4}
    base = step_losses(eight_ranks)
    assert list(step_losses(run).values()) == pytest.approx(
        [base[s] for s in range(5, 9)], rel=1e-5
    )
    assert_weights_close(run / "checkpoint_last.pt", eight_ranks / "checkpoint_last.pt")
    state = load_checkpoint(run / "checkpoint_last.pt")["train_state"]
    assert state["world_size"] == 4 and state["global_batches"] and state["epoch"] == 1


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
