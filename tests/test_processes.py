"""aiayn.processes: worker pools that end when told, without hanging the interpreter."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from aiayn.processes import end_pool

_writer_fd: int | None = None
_sent: Any = None  # an Event, set once the half message is written


def _send_half_a_result(_: int) -> None:
    """Write the header of a 1,000-byte message and 10 of its bytes into the pool's result
    pipe, then wait to be killed: what a worker killed mid-send leaves behind."""
    assert _writer_fd is not None
    os.write(_writer_fd, struct.pack("!i", 1000) + b"x" * 10)
    _sent.set()
    time.sleep(600)


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_end_pool_ends_the_manager_thread_when_a_worker_died_mid_send() -> None:
    global _writer_fd, _sent
    context = mp.get_context("fork")
    _sent = context.Event()
    pool = ProcessPoolExecutor(1, mp_context=context)
    queue: Any = pool._result_queue  # type: ignore[attr-defined]
    _writer_fd = queue._writer.fileno()  # inherited by the forked worker
    try:
        pool.submit(_send_half_a_result, 0)
        manager: Any = pool._executor_manager_thread  # type: ignore[attr-defined]
        assert _sent.wait(timeout=30)
        time.sleep(0.3)  # the manager reads the header and waits for the rest
        end_pool(pool)
        # the interpreter joins this thread at exit: alive, the process would never end
        manager.join(timeout=10)
        assert not manager.is_alive()
    finally:
        _writer_fd = _sent = None
