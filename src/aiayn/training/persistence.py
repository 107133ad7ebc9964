"""What a run keeps in its directory, and getting it back: the checkpoint a `Trainer` writes
(model, optimizer, counters, random state, config, vocabulary, data hash), saving it from
rank 0 once every rank agrees on the weights, resuming from the newest valid one, and
rolling back to an earlier one when the loss diverges (RELIABILITY A, B, C4, D5)."""

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
from aiayn.training.state import StepHook, TrainingError, TrainState

log = logging.getLogger(__name__)
#: The checkpoint's fp16 loss-scaler state (`torch.amp.GradScaler.state_dict()`): scale,
#: growth tracker and the scaler's settings; only fp16 runs write it.
SCALER_KEY = "grad_scaler"


class TrainerPersistence:
    """The checkpointing methods of `Trainer` (a mixin: they read and change its state)."""

    # The Trainer's state these methods use (set in Trainer.__init__).
    cfg: Config
    run_dir: Path
    data_dir: Path
    dist: DistContext
    device: torch.device
    model: Transformer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    _pending_log: list[dict[str, Any]]
    state: TrainState
    step_hook: StepHook
    tokenizer: Vocabulary
    data_sha256: str
    resumed_from: Path | None

    def _log(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def lr(self, step: int) -> float:
        raise NotImplementedError

    def _resume(self, reset_optimizer: bool, reset_dataloader: bool) -> None:
        found = ckpt_lib.latest_valid_checkpoint(
            self.run_dir, clean=self.dist.is_main, require=ckpt_lib.TRAINING_KEYS
        )
        if found is None:
            return
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
            self._load_scaler(saved, path)
        self.state = TrainState(**saved["train_state"])
        if reset_dataloader:
            self.state.epoch, self.state.batch_in_epoch = self.state.epoch + 1, 0
        reshard(self.state, self.dist.world_size)
        self.resumed_from = path
        log.info(
            "resumed from %s: step %d, epoch %d, batch %d of the epoch, lr %.3g, best "
            "valid nll %.4f, %d validations without improvement, %d non-finite and %d "
            "out-of-memory updates skipped",
            path,
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
            self.lr(self.state.step + 1),
            self.state.best_valid_nll,
            self.state.valid_without_improvement,
            self.state.nonfinite_skipped,
            self.state.oom_skipped,
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

    def _load_scaler(self, saved: dict[str, Any], path: Path) -> None:
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
        self._pending_log.append(  # train_log.jsonl, as the first update starts
            {
                "event": "fresh_loss_scaler",
                "checkpoint": str(path),
                "loss_scale": self.scaler.get_scale(),
            }
        )

    def checkpoint_dict(self) -> dict[str, Any]:
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
            "step": self.state.step,
            "epoch": self.state.epoch,
            "train_state": self.state.to_dict(),
            "rng": {"torch": torch.get_rng_state()},
            **scaler,
        }

    def save(self) -> Path | None:
        """Rank 0 writes; every rank first checks that all hold the same weights (a rank
        that fell out of step must never go unnoticed) and waits for the write to end."""
        if self.dist.active and not self.dist.same_on_all(self._checksum(), self.device):
            raise TrainingError(
                f"ranks hold different weights at step {self.state.step}: "
                "a rank fell out of step; stopping without saving"
            )
        path = None
        if self.dist.is_main:
            path = ckpt_lib.save_checkpoint(
                self.run_dir, self.checkpoint_dict(), self.cfg.train.keep_last
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

    def rollback(self, onset_step: int, reason: str) -> Path:
        """Reload the newest valid checkpoint from before `onset_step` (the divergence
        guard); the counters of what went wrong are kept, the learning rate lowered."""
        t = self.cfg.train
        if self.state.rollbacks >= t.max_rollbacks:
            raise TrainingError(
                f"{reason}; already rolled back {self.state.rollbacks} times "
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
        keep = self.state
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self._load_scaler(saved, path)
        self.state = TrainState(**saved["train_state"])
        reshard(
            self.state, self.dist.world_size
        )  # the checkpoint may come from a run on another number of ranks
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
            setattr(self.state, name, getattr(keep, name))
        self.state.rollbacks = keep.rollbacks + 1
        self.state.lr_factor = keep.lr_factor * t.divergence_lr_factor
        self.step_hook.on_rollback()
        log.warning(
            "%s: rolled back to %s (step %d); learning rate now x%g (rollback %d of at most %d)",
            reason,
            path,
            self.state.step,
            self.state.lr_factor,
            self.state.rollbacks,
            t.max_rollbacks,
        )
        self._log(
            {
                "step": self.state.step,
                "event": "rollback",
                "reason": reason,
                "checkpoint": str(path),
                "lr_factor": self.state.lr_factor,
            }
        )
        return path
