"""aiayn.decoding.workers: batches mapped over forked one-thread processes."""

from __future__ import annotations

import gc
import os
import signal
import weakref
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch

from aiayn.decoding import workers as workers_module
from aiayn.decoding.workers import check_workers, map_batches, resolve_workers
from aiayn.fast import native


def _square_with_threads(i: int) -> tuple[int, int, int]:
    return i * i, torch.get_num_threads(), os.getpid()


def test_results_in_order_from_one_thread_workers() -> None:
    """Every index is computed once, results come back in index order, `done` sees each,
    and the work ran in other processes with one thread each (GNU OpenMP hangs in a forked
    child that starts more)."""
    seen: dict[int, int] = {}
    out = map_batches(
        _square_with_threads, 9, workers=2, done=lambda i, r: seen.__setitem__(i, r[0])
    )
    assert [r[0] for r in out] == [i * i for i in range(9)]
    assert seen == {i: i * i for i in range(9)}
    assert {r[1] for r in out} == {1}
    assert os.getpid() not in {r[2] for r in out}
    # one worker: in this process, in order
    assert map_batches(lambda i: (i, os.getpid()), 3, workers=1) == [
        (i, os.getpid()) for i in range(3)
    ]


def test_a_matrix_product_in_a_worker_after_the_parent_used_its_threads() -> None:
    """The parent has run multithreaded products; a forked worker still computes (and
    returns the same numbers) instead of hanging."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = a @ a
        out = map_batches(lambda i: a @ a, 2, workers=2)
    finally:
        torch.set_num_threads(threads)
    for x in out:
        torch.testing.assert_close(x, want)


def _fail_on_three(i: int) -> int:
    if i == 3:
        raise ValueError("batch 3 is broken")
    return i


def _die_on_two(i: int) -> int:
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    return i


def test_a_worker_error_reaches_the_caller() -> None:
    with pytest.raises(ValueError, match="batch 3 is broken"):
        map_batches(_fail_on_three, 6, workers=2)


def test_a_killed_worker_fails_the_call_instead_of_hanging() -> None:
    with pytest.raises(BrokenProcessPool):
        map_batches(_die_on_two, 6, workers=2)
    assert map_batches(lambda i: i, 4, workers=2) == [0, 1, 2, 3]  # usable again


def test_bad_worker_counts_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        check_workers(0)
    with pytest.raises(ValueError, match="CPU"):
        check_workers(2, "cuda")
    check_workers(1, "cuda")


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _frozen_count(i: int) -> int:
    return gc.get_freeze_count()


@pytest.mark.parametrize("workers", [1, 2])
def test_decoding_runs_with_the_objects_before_it_frozen(workers: int) -> None:
    """While batches run, the objects made before are out of the collector's sight (in a
    forked worker too: it inherits them), and a collection then does not visit them;
    afterwards they are back, and unreachable cycles made before are collected again."""
    assert gc.get_freeze_count() == 0
    before = _Cycle()
    ref = weakref.ref(before)
    counts = map_batches(_frozen_count, 4, workers=workers)
    assert all(c > 1000 for c in counts)  # the interpreter's and PyTorch's objects
    assert gc.get_freeze_count() == 0
    del before
    gc.collect()
    assert ref() is None  # the cycle, no longer held back
    # a caller's own freeze is left as it was
    gc.freeze()
    try:
        map_batches(_frozen_count, 2, workers=workers)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_server_that_froze_for_its_workers_is_not_asked_again(monkeypatch) -> None:
    """After `freeze_for_workers` (the server, before forking), decoding neither counts the
    frozen objects (`gc.get_freeze_count` walks all of them: ~11 ms a call for a loaded
    model, on every request) nor unfreezes them."""
    from aiayn.decoding import workers

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count walks every frozen object")

    monkeypatch.setattr(workers, "_kept_frozen", False)
    try:
        workers.freeze_for_workers()
        monkeypatch.setattr(workers.gc, "get_freeze_count", walk)
        assert map_batches(lambda i: i * i, 3) == [0, 1, 4]
        monkeypatch.undo()
        assert gc.get_freeze_count() > 1000  # still frozen
    finally:
        gc.unfreeze()


def test_auto_is_one_process_per_cpu_thread_and_one_on_a_gpu(monkeypatch) -> None:
    """`--workers auto`: one forked process per thread PyTorch uses on the CPU (its default is
    the physical cores, or OMP_NUM_THREADS); one on a GPU, or where nothing can be forked."""
    assert resolve_workers("auto") == torch.get_num_threads()
    monkeypatch.setattr(workers_module.torch, "get_num_threads", lambda: 6)
    assert resolve_workers("auto", "cpu") == 6
    assert resolve_workers("auto", torch.device("cpu")) == 6
    assert resolve_workers("auto", "cuda:1") == 1
    assert resolve_workers(3, "cpu") == 3  # a count is kept as given
    with pytest.raises(ValueError, match="'auto'"):
        resolve_workers("all")
    monkeypatch.setattr(workers_module.mp, "get_all_start_methods", lambda: ["spawn"])
    assert resolve_workers("auto", "cpu") == 1


def test_the_workers_flag_takes_a_count_or_auto() -> None:
    from argparse import ArgumentTypeError

    from aiayn.cli.flags_generate import workers_count

    assert (workers_count("auto"), workers_count("3")) == ("auto", 3)
    with pytest.raises(ArgumentTypeError, match="'many' is neither a count nor auto"):
        workers_count("many")
    with pytest.raises(ArgumentTypeError, match=">= 1"):
        workers_count("0")


def _plan_id(_: int) -> int:
    plan = _model.__dict__.get("_decoder_plan")
    return id(plan[1]) if plan is not None and plan[1] is not None else 0


def _decode_then_plan_id(_: int) -> int:
    from aiayn.decoding.search import beam_search

    with torch.inference_mode():
        beam_search(_model, torch.randint(4, 40, (2, 5)), 2, 0.6, 1.0, 3, 1)
    return _plan_id(0)


_model: torch.nn.Module


@pytest.mark.skipif(native.library() is None, reason="no C compiler: no one-call step")
def test_workers_share_the_decoding_plan_built_before_forking() -> None:
    """`prepare_shared` lays out the one-call step's weights in this process, so that forked
    workers decode with that one copy (copy-on-write) instead of each building its own
    (measured: 294 -> 35-39 MiB private to each worker, base float32 with 37,000 words)."""
    global _model
    from aiayn.decoding.search import beam_search
    from helpers import tiny_model

    _model = tiny_model()
    src = torch.randint(4, 40, (2, 5))
    with torch.inference_mode():
        beam_search(_model, src, 2, 0.6, 1.0, 3, 1)  # a small search takes the one call
    assert _plan_id(0) != 0, "the one-call step did not apply here: the test has no teeth"
    _model = tiny_model()  # a fresh one, no plan yet
    assert _plan_id(0) == 0
    workers_module.prepare_shared(_model)
    parent = _plan_id(0)
    assert parent != 0
    assert map_batches(_decode_then_plan_id, 2, workers=2) == [parent, parent]
    _model.train()  # a model being trained gets none
    _model.__dict__.pop("_decoder_plan")
    workers_module.prepare_shared(_model)
    assert _plan_id(0) == 0
