"""The `aiayn` command: each subcommand parses its arguments and calls one library function.

`main` is the console script's entry point (and `python -m aiayn`'s). It sets the process
settings (`aiayn.cli.environment`) before any torch work, parses the command line
(`aiayn.cli.parser`), runs one `aiayn.cli.commands` function and turns known errors into
one line on stderr and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from aiayn.cli.environment import (
    MALLOC_ENV,
    ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    apply_process_settings,
)
from aiayn.config import ConfigError
from aiayn.files import UsageError
from aiayn.processes import Terminated, ignore_stop_signals, raise_on_sigterm

__all__ = ["MALLOC_ENV", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "build_parser", "main"]

log = logging.getLogger("aiayn")

#: Error classes (module, name) that mean bad input, not a bug: one line, no traceback.
KNOWN_ERRORS = (
    ("aiayn.files", "InputError"),
    ("aiayn.checkpoints.io", "CheckpointError"),
    ("aiayn.training.trainer", "TrainingError"),
)


def build_parser() -> argparse.ArgumentParser:
    """The `aiayn` argument parser (see `aiayn.cli.parser`)."""
    from aiayn.cli.parser import build_parser as build

    return build()


def _known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConfigError]
    for module, name in KNOWN_ERRORS:
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(getattr(__import__(module, fromlist=[name]), name))
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    """Run `aiayn ARGV` (default: sys.argv[1:]) and return its exit code.

    Given no `argv` (the console script), heavy subcommands may re-execute the process
    once with allocator settings, SIGTERM raises `Terminated` (as Ctrl-C raises
    KeyboardInterrupt) and, once the command is done, late stop signals are ignored; given
    one (in-process callers), none of that outlives the call.
    """
    reexec = argv is None
    if argv is None:
        argv = sys.argv[1:]
    try:
        apply_process_settings(argv, reexec=reexec)
        import aiayn.fast  # noqa: F401  # the speed paths on for every command (aiayn.speed)

        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C before any work: nothing to clean up
        print("aiayn: interrupted (Ctrl-C): stopped before any work", file=sys.stderr)
        return 130
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    previous = signal.getsignal(signal.SIGTERM)
    raise_on_sigterm()
    try:
        from aiayn.cli.extras import require

        require(args.command)  # an optional dependency missing: said now, not after the work
        code = func(args)
        sys.stdout.flush()  # a reader that went away shows here, inside the handler below
        # the work is done and its code decided: a Ctrl-C or SIGTERM during the
        # interpreter's teardown (which resets Python's handlers) must not turn it into a
        # death by signal
        if reexec:
            ignore_stop_signals()
        return code
    except KeyboardInterrupt as e:
        # Ctrl-C (twice, for train) or SIGTERM: everything below has unwound, so partial
        # outputs are removed (files.atomic_write) and workers ended (aiayn.processes)
        terminated = isinstance(e, Terminated)
        what = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
        after = (
            "the run resumes from its last checkpoint with the same command"
            if args.command in ("train", "recipe", "table3")
            else "no partial output left"
        )
        print(f"aiayn {args.command}: {what}: stopped; {after}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:
        # the reader went away (`aiayn evaluate ... | head`): stop quietly, as `cat` does;
        # stdout goes to /dev/null so that the interpreter's final flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the shell's code for a process its pipe's reader left
    except (ConfigError, UsageError) as e:
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (*_known_errors(), ValueError) as e:  # type: ignore[misc]  # a tuple of types
        # Library functions raise ValueError for bad input (line counts that differ in
        # `evaluate`, an unknown split in `data`): one line, the traceback only with -v.
        log.debug("traceback", exc_info=True)
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        # the system refused (a full disk, a read-only directory): what and where, in one
        # line; everything written so far is intact (outputs are written atomically)
        log.debug("traceback", exc_info=True)
        message = str(e.strerror or e)
        for name in (e.filename, e.filename2):  # the path, once (the bare error names none)
            if name and str(name) not in message:
                message += f": {name}"
        print(f"aiayn {args.command}: error: {message}", file=sys.stderr)
        return 4
    finally:
        if not reexec and previous is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signal.SIGTERM, previous)
