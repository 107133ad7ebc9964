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
    # watching the run (aiayn.training.watch): none of it changes the training
    "valid_bleu_interval_steps",
    "valid_bleu_sentences",
    "valid_bleu_beam",
    "best_metric",
    "tensorboard",
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
    "global_batch_tokens",
    "max_tokens",
    "update_freq",
    "seed",
    "max_len",
    "max_len_ratio",
    "bpe_dropout",
    "word_dropout",
}

#: With train.global_batch_tokens set (and unchanged), free to change on resume: they
#: decide how a global batch is split over ranks and accumulation, not what it holds.
SPLIT_KEYS = {"max_tokens", "update_freq"}


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
    # With the same global batch, max_tokens and update_freq only divide each step's
    # pairs differently (epochs.batch_plan): the data and its position stay exact.
    free = SPLIT_KEYS if old["train"]["global_batch_tokens"] > 0 else set()
    free = free if "global_batch_tokens" not in train_diff else set()
    blocked = {
        k: v
        for k, v in train_diff.items()
        if k not in RESUMABLE_CHANGES
        and k not in free
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
    """Carry the data position over to another number of ranks, in place.

    With a global batch (train.global_batch_tokens; `state.global_batches`) the position
    counts global batches, which are the same on any number of ranks: nothing changes but
    the split of each step's pairs (more accumulation or bigger slices on fewer ranks),
    and the resumed run reads exactly the pairs the old one would have.

    Without, rank r takes batches r, r+W, ... of the epoch, so a position of c batches per
    rank on W ranks is c*W batches of the epoch; on W' ranks resume at floor(c*W / W'): up
    to W'-1 batches are seen again, none is skipped; and each step's batch changes with
    the ranks (train.max_tokens is per rank), which is said too."""
    old, new = state.world_size, world_size
    if old == new:
        return
    if state.global_batches:
        log.info(
            "resuming a %d-rank run on %d ranks: the global batch and the data position "
            "(epoch %d, after %d global batches) are kept; each step's pairs are split "
            "over %d ranks instead",
            old,
            new,
            state.epoch,
            state.batch_in_epoch,
            new,
        )
        state.world_size = new
        return
    log.warning(
        "resuming a %d-rank run on %d ranks without train.global_batch_tokens: each step's "
        "batch becomes %g times as large (train.max_tokens is per rank); set "
        "train.global_batch_tokens to keep the step's batch whatever the ranks",
        old,
        new,
        new / old,
    )
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
