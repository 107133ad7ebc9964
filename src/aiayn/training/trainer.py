"""Training (section 5): the loop around the paper's step (`aiayn.training.step.train_step`:
the label-smoothed loss, backward, clipping, Adam at Eq. 3's rate), with what a long run
needs: batches, guards, checkpoints, validation, logs.

The loop is deterministic: batches come from (seed, epoch) alone and dropout is reseeded
from (seed, step, rank) before every update, so a run resumed from a checkpoint repeats
an uninterrupted one exactly (fairseq does the same).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn import checkpoints as ckpt_lib
from aiayn import speed
from aiayn.config import ONEDNN_PRIMITIVE_CACHE_CAPACITY, Config
from aiayn.data.batching import Batch, Prefetch
from aiayn.data.bpe_dropout import BPEDropout
from aiayn.data.corpus import Corpus, has_split, load_corpus, load_manifest, split_sha256
from aiayn.data.tokenizer import PairTokenizer, load_vocabulary
from aiayn.files import write_text_atomic
from aiayn.model import Transformer, count_parameters
from aiayn.training.distributed import init_from_env, shutdown
from aiayn.training.epochs import batch_plan, batches_from
from aiayn.training.faults import Faults
from aiayn.training.guards import (
    LoopState,
    Pace,
    StopSignal,
    TrainerGuards,
)
from aiayn.training.loss import generator_loss, rdrop_loss
from aiayn.training.persistence import TrainerPersistence
from aiayn.training.precision import make_scaler, resolve_dtype
from aiayn.training.schedule import learning_rate, make_optimizer
from aiayn.training.state import Hooks, StepHook, TrainingError, TrainResult, TrainState
from aiayn.training.step import BatchOutOfMemoryError, StepParts, train_step
from aiayn.training.validation import autocast, validate
from aiayn.training.watch import (
    TB_DIR,
    BleuSubset,
    Board,
    best_metric_name,
    bleu_due,
    bleu_subset,
    is_better,
    patience_metric,
    valid_bleu,
)

__all__ = [
    "Hooks",
    "Trainer",
    "TrainingError",
    "TrainResult",
    "TrainState",
    "learning_rate",
    "make_optimizer",
    "train",
    "validate",
]

log = logging.getLogger(__name__)
#: (epoch, position in the epoch, batch), forever: a generator, or `Prefetch` on one on GPUs
BatchStream = Generator[tuple[int, int, Batch], None, None] | Prefetch[tuple[int, int, Batch]]


def _seed_step(seed: int, step: int, rank: int = 0, world_size: int = 1) -> None:
    # Dropout masks depend only on (seed, step, rank): resumed runs repeat exactly.
    torch.manual_seed(seed * 1_000_003 + step * world_size + rank)


class Trainer(TrainerPersistence, TrainerGuards):
    """One training run in one directory: builds or resumes everything, then `run()`s."""

    def __init__(
        self,
        cfg: Config,
        data_dir: str | Path,
        run_dir: str | Path,
        *,
        device: str = "cpu",
        reset_optimizer: bool = False,
        reset_dataloader: bool = False,
        hooks: Hooks | None = None,
    ) -> None:
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        self.dist, device = init_from_env(device)
        self.device = torch.device(device)
        self.hooks = hooks or Hooks()
        self.manifest = load_manifest(self.data_dir)
        self.tokenizer = load_vocabulary(self.data_dir / "spm.model")
        from dataclasses import replace

        model = replace(cfg.model, vocab_size=self.tokenizer.vocab_size)
        if isinstance(self.tokenizer, PairTokenizer):  # ids mean other pieces on each side
            model = replace(model, share_embeddings=False, share_target_embeddings=True)
        self.cfg = replace(cfg, model=model)
        self.cfg.validate()
        self.train_data = load_corpus(self.data_dir, "train")
        t = self.cfg.train
        self._bpe_dropout = (
            BPEDropout(self.train_data, self.tokenizer, t.bpe_dropout, t.max_len)
            if t.bpe_dropout > 0
            else None
        )
        self._both_directions: Corpus | None = None
        has_valid = has_split(self.data_dir, "valid")
        self.valid_data = load_corpus(self.data_dir, "valid") if has_valid else None
        self.data_sha256 = split_sha256(self.data_dir, "train")
        # Rank 0 owns the directory: it takes the lock before touching anything in it
        # (resuming removes stale temp files, which must never be another trainer's).
        self._lock: ckpt_lib.RunLock | None = None
        if self.dist.is_main:
            ckpt_lib.check_run_dir(self.run_dir)
            self._lock = ckpt_lib.RunLock(self.run_dir).__enter__()
        self.dist.barrier()
        torch.manual_seed(self.cfg.train.seed)  # the same initial weights for a given seed
        # the paper's model, with the speed paths plugged in where they are on (`aiayn.speed`)
        self.model = speed.accelerate(
            Transformer(self.cfg.model).to(self.device),
            pack_padding=self.cfg.train.pack_padding,
            cpu_kernels=self.cfg.train.cpu_kernels,
        )
        if self.cfg.train.compile:
            # in place: parameters and state_dict keys stay those of the plain model
            self.model.compile(dynamic=True)
        # Under torchrun the forward pass goes through DDP, which averages the gradients;
        # checkpoints hold the plain model, so they do not depend on the world size.
        self.net: nn.Module = self.model
        if self.dist.active:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        self.optimizer = make_optimizer(self.model, self.cfg.train)
        #: fp16's dynamic loss scaling (disabled, a no-op, otherwise); `_resume` restores it
        self.scaler = make_scaler(self.cfg.train.dtype, self.device)
        #: train_log.jsonl records made before the loop (precision, a fresh scaler on
        #: resume), written as the first update starts
        self._pending_log: list[dict[str, Any]] = []
        self._log_precision()
        #: how a step's batch is divided over the ranks and accumulation (epochs.batch_plan)
        self.plan = batch_plan(self.cfg.train, self.dist.world_size)
        self.state = TrainState(world_size=self.dist.world_size, global_batches=self.plan.fixed)
        self.resumed_from: Path | None = None
        #: callbacks inside each step: fault injection when AIAYN_FAULTS is set
        self.step_hook: StepHook = Faults.from_env(self.dist.rank)
        self.step_hook.install(self.model)
        #: build batches ahead on a thread (`_batch_stream`): on GPUs; on the CPU the
        #: thread would compete with the step's own threads for the cores
        self.prefetch = self.device.type == "cuda"
        self._oom_batches: set[tuple[int, int]] = set()
        self._last_batches: list[Batch] = []
        self._resume(reset_optimizer, reset_dataloader)
        #: TensorBoard event files (rank 0) and the valid-BLEU pairs (aiayn.training.watch)
        self.board = Board(
            self.run_dir / TB_DIR,
            self.cfg.train.tensorboard and self.dist.is_main,
            purge_step=self.state.step + 1 if self.resumed_from is not None else None,
        )
        self._bleu_subset: BleuSubset | None = None
        # the unit of batch_in_epoch: as saved (check_resume_compatible refuses a change of
        # train.global_batch_tokens) or, after --reset-dataloader, at the new epoch's start
        self.state.global_batches = self.plan.fixed

    def close(self) -> None:
        """Release the run directory (run() does this when it ends)."""
        board = getattr(self, "board", None)  # None when __init__ failed before it
        if board is not None:
            board.close()
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def lr(self, step: int) -> float:
        """Eq. 3 times lr_scale, times the factor left by divergence rollbacks."""
        t = self.cfg.train
        return self.state.lr_factor * learning_rate(
            step, self.cfg.model.d_model, t.warmup_steps, t.lr_scale
        )

    def _batch_stream(self) -> BatchStream:
        """(epoch, position, batch) from the saved position on, forever; on a GPU built
        ahead on a thread and pinned, so that the GPU does not wait for the next batch
        (`batching.Prefetch`). Close it when done."""
        if not self.prefetch:
            return self._batches()
        pin = self.device.type == "cuda"
        return Prefetch((e, i, b.pin_memory() if pin else b) for e, i, b in self._batches())

    def _batches(self) -> Generator[tuple[int, int, Batch], None, None]:
        epoch, start = self.state.epoch, self.state.batch_in_epoch
        while True:
            for i, batch in batches_from(
                self._epoch_data(epoch), self.cfg.train, epoch, start, self.dist
            ):
                yield epoch, i + 1, batch
            epoch, start = epoch + 1, 0

    def _epoch_data(self, epoch: int) -> Corpus:
        """The training pairs of `epoch`: the prepared ones, or a BPE-dropout draw that
        depends on (seed, epoch) only, so that a resumed run sees the same epochs; in
        both directions for the first `train.bidirectional_epochs` epochs."""
        t = self.cfg.train
        corpus = (
            self.train_data
            if self._bpe_dropout is None
            else self._bpe_dropout.epoch(t.seed * 1_000_003 + epoch)
        )
        if epoch >= t.bidirectional_epochs:
            return corpus
        if self._bpe_dropout is not None:  # a new draw each epoch
            return corpus.both_directions()
        if self._both_directions is None:  # the prepared pairs: built once
            self._both_directions = corpus.both_directions()
        return self._both_directions

    def _log_precision(self) -> None:
        """Say what train.dtype means here: what "auto" chose and why; for fp16, the
        loss scaling (and, on the CPU, that it is slow)."""
        t = self.cfg.train
        dtype = resolve_dtype(t.dtype, self.device)
        cpu = self.device.type == "cpu"
        choice = speed.machine_choice() if cpu else None
        describe = speed.IMPLEMENTATIONS.get("describe_machine")
        if cpu and self.dist.is_main and describe is not None:  # the machine and the choices
            log.info("%s", describe())
        if t.dtype == "auto":
            why = (
                (choice.reasons["train"] if choice else "without the speed paths (aiayn.fast)")
                if cpu
                else "this GPU multiplies bf16 natively"
                if dtype == "bf16"
                else "this GPU has no native bf16"
                if dtype == "fp16"
                else f"device {self.device.type}"
            )
            log.info("train.dtype auto: training in %s (%s)", dtype, why)
        if dtype == "fp16":
            log.info(
                "fp16 mixed precision: dynamic loss scaling (torch.amp.GradScaler: scale "
                "%g at the start, halved and the step skipped on inf/NaN gradients, "
                "doubled after %d clean steps); weights and Adam in fp32",
                self.scaler.get_scale(),
                self.scaler.get_growth_interval(),
            )
            if self.device.type == "cpu":
                log.warning(
                    "fp16 on the CPU runs PyTorch's generic float16 kernels, far slower "
                    "than fp32 (unless the CPU has AVX-512 FP16): fp16 is for GPUs"
                )
        record: dict[str, Any] = {"event": "precision", "dtype": t.dtype, "resolved": dtype}
        if choice is not None:
            record["machine"] = choice.to_dict()
        self._pending_log.append(record)

    def _update(self, stream: BatchStream) -> dict[str, float]:
        """One optimizer step (`step.train_step`, section 5) over `plan.accumulation` batches
        (train.update_freq, or as a global batch needs: epochs.batch_plan), with the guards'
        answers to what it reports: an out-of-memory batch skips the update, a non-finite
        loss is counted and skipped, an fp16 overflow lowers the scale."""
        for record in self._pending_log:  # made before the loop: `_log_precision`
            self._log({"step": self.state.step, **record})
        self._pending_log.clear()
        step = self.state.step + 1
        self.step_hook.begin_attempt(step)
        _seed_step(self.cfg.train.seed, step, self.dist.rank, self.dist.world_size)
        batches = [next(stream) for _ in range(self.plan.accumulation)]
        self._last_batches = [b for _, _, b in batches]
        if self.hooks.on_batch:
            for epoch, pos, b in batches:
                self.hooks.on_batch(step, epoch, pos, b.ids)
        try:
            done = train_step(self._step_parts(), self._last_batches, step, self.lr(step))
        except BatchOutOfMemoryError as e:
            return self._skip_oom(e.__cause__ or e, batches, e.index)
        self.state.epoch, self.state.batch_in_epoch = batches[-1][0], batches[-1][1]
        if done.outcome == "nonfinite":
            self.state.nonfinite_skipped += 1
            return {**done.stats, "skipped": 1.0}
        if done.outcome == "overflow":
            self.state.overflow_skipped += 1
            self._after_overflow(step, done.loss_scale, self.scaler.get_scale())
            return {**done.stats, "overflow": 1.0}
        self.state.step = step
        self.state.tokens_seen += done.src_tokens + done.tgt_tokens
        self.state.flops += done.flops
        return done.stats

    def _step_parts(self) -> StepParts:
        """The parts `train_step` computes with, as they are now (a test may swap one)."""
        t = self.cfg.train
        count = speed.IMPLEMENTATIONS.get("training_flops")

        def flops(batch: Batch) -> float:  # the model's work: the real tokens (model.Packing)
            if count is None:  # counted by the speed paths' FLOP formulas (aiayn.fast.flops)
                return 0.0
            return count(
                self.cfg.model,
                batch.src.size(0),
                batch.src.size(1),
                batch.tgt_in.size(1),
                src_tokens=batch.src_tokens,
                tgt_tokens=batch.tgt_tokens,
            ) * (2 if t.rdrop_alpha > 0 else 1)

        return StepParts(
            net=self.net,
            model=self.model,
            loss=self._loss,
            optimizer=self.optimizer,
            scaler=self.scaler,
            dist=self.dist,
            hook=self.step_hook,
            device=self.device,
            clip_norm=t.clip_norm,
            word_dropout=t.word_dropout,
            flops=flops,
        )

    def _loss(self, net: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        """The batch's summed training loss and NLL, through `net` (DDP or the model)."""
        t = self.cfg.train
        with autocast(self.device, t.dtype):
            if t.rdrop_alpha > 0:  # both passes in one batch: two masks
                features = net(
                    batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1), features_only=True
                )
                return rdrop_loss(
                    features,
                    self.model.generator.weight,
                    batch.tgt_out.repeat(2, 1),
                    t.eps_ls,
                    t.rdrop_alpha,
                )
            features = net(batch.src, batch.tgt_in, features_only=True)
            return generator_loss(
                features,
                self.model.generator.weight,
                batch.tgt_out,
                t.eps_ls,
                cpu_kernels=t.cpu_kernels,
            )

    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        with open(self.run_dir / "train_log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.board.write(record)  # the same numbers, for TensorBoard

    def _validate(self, final: bool = False) -> dict[str, float]:
        """Validation NLL and PPL on rank 0, with valid BLEU where due (`watch.bleu_due`;
        `final`: the run's last validation), and checkpoint_best.pt kept. Under DDP the
        other ranks wait at a barrier while rank 0 decodes."""
        if self.valid_data is None:
            return {}
        t = self.cfg.train
        with_bleu = bleu_due(t, self.state.step, final)
        if not self.dist.is_main:
            if with_bleu:
                self.dist.barrier()
            return {}
        metrics = validate(
            self.model, self.valid_data, t.max_tokens, self.device, t.dtype, t.cpu_kernels
        )
        if with_bleu:
            metrics.update(self._valid_bleu())
        self.state.best_valid_nll = min(self.state.best_valid_nll, metrics["valid_nll"])
        record: dict[str, Any] = {"step": self.state.step, "time": self.state.train_seconds}
        record.update(metrics)
        if with_bleu and self._bleu_subset is not None:
            record["valid_bleu_ref"] = self._bleu_subset.reference_kind
        best = self._keep_best(metrics)
        if best:
            record["best"] = True
        self._log(record)
        self.board.flush()
        log.info(
            "step %d: valid nll %.4f, ppl %.2f%s%s",
            self.state.step,
            metrics["valid_nll"],
            metrics["valid_ppl"],
            f", BLEU {metrics['valid_bleu']:.2f}" if with_bleu else "",
            f" (the best {self.state.best_checkpoint_metric} so far: {ckpt_lib.BEST_NAME})"
            if best
            else "",
        )
        if self.hooks.on_valid:
            self.hooks.on_valid(self.state.step, metrics)
        if with_bleu:
            self.dist.barrier()
        return metrics

    def _valid_bleu(self) -> dict[str, float]:
        """sacreBLEU of the fixed validation subset, decoded now (`watch.valid_bleu`); the
        first time, the subset is built and an event record says what is scored."""
        t = self.cfg.train
        first = self._bleu_subset is None
        if self._bleu_subset is None:
            assert self.valid_data is not None
            limit = min(self.cfg.decode.max_input_len, self.cfg.model.max_positions - 1)
            self._bleu_subset = bleu_subset(
                self.valid_data, self.tokenizer, self.manifest, t.valid_bleu_sentences, limit
            )
        subset = self._bleu_subset
        metrics, _, signature = valid_bleu(
            self.model,
            subset,
            self.tokenizer,
            t.valid_bleu_beam,
            self.cfg.decode,
            self.device,
            t.dtype,
        )
        if first:
            if subset.reference_kind != "raw":
                log.warning(
                    "valid BLEU is scored against the reference subwords decoded, not the "
                    "raw text: %s",
                    subset.reference_source,
                )
            self._log(
                {
                    "step": self.state.step,
                    "event": "valid_bleu",
                    "sentences": len(subset.sources),
                    "beam": t.valid_bleu_beam,
                    "reference": subset.reference_kind,
                    "reference_source": subset.reference_source,
                    "signature": signature,
                }
            )
        return metrics

    def _keep_best(self, metrics: dict[str, float]) -> bool:
        """Write checkpoint_best.pt when this validation beats the best so far by
        train.best_metric (`watch.is_better`); the state records what it has to beat."""
        name = best_metric_name(self.cfg.train)
        s = self.state
        if name is None or name not in metrics:
            return False
        if not is_better(name, metrics[name], s.best_checkpoint_metric, s.best_checkpoint_value):
            return False
        s.best_checkpoint_step, s.best_checkpoint_metric = s.step, name
        s.best_checkpoint_value = float(metrics[name])
        ckpt_lib.save_best_checkpoint(self.run_dir, self.checkpoint_dict())
        return True

    def _validate_and_check_patience(self, final: bool = False) -> bool:
        """Validate; True when `patience` validations in a row brought no better value of
        the watched metric (`watch.patience_metric`: train.best_metric's, valid BLEU where
        it is measured, else validation NLL). A validation that did not measure it (no
        BLEU at this step) neither counts nor resets the count."""
        s = self.state
        watched = patience_metric(self.cfg.train)
        before = (s.best_checkpoint_metric, s.best_checkpoint_value, s.best_valid_nll)
        metrics = self._validate(final)
        if not metrics or watched not in metrics:
            return False
        if watched == "valid_nll":
            improved = metrics["valid_nll"] < before[2]
        else:  # the best checkpoint's metric: what _validate just compared it with
            improved = is_better(watched, metrics[watched], before[0], before[1])
        s.valid_without_improvement = 0 if improved else s.valid_without_improvement + 1
        patience = self.cfg.train.patience
        if patience and s.valid_without_improvement >= patience:
            log.warning(
                "no better %s in %d validations (patience %d): stopping",
                watched,
                s.valid_without_improvement,
                patience,
            )
            return True
        return False

    def _announce(self) -> None:
        """Before the first step: the config beside the checkpoints, and what will run."""
        t = self.cfg.train
        if self.dist.is_main:
            write_text_atomic(
                self.run_dir / "config.json", json.dumps(self.cfg.to_dict(), indent=2) + "\n"
            )
        plan = self.plan
        log.info(
            "model: %d parameters; %d training pairs",
            count_parameters(self.model),
            len(self.train_data),
        )
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
        self._log({"step": self.state.step, "event": "batch", **plan.to_dict()})
        if self.state.epoch < t.bidirectional_epochs:
            log.info(
                "bidirectional training: epochs up to %d on every pair in both "
                "directions (%d pairs), then source->target only",
                t.bidirectional_epochs - 1,
                2 * len(self.train_data),
            )
        if resolve_dtype(t.dtype, self.device) == "bf16" and self.dist.is_main:
            self._warn_about_bf16()

    def _warn_about_bf16(self) -> None:
        warning = speed.slow_bf16_warning(self.device)
        if warning:
            log.warning(warning)
            self._log({"step": self.state.step, "event": "slow_bf16", "message": warning})
        if (
            self.cfg.train.bpe_dropout > 0
            and self.device.type == "cpu"
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

    def _log_interval(self, loop: LoopState, step: int, stats: dict[str, float]) -> None:
        """Every log_interval_steps a line of train_log.jsonl: loss and NLL as means over
        the interval's target tokens (one batch's value is too noisy to plot), the rest as
        this step's."""
        n = int(stats["tgt_tokens"])
        loop.window = [
            loop.window[0] + stats["loss"] * n,
            loop.window[1] + stats["nll"] * n,
            int(loop.window[2]) + n,
        ]
        if step % self.cfg.train.log_interval_steps:
            return
        tokens = max(int(loop.window[2]), 1)
        self._log(
            {
                "step": step,
                "time": self.state.train_seconds,
                "epoch": self.state.epoch,
                **stats,
                "loss": loop.window[0] / tokens,
                "nll": loop.window[1] / tokens,
            }
        )
        loop.window = [0.0, 0.0, 0]

    def _end_of_step(self, loop: LoopState, step: int, result: TrainResult) -> bool:
        """Validate, save and decide whether to stop, after step `step`: True to stop (the
        reason in `result.stopped_by`)."""
        t = self.cfg.train
        impatient = False
        if step % t.valid_interval_steps == 0:
            impatient = self._validate_and_check_patience(final=step >= t.max_steps)
        out_of_time = t.max_minutes > 0 and self.state.train_seconds >= 60 * t.max_minutes
        due_by_time = (
            t.save_interval_minutes > 0
            and time.monotonic() - loop.last_save >= 60 * t.save_interval_minutes
        )
        # Decided together: each rank's clock and signals are its own.
        out_of_time, stopping, due_by_time, impatient = self.dist.any_each(
            [out_of_time, loop.stop.received is not None, due_by_time, impatient], self.device
        )
        due = due_by_time or (t.save_interval_steps > 0 and step % t.save_interval_steps == 0)
        finished = step >= t.max_steps or out_of_time or stopping or impatient
        if (
            (step >= t.max_steps or out_of_time)
            and not (stopping or impatient)
            and (step % t.valid_interval_steps)
        ):
            self._validate(final=True)  # the run's last validation, in its last checkpoint
        if due or finished:
            result.last_checkpoint = self.save()
            loop.last_save = time.monotonic()
        if out_of_time:
            result.stopped_by = "max_minutes"
        elif stopping:
            result.stopped_by = signal.Signals(loop.stop.received or signal.SIGTERM).name
        elif impatient:
            result.stopped_by = "patience"
        return out_of_time or stopping or impatient

    def run(self) -> TrainResult:
        """Train until max_steps or max_minutes, saving and validating at intervals."""
        t = self.cfg.train
        result = TrainResult(self.state, self.run_dir, None)
        if self.state.step >= t.max_steps:
            log.warning(
                "already at step %d >= max_steps %d: nothing to do", self.state.step, t.max_steps
            )
            result.stopped_by = "already_done"
            return result
        if self.resumed_from is not None:  # readers keep the later pass of redone steps
            self._log(
                {"step": self.state.step, "event": "resumed", "checkpoint": str(self.resumed_from)}
            )
        self._announce()
        self.model.train()
        if t.preflight:
            self.preflight()
        with contextlib.closing(self), StopSignal() as stop, contextlib.ExitStack() as done:
            loop = LoopState(
                self._batch_stream(),
                stop,
                Pace(60 * t.max_minutes, self.state.train_seconds),
                start_step=self.state.step,
            )
            done.callback(lambda: loop.stream.close())  # the stream in use then (rollbacks)
            while self.state.step < t.max_steps:
                t0 = time.perf_counter()
                stats = self._update(loop.stream)
                dt = time.perf_counter() - t0
                self.state.train_seconds += dt
                if "oom" in stats or "overflow" in stats:  # fp16 overflow: `_after_overflow`
                    continue
                stats["tokens_per_s"] = (stats["src_tokens"] + stats["tgt_tokens"]) / dt
                if "skipped" in stats:
                    self._after_skipped_update(loop)
                    continue
                loop.consecutive_bad = 0
                step = self.state.step
                if self._rolled_back(loop, stats["loss"]):
                    continue
                result.history.append({"step": step, **stats})
                per_step = loop.pace.seconds_per_step(
                    step - loop.start_step, self.state.train_seconds
                )
                if per_step is not None:
                    self._check_pace(step, per_step)
                if self.hooks.on_step:
                    self.hooks.on_step(step, stats)
                self._log_interval(loop, step, stats)
                if self._end_of_step(loop, step, result):
                    break
        self.dist.barrier()  # no rank leaves while rank 0 still writes
        result.state = self.state  # a rollback replaces the state object
        return result


def train(
    cfg: Config,
    data_dir: str | Path,
    run_dir: str | Path,
    *,
    device: str = "cpu",
    reset_optimizer: bool = False,
    reset_dataloader: bool = False,
    hooks: Hooks | None = None,
) -> TrainResult:
    """Train (or resume) a model on a prepared data directory; see :class:`Trainer`."""
    trainer = Trainer(
        cfg,
        data_dir,
        run_dir,
        device=device,
        reset_optimizer=reset_optimizer,
        reset_dataloader=reset_dataloader,
        hooks=hooks,
    )
    try:
        return trainer.run()
    finally:
        trainer.close()
        if trainer.dist.active:
            shutdown()
