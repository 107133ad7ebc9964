"""The settings of `train` and `info`: a preset or experiment file, then the flags; and for
`aiayn train DATA --out RUN` on a run that exists, the run's own settings.

A run's config.json holds every setting of its first start, the command line's overrides
included, so the same short command resumes it with nothing lost (a `--set
train.valid_bleu_interval_steps=20` not repeated no longer stops BLEU being measured). A
flag given on resume changes that setting, said in a line; a change of the model is
refused (it would be another run); the trainer itself still refuses other optimizer,
schedule or batching settings without --reset-optimizer / --reset-dataloader (A7).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from aiayn.config import (
    Config,
    ConfigError,
    apply_overrides,
    get_preset,
    load_experiment,
    parse_set_args,
)
from aiayn.files import UsageError

log = logging.getLogger("aiayn")

#: `train` and `info` flags that set a config key: (argparse dest, config key).
CONFIG_FLAGS = (
    ("max_steps", "train.max_steps"),
    ("max_minutes", "train.max_minutes"),
    ("save_interval_steps", "train.save_interval_steps"),
    ("save_interval_minutes", "train.save_interval_minutes"),
    ("keep_last", "train.keep_last"),
    ("seed", "train.seed"),
    ("max_tokens", "train.max_tokens"),
    ("update_freq", "train.update_freq"),
    ("global_batch_tokens", "train.global_batch_tokens"),
    ("dtype", "train.dtype"),
    ("valid_interval_steps", "train.valid_interval_steps"),
)


def _base_config(args: argparse.Namespace) -> Config:
    if getattr(args, "config", None):
        cfg, _ = load_experiment(args.config)
        return cfg
    return get_preset(args.preset or "base")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line: explicit flags, then --set (which come last)."""
    overrides: dict[str, Any] = {}
    for flag, key in CONFIG_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides[key] = value
    overrides.update(parse_set_args(getattr(args, "set", None) or []))
    return overrides


def resolve_config(args: argparse.Namespace) -> Config:
    """Preset or experiment file, then explicit flags, then --set (which come last)."""
    return apply_overrides(_base_config(args), _overrides(args))


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, section in cfg.to_dict().items() for k, v in section.items()}


def resolve_train_config(args: argparse.Namespace) -> Config:
    """A new run's config (`resolve_config`), or, for a run directory that holds a
    checkpoint, the run's own config.json (the settings of its first start, overrides
    included: nothing given then is lost on resume) with the flags given now applied, each
    change said in a line. A change of the model is refused: it is another run."""
    out = Path(args.out)
    stored_file = out / "config.json"
    if not stored_file.is_file() or not any(out.glob("checkpoint_*.pt")):
        return resolve_config(args)
    try:
        stored = Config.from_dict(json.loads(stored_file.read_text(encoding="utf-8")))
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{stored_file}: not a readable run config ({e}); it holds the run's settings: "
            "restore it, or start another --out"
        ) from None
    given = _overrides(args)
    cfg = apply_overrides(stored, given)
    before, after = _flat(stored), _flat(cfg)
    changed = [k for k in after if after[k] != before.get(k)]
    model = [k for k in changed if k.startswith("model.")]
    if model:
        raise UsageError(
            f"{out} was trained with "
            + ", ".join(f"{k}={before.get(k)!r}" for k in model)
            + f"; the command line sets {', '.join(f'{k}={after[k]!r}' for k in model)}: a "
            "run's model cannot change on resume; give another --out to train that model"
        )
    log.info(
        "resuming %s with the settings in %s (overrides of its first start included)",
        out,
        stored_file,
    )
    for k in changed:
        log.warning(
            "resuming with %s changed: %r -> %r (given on the command line)",
            k,
            before.get(k),
            after[k],
        )
    if args.preset is not None or getattr(args, "config", None):
        base = _flat(apply_overrides(_base_config(args), given))
        ignored = [k for k in after if k != "model.vocab_size" and base.get(k) != after[k]]
        if ignored:
            source = (
                f"--config {args.config}"
                if getattr(args, "config", None)
                else f"--preset {args.preset}"
            )
            log.warning(
                "%s differs from the run's settings in %s: the run's are kept (give a flag or "
                "--set to change one)",
                source,
                ", ".join(f"{k} ({base.get(k)!r}; the run: {after[k]!r})" for k in ignored[:6])
                + (f" and {len(ignored) - 6} more" if len(ignored) > 6 else ""),
            )
    return cfg
