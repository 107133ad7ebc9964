"""What a training run says before its first step: the precision it computes in and why
(what "auto" chose on this machine, fp16's loss scaling), the config beside the
checkpoints, the model and batch sizes, and warnings about settings that run slowly here.
Logged, and the facts a reader of train_log.jsonl needs written there."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from aiayn import speed
from aiayn.config import ONEDNN_PRIMITIVE_CACHE_CAPACITY, Config
from aiayn.data.corpus import Corpus
from aiayn.files import write_text_atomic
from aiayn.model import Transformer, count_parameters
from aiayn.training.distributed import DistContext
from aiayn.training.epochs import BatchPlan
from aiayn.training.precision import resolve_dtype
from aiayn.training.state import TrainState
from aiayn.training.watch import TrainLog

log = logging.getLogger("aiayn.training.trainer")  # the trainer's voice, as before


def precision_record(
    cfg: Config, device: torch.device, dist: DistContext, scaler: torch.amp.GradScaler
) -> dict[str, Any]:
    """Say what train.dtype means here: what "auto" chose and why; for fp16, the loss
    scaling (and, on the CPU, that it is slow). Returns the train_log.jsonl record."""
    t = cfg.train
    dtype = resolve_dtype(t.dtype, device)
    cpu = device.type == "cpu"
    choice = speed.machine_choice() if cpu else None
    describe = speed.IMPLEMENTATIONS.get("describe_machine")
    if cpu and dist.is_main and describe is not None:  # the machine and the choices, first
        log.info("%s", describe())
    if t.dtype == "auto":
        why = (
            (choice.reasons["train"] if choice else "without the speed paths (aiayn.fast)")
            if cpu
            else "this GPU multiplies bf16 natively"
            if dtype == "bf16"
            else "this GPU has no native bf16"
            if dtype == "fp16"
            else f"device {device.type}"
        )
        log.info("train.dtype auto: training in %s (%s)", dtype, why)
    if dtype == "fp16":
        log.info(
            "fp16 mixed precision: dynamic loss scaling (torch.amp.GradScaler: scale "
            "%g at the start, halved and the step skipped on inf/NaN gradients, "
            "doubled after %d clean steps); weights and Adam in fp32",
            scaler.get_scale(),
            scaler.get_growth_interval(),
        )
        if device.type == "cpu":
            log.warning(
                "fp16 on the CPU runs PyTorch's generic float16 kernels, far slower "
                "than fp32 (unless the CPU has AVX-512 FP16): fp16 is for GPUs"
            )
    record: dict[str, Any] = {"event": "precision", "dtype": t.dtype, "resolved": dtype}
    if choice is not None:
        record["machine"] = choice.to_dict()
    return record


def announce(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    dist: DistContext,
    plan: BatchPlan,
    model: Transformer,
    train_data: Corpus,
    state: TrainState,
    train_log: TrainLog,
) -> None:
    """Before the first step: the config beside the checkpoints, and what will run."""
    t = cfg.train
    if dist.is_main:
        write_text_atomic(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    log.info("model: %d parameters; %d training pairs", count_parameters(model), len(train_data))
    if plan.fixed:
        log.info(
            "batch: global %d tokens per side per step (train.global_batch_tokens) = "
            "%d ranks x %d accumulation x ~%d tokens per rank per batch (at most "
            "train.max_tokens %d)",
            plan.global_tokens,
            plan.ranks,
            plan.accumulation,
            plan.rank_tokens,
            t.max_tokens,
        )
    else:
        log.info(
            "batch: effective ~%d tokens per side x %d accumulation x %d ranks = ~%d "
            "per step (train.max_tokens is per rank: set train.global_batch_tokens "
            "to keep the step's batch whatever the ranks)",
            plan.rank_tokens,
            plan.accumulation,
            plan.ranks,
            plan.global_tokens,
        )
    train_log.write({"step": state.step, "event": "batch", **plan.to_dict()})
    if state.epoch < t.bidirectional_epochs:
        log.info(
            "bidirectional training: epochs up to %d on every pair in both "
            "directions (%d pairs), then source->target only",
            t.bidirectional_epochs - 1,
            2 * len(train_data),
        )
    if resolve_dtype(t.dtype, device) == "bf16" and dist.is_main:
        _warn_about_bf16(cfg, device, state, train_log)


def _warn_about_bf16(
    cfg: Config, device: torch.device, state: TrainState, train_log: TrainLog
) -> None:
    warning = speed.slow_bf16_warning(device)
    if warning:
        log.warning(warning)
        train_log.write({"step": state.step, "event": "slow_bf16", "message": warning})
    if (
        cfg.train.bpe_dropout > 0
        and device.type == "cpu"
        and os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
        == str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    ):
        log.warning(
            "BPE-dropout brings new batch shapes every epoch, and aiayn's "
            "large oneDNN kernel cache (%d) then keeps growing (memory, "
            "slower steps): start with ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 "
            "(docs/performance.md)",
            ONEDNN_PRIMITIVE_CACHE_CAPACITY,
        )
