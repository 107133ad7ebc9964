"""Training (section 5): the loop around the paper's step (`aiayn.training.step.train_step`:
the label-smoothed loss, backward, clipping, Adam at Eq. 3's rate), with what a long run
needs around it as objects the `Trainer` holds and calls:

    guards       `guards.Guards`: non-finite updates, out of memory, divergence, pace
    checkpoints  `persistence.Checkpoints`: save every interval, resume, roll back
    validator    `validation.Validator`: valid NLL and BLEU, checkpoint_best.pt, patience
    scaler       fp16's dynamic loss scaling (`precision.make_scaler`; a no-op otherwise)
    net          the model, or DDP around it under torchrun (`distributed.data_parallel`)
    step_hook    fault injection for the reliability tests (`faults.Faults`; a no-op)
    train_log    train_log.jsonl and TensorBoard (`watch.TrainLog`)

Read `run` (the loop) and `_update` (one step and the guards' answers) first.

The loop is deterministic: batches come from (seed, epoch) alone and dropout is reseeded
from (seed, step, rank) before every update, so a run resumed from a checkpoint repeats
an uninterrupted one exactly (fairseq does the same).

Long because the Trainer's set-up builds the objects it holds (the model, its optimizer and
scaler, the guards, the checkpoints, the validator, the log) from one config, and the loop
reads best beside what it was given; the objects themselves are their own modules.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn import checkpoints as ckpt_lib
from aiayn import speed
from aiayn.config import Config
from aiayn.data.batching import Batch, Prefetch
from aiayn.data.bpe_dropout import BPEDropout
from aiayn.data.corpus import Corpus, has_split, load_corpus, load_manifest, split_sha256
from aiayn.data.tokenizer import PairTokenizer, load_vocabulary
from aiayn.model import Transformer
from aiayn.training.announce import announce, precision_record
from aiayn.training.distributed import data_parallel, init_from_env, shutdown
from aiayn.training.epochs import batch_plan, batches_from
from aiayn.training.faults import Faults
from aiayn.training.guards import Guards, LoopState, Pace, StopSignal
from aiayn.training.loss import generator_loss, rdrop_loss
from aiayn.training.persistence import Checkpoints
from aiayn.training.precision import make_scaler
from aiayn.training.schedule import learning_rate, make_optimizer, step_lr
from aiayn.training.state import Hooks, StepHook, TrainingError, TrainResult, TrainState
from aiayn.training.step import BatchOutOfMemoryError, StepParts, train_step
from aiayn.training.validation import Validator, autocast, validate
from aiayn.training.watch import TrainLog

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


class Trainer:
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
        model = replace(cfg.model, vocab_size=self.tokenizer.vocab_size)
        if isinstance(self.tokenizer, PairTokenizer):  # ids mean other pieces on each side
            model = replace(model, share_embeddings=False, share_target_embeddings=True)
        self.cfg = replace(cfg, model=model)
        self.cfg.validate()
        t = self.cfg.train
        self.train_data = load_corpus(self.data_dir, "train")
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
        torch.manual_seed(t.seed)  # the same initial weights for a given seed
        # the paper's model, with the speed paths plugged in where they are on (`aiayn.speed`)
        self.model = speed.accelerate(
            Transformer(self.cfg.model).to(self.device),
            pack_padding=t.pack_padding,
            cpu_kernels=t.cpu_kernels,
        )
        if t.compile:
            # in place: parameters and state_dict keys stay those of the plain model
            self.model.compile(dynamic=True)
        self.net: nn.Module = data_parallel(self.model, self.dist, self.device)
        self.optimizer = make_optimizer(self.model, t)
        #: fp16's dynamic loss scaling (disabled, a no-op, otherwise); resuming restores it
        self.scaler = make_scaler(t.dtype, self.device)
        self.train_log = TrainLog(self.run_dir, self.dist.is_main)
        self.train_log.later(precision_record(self.cfg, self.device, self.dist, self.scaler))
        #: how a step's batch is divided over the ranks and accumulation (epochs.batch_plan)
        self.plan = batch_plan(t, self.dist.world_size)
        self.state = TrainState(world_size=self.dist.world_size, global_batches=self.plan.fixed)
        self.resumed_from: Path | None = None
        #: callbacks inside each step: fault injection when AIAYN_FAULTS is set
        self.step_hook: StepHook = Faults.from_env(self.dist.rank)
        self.step_hook.install(self.model)
        #: build batches ahead on a thread (`_batch_stream`): on GPUs; on the CPU the
        #: thread would compete with the step's own threads for the cores
        self.prefetch = self.device.type == "cuda"
        self._last_batches: list[Batch] = []
        self.checkpoints = Checkpoints(
            self.cfg,
            self.run_dir,
            self.data_dir,
            self.dist,
            self.device,
            self.model,
            self.optimizer,
            self.scaler,
            self.tokenizer,
            self.data_sha256,
            self.train_log,
        )
        self.guards = Guards(
            self.cfg,
            self.run_dir,
            self.dist,
            self.device,
            self.model,
            self.optimizer,
            self.checkpoints,
            self.train_log,
        )
        resumed = self.checkpoints.resume(reset_optimizer, reset_dataloader)
        if resumed is not None:
            self.state, self.resumed_from = resumed
        #: TensorBoard event files (rank 0); a resumed run purges the steps it redoes
        self.board = self.train_log.open_board(
            t.tensorboard, purge_step=self.state.step + 1 if resumed is not None else None
        )
        self.validator = Validator(
            self.cfg,
            self.model,
            self.valid_data,
            self.tokenizer,
            self.manifest,
            self.dist,
            self.device,
            self.checkpoints,
            self.train_log,
            self.hooks,
        )
        # the unit of batch_in_epoch: as saved (check_resume_compatible refuses a change of
        # train.global_batch_tokens) or, after --reset-dataloader, at the new epoch's start
        self.state.global_batches = self.plan.fixed

    # -- the loop ---------------------------------------------------------------------
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
        # A run the budget or the patience stopped stays stopped when started again (a
        # recipe rerun to rescore it): both are checked only after a step in the loop.
        if t.max_minutes > 0 and self.state.train_seconds >= 60 * t.max_minutes:
            log.warning(
                "already trained %.1f minutes >= max_minutes %g at step %d: nothing to do "
                "(raise train.max_minutes to train on)",
                self.state.train_seconds / 60,
                t.max_minutes,
                self.state.step,
            )
            result.stopped_by = "max_minutes"
            return result
        if t.patience and self.state.valid_without_improvement >= t.patience:
            log.warning(
                "already %d validations without improvement >= patience %d at step %d: "
                "nothing to do (raise train.patience to train on)",
                self.state.valid_without_improvement,
                t.patience,
                self.state.step,
            )
            result.stopped_by = "patience"
            return result
        if self.resumed_from is not None:  # readers keep the later pass of redone steps
            self.train_log.write(
                {"step": self.state.step, "event": "resumed", "checkpoint": str(self.resumed_from)}
            )
        announce(
            self.cfg,
            self.run_dir,
            self.device,
            self.dist,
            self.plan,
            self.model,
            self.train_data,
            self.state,
            self.train_log,
        )
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
                if "oom" in stats or "overflow" in stats:  # skipped, the guards told why
                    continue
                stats["tokens_per_s"] = (stats["src_tokens"] + stats["tgt_tokens"]) / dt
                if "skipped" in stats:  # non-finite: counted; too many in a row stop the run
                    self.guards.after_skipped_update(loop, self.state, self._last_batches[-1])
                    continue
                loop.consecutive_bad = 0
                step = self.state.step
                reason = self.guards.divergence(loop, self.state, stats["loss"])
                if reason is not None:
                    self._roll_back(loop, reason)
                    continue
                result.history.append({"step": step, **stats})
                per_step = loop.pace.seconds_per_step(
                    step - loop.start_step, self.state.train_seconds
                )
                if per_step is not None:
                    self.guards.check_pace(self.state, step, per_step)
                if self.hooks.on_step:
                    self.hooks.on_step(step, stats)
                self._log_interval(loop, step, stats)
                if self._end_of_step(loop, step, result):
                    break
        self.dist.barrier()  # no rank leaves while rank 0 still writes
        result.state = self.state  # a rollback replaces the state object
        return result

    def _update(self, stream: BatchStream) -> dict[str, float]:
        """One optimizer step (`step.train_step`, section 5) over `plan.accumulation` batches
        (train.update_freq, or as a global batch needs: epochs.batch_plan), with the guards'
        answers to what it reports: an out-of-memory batch skips the update, a non-finite
        loss is counted and skipped, an fp16 overflow lowers the scale."""
        self.train_log.flush_later(self.state.step)  # made before the loop
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
            return self.guards.skip_oom(self.state, e.__cause__ or e, batches, e.index)
        self.state.epoch, self.state.batch_in_epoch = batches[-1][0], batches[-1][1]
        if done.outcome == "nonfinite":
            self.state.nonfinite_skipped += 1
            return {**done.stats, "skipped": 1.0}
        if done.outcome == "overflow":
            self.state.overflow_skipped += 1
            self.guards.after_overflow(self.state, step, done.loss_scale, self.scaler.get_scale())
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

    def lr(self, step: int) -> float:
        """Eq. 3 times lr_scale, times the factor left by divergence rollbacks."""
        return step_lr(self.cfg, self.state, step)

    def _roll_back(self, loop: LoopState, reason: str) -> None:
        """C4: back to a checkpoint from before the divergence (`Checkpoints.rollback`), and
        on from there with a fresh batch stream."""
        onset = self.state.step - self.cfg.train.divergence_short
        self.state = self.checkpoints.rollback(self.state, onset, reason)
        self.step_hook.on_rollback()
        loop.stream.close()
        loop.stream, loop.recent_losses = self._batch_stream(), []

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
        self.train_log.write(
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
            impatient = self.validator.out_of_patience(self.state, final=step >= t.max_steps)
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
            self.validator.validate(self.state, final=True)  # the last, in the last checkpoint
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

    # -- the guards' and the checkpoints' entry points ----------------------------------
    def preflight(self) -> None:
        """C7: the epoch's largest batches forward and backward before training
        (`Guards.preflight`)."""
        self.guards.preflight(self.state, self._epoch_data(self.state.epoch), self._loss)

    def save(self) -> Path | None:
        """A checkpoint of the run now (`Checkpoints.save`)."""
        return self.checkpoints.save(self.state)

    # -- batches ----------------------------------------------------------------------
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

    # -- the run directory ------------------------------------------------------------
    def close(self) -> None:
        """Release the run directory (run() does this when it ends)."""
        train_log = getattr(self, "train_log", None)  # None when __init__ failed before it
        if train_log is not None:
            train_log.close()
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


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
