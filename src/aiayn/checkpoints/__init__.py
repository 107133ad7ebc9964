"""Checkpoints: the file format with its integrity check (`io`), run directories (`run_dir`:
locking, listing, pruning, resuming) and checkpoint averaging (`average`)."""

from aiayn.checkpoints.average import accumulator_dtype, average_checkpoints, list_last
from aiayn.checkpoints.io import (
    BEST_NAME,
    FORMAT,
    LAST_NAME,
    LOCK_NAME,
    CheckpointError,
    load_checkpoint,
    load_ensemble,
    load_model,
    save_checkpoint_file,
    sidecar_path,
)
from aiayn.checkpoints.run_dir import (
    TRAINING_KEYS,
    RunLock,
    check_run_dir,
    latest_valid_checkpoint,
    list_checkpoints,
    save_best_checkpoint,
    save_checkpoint,
)

__all__ = [
    "BEST_NAME",
    "FORMAT",
    "LAST_NAME",
    "LOCK_NAME",
    "CheckpointError",
    "RunLock",
    "accumulator_dtype",
    "average_checkpoints",
    "check_run_dir",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "list_last",
    "load_checkpoint",
    "load_ensemble",
    "load_model",
    "save_best_checkpoint",
    "save_checkpoint",
    "save_checkpoint_file",
    "sidecar_path",
    "TRAINING_KEYS",
]
