"""Resuming a run: which settings may change, and carrying the data position over to
another number of ranks. Checkpoints never depend on the world size."""

from __future__ import annotations

import logging
from typing import Any

from aiayn.config import Config
from aiayn.training.state import TrainingError, TrainState

log = logging.getLogger(__name__)

#: Settings that may change when a run is resumed; anything else must match the checkpoint.
RESUMABLE_CHANGES = {
    "max_steps",
    "max_minutes",
    "save_interval_steps",
    "save_interval_minutes",
    "patience",
    "divergence",
    "divergence_window",
    "divergence_short",
    "divergence_sigma",
    "divergence_lr_factor",
    "max_rollbacks",
    "keep_last",
    "valid_interval_steps",
    "log_interval_steps",
    "compile",
    "pack_padding",
    "cpu_kernels",
    "preflight",
}
OPTIMIZER_KEYS = {
    "warmup_steps",
    "lr_scale",
    "beta1",
    "beta2",
    "adam_eps",
    "clip_norm",
    "eps_ls",
    "dtype",
}
DATALOADER_KEYS = {
    "max_tokens",
    "update_freq",
    "seed",
    "max_len",
    "max_len_ratio",
    "bpe_dropout",
    "word_dropout",
}


def _config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    }


def check_resume_compatible(
    saved: dict[str, Any], cfg: Config, *, reset_optimizer: bool, reset_dataloader: bool
) -> None:
    """Refuse to resume with different settings, listing the differing keys (fairseq-style).

    A key the checkpoint's config lacks (it was written before the key existed) counts as
    that key's default, the behaviour it was trained with.
    """
    defaults, new = Config().to_dict(), cfg.to_dict()
    old = {
        section: {**defaults[section], **saved["config"][section]} for section in ("model", "train")
    }
    model_diff = _config_diff(old["model"], new["model"])
    if model_diff:
        raise TrainingError(
            "cannot resume: the model differs from the checkpoint's: "
            + ", ".join(f"model.{k}: {a} -> {b}" for k, (a, b) in model_diff.items())
            + " (start a new run directory instead)"
        )
    train_diff = _config_diff(old["train"], new["train"])
    blocked = {
        k: v
        for k, v in train_diff.items()
        if k not in RESUMABLE_CHANGES
        and not (k in OPTIMIZER_KEYS and reset_optimizer)
        and not (k in DATALOADER_KEYS and reset_dataloader)
    }
    if blocked:
        raise TrainingError(
            "cannot resume: settings differ from the checkpoint's: "
            + ", ".join(f"train.{k}: {a} -> {b}" for k, (a, b) in blocked.items())
            + " (pass --reset-optimizer for optimizer/schedule keys, --reset-dataloader for "
            "batching/data keys)"
        )


def reshard(state: TrainState, world_size: int) -> None:
    """Carry the data position over to another number of ranks, in place. Rank r takes
    batches r, r+W, ... of the epoch, so a position of c batches per rank on W ranks is c*W
    batches of the epoch; on W' ranks resume at floor(c*W / W'): up to W'-1 batches are
    seen again, none is skipped."""
    old, new = state.world_size, world_size
    if old == new:
        return
    consumed = state.batch_in_epoch * old
    state.batch_in_epoch = consumed // new
    log.warning(
        "resuming a %d-rank run on %d ranks: epoch %d continues after %d of its "
        "batches (%d seen again)",
        old,
        new,
        state.epoch,
        consumed,
        consumed - state.batch_in_epoch * new,
    )
    state.world_size = new
