"""Optional dependencies, checked before any work: a subcommand that needs an extra which is
not installed stops at once with one line naming the `pip install 'aiayn[EXTRA]'` to run,
instead of decoding for a minute and then failing with ModuleNotFoundError."""

from __future__ import annotations

import importlib.util
import logging

from aiayn.files import UsageError

log = logging.getLogger("aiayn")

#: What each subcommand cannot work without: (module, extra) pairs.
NEEDS = {
    "attention": (("matplotlib", "plot"),),
    "table1": (("matplotlib", "plot"),),
    "plot": (("matplotlib", "plot"),),
    "serve": (("fastapi", "serve"), ("uvicorn", "serve"), ("prometheus_client", "serve")),
}
#: What a subcommand does without, saying so up front: (module, extra, what is left out).
OPTIONAL = {
    "recipe": (("matplotlib", "plot", "no curve.png"),),
    "table3": (("matplotlib", "plot", "no curve.png per run"),),
}
#: `export --to ENGINE`'s packages.
EXPORT = {"ctranslate2": ("ctranslate2",), "marian": ("transformers", "sentencepiece")}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(command: str, modules: tuple[tuple[str, str], ...] | None = None) -> None:
    """Raise UsageError naming the first missing module of `command` and its extra."""
    for module, extra in modules if modules is not None else NEEDS.get(command, ()):
        if not installed(module):
            raise UsageError(
                f"aiayn {command} needs {module}, which is not installed: "
                f"pip install 'aiayn[{extra}]'"
            )
    for module, extra, without in OPTIONAL.get(command, ()):
        if not installed(module):
            log.warning("%s is not installed (pip install 'aiayn[%s]'): %s", module, extra, without)


def warn_tensorboard(enabled: bool) -> None:
    """train.tensorboard on without TensorBoard: train_log.jsonl stays the record; say so
    before training, not at the first log line."""
    if enabled and not installed("tensorboard"):
        log.warning(
            "train.tensorboard is on but tensorboard is not installed: no event files "
            "(pip install 'aiayn[watch]', or --set train.tensorboard=false); "
            "train_log.jsonl stays the record"
        )
