"""What a run keeps in its directory, and getting it back: the checkpoint a `Trainer` writes
(model, optimizer, counters, random state, config, vocabulary, data hash), saving it from
rank 0 once every rank agrees on the weights, resuming from the newest valid one, and
rolling back to an earlier one when the loss diverges (RELIABILITY A, B, C4, D5).

`Checkpoints` is one object the `Trainer` holds: it owns what it saves and loads besides
the counters (the model, Adam, the fp16 loss scaler, the vocabulary and data hashes); the
counters (`TrainState`) are the trainer's, passed in and handed back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from aiayn import checkpoints as ckpt_lib
from aiayn.config import Config
from aiayn.data.tokenizer import Vocabulary
from aiayn.model import Transformer
from aiayn.training.distributed import DistContext
from aiayn.training.resume import check_resume_compatible, reshard
from aiayn.training.schedule import step_lr
from aiayn.training.state import TrainingError, TrainState
from aiayn.training.watch import TrainLog

log = logging.getLogger(__name__)
#: The checkpoint's fp16 loss-scaler state (`torch.amp.GradScaler.state_dict()`): scale,
#: growth tracker and the scaler's settings; only fp16 runs write it.
SCALER_KEY = "grad_scaler"


class Checkpoints:
    """The run directory's checkpoints: write one, resume from the newest valid one, roll
    back to an earlier one."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        data_dir: Path,
        dist: DistContext,
        device: torch.device,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        tokenizer: Vocabulary,
        data_sha256: str,
        train_log: TrainLog,
    ) -> None:
        self.cfg, self.run_dir, self.data_dir = cfg, run_dir, data_dir
        self.dist, self.device = dist, device
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.tokenizer, self.data_sha256 = tokenizer, data_sha256
        self.train_log = train_log

    def resume(
        self, reset_optimizer: bool, reset_dataloader: bool
    ) -> tuple[TrainState, Path] | None:
        """Load the newest valid checkpoint of the run directory, if any: the weights,
        Adam and the loss scaler into their objects, and its counters returned with its
        path. Refused (TrainingError) when the config, vocabulary or data do not fit."""
        found = ckpt_lib.latest_valid_checkpoint(
            self.run_dir, clean=self.dist.is_main, require=ckpt_lib.TRAINING_KEYS
        )
        if found is None:
            return None
        path, saved = found
        check_resume_compatible(
            saved, self.cfg, reset_optimizer=reset_optimizer, reset_dataloader=reset_dataloader
        )
        if saved.get("vocab_sha256") != self.tokenizer.sha256:
            raise TrainingError(
                f"cannot resume from {path}: its vocabulary differs from "
                f"{self.data_dir / 'spm.model'}"
            )
        if saved.get("data_sha256") != self.data_sha256 and not reset_dataloader:
            raise TrainingError(
                f"cannot resume from {path}: the training data "
                f"{self.data_dir / 'train.pt'} changed since it was written "
                "(pass --reset-dataloader to start a new epoch on the new data)"
            )
        self.model.load_state_dict(saved["model"])
        if not reset_optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.load_scaler(saved, path)
        state = TrainState(**saved["train_state"])
        if reset_dataloader:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        reshard(state, self.dist.world_size)
        log.info(
            "resumed from %s: step %d, epoch %d, batch %d of the epoch, lr %.3g, best "
            "valid nll %.4f, %d validations without improvement, %d non-finite and %d "
            "out-of-memory updates skipped",
            path,
            state.step,
            state.epoch,
            state.batch_in_epoch,
            step_lr(self.cfg, state, state.step + 1),
            state.best_valid_nll,
            state.valid_without_improvement,
            state.nonfinite_skipped,
            state.oom_skipped,
        )
        older = ckpt_lib.list_checkpoints(self.run_dir)
        keep = self.cfg.train.keep_last
        if len(older) >= keep and self.dist.is_main:
            doomed = [p.name for p in older[: len(older) - keep + 1]]
            log.warning(
                "train.keep_last is %d: the next save deletes %s (set --keep-last %d to keep them)",
                keep,
                ", ".join(doomed),
                len(older) + 1,
            )
        return state, path

    def load_scaler(self, saved: dict[str, Any], path: Path) -> None:
        """The fp16 loss scaler's scale and growth tracker as `path` left them (a resumed
        run repeats the uninterrupted one bit for bit); a checkpoint without them (written
        before fp16 existed, or by an fp32/bf16 run) leaves a fresh scaler, and says so."""
        if not self.scaler.is_enabled():
            return
        state = saved.get(SCALER_KEY)
        if state:
            self.scaler.load_state_dict(state)
            return
        log.info(
            "%s holds no loss-scaler state (an older checkpoint, or one trained in fp32 or "
            "bf16): fp16 resumes with a fresh scaler (scale %g)",
            path,
            self.scaler.get_scale(),
        )
        self.train_log.later(  # train_log.jsonl, as the first update starts
            {
                "event": "fresh_loss_scaler",
                "checkpoint": str(path),
                "loss_scale": self.scaler.get_scale(),
            }
        )

    def checkpoint_dict(self, state: TrainState) -> dict[str, Any]:
        """What a checkpoint holds at the counters `state`."""
        tok = self.tokenizer.to_bytes()
        # fp16 only: a disabled scaler's state is empty; averaging and decoding ignore it
        scaler = {SCALER_KEY: self.scaler.state_dict()} if self.scaler.is_enabled() else {}
        return {
            "format": "aiayn-checkpoint-1",
            "config": self.cfg.to_dict(),
            "vocab_sha256": self.tokenizer.sha256,
            "tokenizer": torch.frombuffer(bytearray(tok), dtype=torch.uint8),
            "data_sha256": self.data_sha256,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": state.step,
            "epoch": state.epoch,
            "train_state": state.to_dict(),
            "rng": {"torch": torch.get_rng_state()},
            **scaler,
        }

    def save(self, state: TrainState) -> Path | None:
        """Rank 0 writes; every rank first checks that all hold the same weights (a rank
        that fell out of step must never go unnoticed) and waits for the write to end."""
        if self.dist.active and not self.dist.same_on_all(self._checksum(), self.device):
            raise TrainingError(
                f"ranks hold different weights at step {state.step}: "
                "a rank fell out of step; stopping without saving"
            )
        path = None
        if self.dist.is_main:
            path = ckpt_lib.save_checkpoint(
                self.run_dir, self.checkpoint_dict(state), self.cfg.train.keep_last
            )
        self.dist.barrier()
        return path

    def _checksum(self) -> float:
        return float(
            sum(
                p.detach().double().abs().sum() + p.detach().double().sum()
                for p in self.model.parameters()
            )
        )

    def rollback(self, state: TrainState, onset_step: int, reason: str) -> TrainState:
        """Reload the newest valid checkpoint from before `onset_step` (the divergence
        guard) and return its counters, with those of what went wrong kept from `state`
        and the learning rate lowered."""
        t = self.cfg.train
        if state.rollbacks >= t.max_rollbacks:
            raise TrainingError(
                f"{reason}; already rolled back {state.rollbacks} times "
                f"(train.max_rollbacks): stopping"
            )
        for path in reversed(ckpt_lib.list_checkpoints(self.run_dir)):
            step = int(path.stem.split("_")[1])
            if step > onset_step:
                continue
            try:
                saved = ckpt_lib.load_checkpoint(path)
            except ckpt_lib.CheckpointError as e:
                log.warning("rollback: skipping %s: %s", path, e)
                continue
            break
        else:
            raise TrainingError(
                f"{reason}; no valid checkpoint from step {onset_step} or "
                "before to roll back to: stopping"
            )
        keep = state
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.load_scaler(saved, path)
        state = TrainState(**saved["train_state"])
        reshard(state, self.dist.world_size)  # it may come from a run on another number of ranks
        for name in (
            "nonfinite_skipped",
            "oom_skipped",
            "overflow_skipped",
            "train_seconds",
            # checkpoint_best.pt stays on disk: only a better validation may replace it
            "best_checkpoint_step",
            "best_checkpoint_metric",
            "best_checkpoint_value",
        ):
            setattr(state, name, getattr(keep, name))
        state.rollbacks = keep.rollbacks + 1
        state.lr_factor = keep.lr_factor * t.divergence_lr_factor
        log.warning(
            "%s: rolled back to %s (step %d); learning rate now x%g (rollback %d of at most %d)",
            reason,
            path,
            state.step,
            state.lr_factor,
            state.rollbacks,
            t.max_rollbacks,
        )
        self.train_log.write(
            {
                "step": state.step,
                "event": "rollback",
                "reason": reason,
                "checkpoint": str(path),
                "lr_factor": state.lr_factor,
            }
        )
        return state
