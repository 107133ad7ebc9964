"""Worker processes that die with their parent, however it dies, and leave Ctrl-C to it.

A pool's workers block on a pipe from their parent. When the parent is killed (SIGKILL,
or SIGTERM with no handler), nothing closes that pipe in a way they notice, and they wait
forever, each holding a copy of the model: under systemd or Kubernetes a leak on every
restart. So every worker calls `worker_init` first:

- Linux's `prctl(PR_SET_PDEATHSIG, SIGKILL)` has the kernel kill the worker when the
  thread that forked it exits; elsewhere (or where prctl fails) a daemon thread polls the
  parent's pid once a second and ends the worker when it changed (a watchdog).
- SIGINT is ignored: Ctrl-C reaches the whole foreground process group, and the parent
  alone decides what to do (end the pool, remove its partial files, one line, exit 130),
  instead of every worker printing a traceback.

`end_pool` is the parent's side: kill the workers now and drop the queued work, rather
than `shutdown(wait=True)`, which would finish every queued batch first.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

#: linux/prctl.h
PR_SET_PDEATHSIG = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (`raise_on_sigterm`), so
    that the same unwinding removes partial files and ends workers; exit 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def raise_on_sigterm() -> None:
    """SIGTERM raises `Terminated` in the main thread (instead of killing the process
    where it stands, leaving temporary files and orphaned workers). Commands that save
    and stop on SIGTERM (train, recipe, serve) install their own handler over this one."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, _raise_terminated)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM ignored from now on (main thread only): for a command whose
    work is finished, so that a late signal cannot change its exit code."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def die_with_parent(parent: int | None = None) -> str:
    """Arrange for this process to end when its parent does; returns how ("prctl" or
    "watchdog"). `parent` is the pid expected (default: the current parent): a parent
    already gone before this call ends the process at once."""
    parent = os.getppid() if parent is None else parent
    how = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took hold
        os._exit(1)
    if how == "watchdog":
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    return how


def worker_init(parent: int | None = None) -> None:
    """The first call of every worker process's initializer (see the module doc)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, inherited by fork
    die_with_parent(parent)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Block SIGINT in this thread while it starts workers: they inherit the blocked mask
    (across exec too), so a Ctrl-C while a worker is still importing prints no traceback
    from it; here the signal stays pending and is delivered when the block ends (it is
    not lost, as ignoring it would lose it)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while spawned workers start: an ignored SIGINT survives exec, so a
    spawned interpreter starts (and stays) immune to the Ctrl-C that reaches its whole
    process group, where a blocked one does not survive `multiprocessing`'s fork-exec. A
    Ctrl-C in that window (the workers' start-up, about a second) is ignored; press it
    again. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def end_pool(pool: Any) -> None:
    """Kill a ProcessPoolExecutor's (or multiprocessing.Pool's) workers now and drop its
    queued work: on Ctrl-C or an error, nothing more is computed."""
    if isinstance(pool, ProcessPoolExecutor):
        processes = list((getattr(pool, "_processes", None) or {}).values())
        results = getattr(pool, "_result_queue", None)
        for p in processes:
            with contextlib.suppress(Exception):
                p.kill()
        for p in processes:
            with contextlib.suppress(Exception):
                p.join(timeout=5)
        # A worker killed while sending its result leaves half a message in the result
        # pipe, and the pool's manager thread waits for the rest forever; the interpreter
        # joins that thread at exit, so the command hung after printing its last line.
        # With every worker dead, closing this process's write end turns that wait into
        # end-of-file, which the manager takes for a broken pool, and it ends.
        if results is not None and not any(p.is_alive() for p in processes):
            with contextlib.suppress(Exception):
                results._writer.close()
        pool.shutdown(wait=False, cancel_futures=True)
    else:
        pool.terminate()
        pool.join()
