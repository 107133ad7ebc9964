"""Training (section 5): Adam with the warmup schedule (Eq. 3) and the loop (the label-
smoothed loss is in `aiayn.loss`).

The loop is deterministic: batches come from (seed, epoch) alone and dropout is reseeded
from (seed, step, rank) before every update, so a run resumed from a checkpoint repeats
an uninterrupted one exactly (fairseq does the same).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn import ONEDNN_PRIMITIVE_CACHE_CAPACITY
from aiayn import checkpoint as ckpt_lib
from aiayn.batching import Batch, Prefetch, collate, token_batches
from aiayn.config import Config, TrainConfig
from aiayn.data import BPEDropout, Corpus, load_corpus, load_manifest
from aiayn.distributed import DistContext, init_from_env, shutdown
from aiayn.faults import Faults
from aiayn.files import sha256_file, write_text_atomic
from aiayn.flops import slow_bf16_warning, training_flops
from aiayn.loss import generator_loss, rdrop_loss
from aiayn.model import Transformer, count_parameters
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)
#: (epoch, position in the epoch, batch), forever: a generator, or `Prefetch` on one on GPUs
BatchStream = (Generator[tuple[int, int, Batch], None, None]
               | Prefetch[tuple[int, int, Batch]])

#: Settings that may change when a run is resumed; anything else must match the checkpoint.
RESUMABLE_CHANGES = {"max_steps", "max_minutes", "save_interval_steps", "save_interval_minutes",
                     "patience", "divergence", "divergence_window", "divergence_short",
                     "divergence_sigma", "divergence_lr_factor", "max_rollbacks",
                     "keep_last", "valid_interval_steps", "log_interval_steps", "compile",
                     "pack_padding", "cpu_kernels", "preflight"}
OPTIMIZER_KEYS = {"warmup_steps", "lr_scale", "beta1", "beta2", "adam_eps", "clip_norm", "eps_ls",
                  "dtype"}
DATALOADER_KEYS = {"max_tokens", "update_freq", "seed", "max_len", "max_len_ratio",
                   "bpe_dropout", "word_dropout"}
MAX_CONSECUTIVE_NONFINITE = 5
#: With max_minutes set, the pace of steps PACE_FROM_STEP..PACE_AT_STEP after the start (or
#: resume) projects whether max_steps fits the budget. The first steps are skipped: on
#: the CPU they also compile oneDNN kernels for new batch shapes and run slower.
PACE_FROM_STEP, PACE_AT_STEP = 200, 600
#: A run too slow to reach PACE_AT_STEP early (bf16 on a CPU that emulates it: ~6 s a
#: step, so step 600 came with the end of a 60-minute budget) is projected instead once
#: PACE_EARLY_FRACTION of max_minutes is spent, from the pace after PACE_EARLY_STEP (or
#: after PACE_FROM_STEP, if passed).
PACE_EARLY_STEP, PACE_EARLY_FRACTION = 10, 0.1


@dataclass
class _Pace:
    """When to project a run's pace against max_minutes, once; see PACE_* above."""

    budget_s: float
    start_s: float  # train_seconds when this process started training
    marks: dict[int, float] = field(default_factory=dict)  # steps done -> train_seconds
    checked: bool = False

    def seconds_per_step(self, done: int, now_s: float) -> float | None:
        """The pace to check after `done` steps of this process, or None (not yet/done)."""
        if self.checked or self.budget_s <= 0:
            return None
        if done in (PACE_EARLY_STEP, PACE_FROM_STEP):
            self.marks[done] = now_s
        since = max((d for d in self.marks if d < done), default=None)
        due = done == PACE_AT_STEP or (
            done >= 2 * PACE_EARLY_STEP
            and now_s - self.start_s >= PACE_EARLY_FRACTION * self.budget_s)
        if since is None or not due:
            return None
        self.checked = True
        return (now_s - self.marks[since]) / (done - since)


class TrainingError(RuntimeError):
    """Training cannot start or continue; the message says why and what to do."""


# --------------------------------------------------------------------------- 5.3
def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), steps from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Adam:
    """Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9 (section 5.3); lr is set every step.

    PyTorch's fused implementation (one kernel over all parameters, on CPU and CUDA) does
    the same arithmetic as the per-parameter loop, several times faster on small models.
    """
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.adam_eps, fused=True)


# --------------------------------------------------------------------------- the loop
@dataclass
class TrainState:
    """Counters saved in every checkpoint: where the run is, in steps, epochs and data."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this epoch already consumed
    nonfinite_skipped: int = 0
    oom_skipped: int = 0
    rollbacks: int = 0
    lr_factor: float = 1.0  # halved (divergence_lr_factor) by each divergence rollback
    best_valid_nll: float = math.inf
    valid_without_improvement: int = 0  # early-stopping patience counter
    world_size: int = 1  # batch_in_epoch counts this many ranks' batches at a time
    train_seconds: float = 0.0
    tokens_seen: int = 0
    flops: float = 0.0  # counted from the model's shapes (aiayn.flops), padding included

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Hooks:
    """Callbacks for the CLI (progress bars); the library itself only logs."""

    on_step: Callable[[int, dict[str, float]], None] | None = None
    on_valid: Callable[[int, dict[str, float]], None] | None = None
    #: (step, epoch, batch position, example ids) of every batch an update draws
    on_batch: Callable[[int, int, int, Tensor], None] | None = None


@dataclass
class TrainResult:
    state: TrainState
    run_dir: Path
    last_checkpoint: Path | None
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_by: str = "max_steps"


def _config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)}


def check_resume_compatible(saved: dict[str, Any], cfg: Config, *, reset_optimizer: bool,
                            reset_dataloader: bool) -> None:
    """Refuse to resume with different settings, listing the differing keys (fairseq-style).

    A key the checkpoint's config lacks (it was written before the key existed) counts as
    that key's default, the behaviour it was trained with.
    """
    defaults, new = Config().to_dict(), cfg.to_dict()
    old = {section: {**defaults[section], **saved["config"][section]}
           for section in ("model", "train")}
    model_diff = _config_diff(old["model"], new["model"])
    if model_diff:
        raise TrainingError("cannot resume: the model differs from the checkpoint's: " +
                            ", ".join(f"model.{k}: {a} -> {b}" for k, (a, b) in model_diff.items())
                            + " (start a new run directory instead)")
    train_diff = _config_diff(old["train"], new["train"])
    blocked = {k: v for k, v in train_diff.items() if k not in RESUMABLE_CHANGES
               and not (k in OPTIMIZER_KEYS and reset_optimizer)
               and not (k in DATALOADER_KEYS and reset_dataloader)}
    if blocked:
        raise TrainingError(
            "cannot resume: settings differ from the checkpoint's: " +
            ", ".join(f"train.{k}: {a} -> {b}" for k, (a, b) in blocked.items()) +
            " (pass --reset-optimizer for optimizer/schedule keys, --reset-dataloader for "
            "batching/data keys)")


def _seed_step(seed: int, step: int, rank: int = 0, world_size: int = 1) -> None:
    # Dropout masks depend only on (seed, step, rank): resumed runs repeat exactly.
    torch.manual_seed(seed * 1_000_003 + step * world_size + rank)


def _epoch_order(corpus: Corpus, cfg: TrainConfig, epoch: int,
                 dist_ctx: DistContext) -> list[list[int]]:
    return token_batches(corpus.src_lens, corpus.tgt_lens, cfg.max_tokens, seed=cfg.seed,
                         epoch=epoch, rank=dist_ctx.rank, world_size=dist_ctx.world_size)


def _batches_from(corpus: Corpus, cfg: TrainConfig, epoch: int, start: int,
                  dist_ctx: DistContext) -> Iterator[tuple[int, Batch]]:
    order = _epoch_order(corpus, cfg, epoch, dist_ctx)
    for i in range(start, len(order)):
        yield i, collate(corpus, order[i])


def largest_batches(src_lens: torch.Tensor, tgt_lens: torch.Tensor,
                    order: list[list[int]]) -> list[int]:
    """C7: the positions in `order` of the batches likely to need the most memory.

    Which one that is depends on the model and the device, so three are taken, one per
    growing term of a training step's memory: the most padded tokens (position-wise
    activations), the largest B x (S^2 + T^2 + S*T) (attention weights) and the most
    padded target tokens (the logits, B x T x vocabulary). Lengths as `collate` pads them:
    source + EOS, target + BOS. Distinct positions, in that order.
    """
    s = (src_lens + 1).tolist()
    t = (tgt_lens + 1).tolist()
    shapes = [(len(b), max(s[i] for i in b), max(t[i] for i in b)) for b in order]
    measures = (lambda b, S, T: b * (S + T), lambda b, S, T: b * (S * S + T * T + S * T),
                lambda b, S, T: b * T)
    picked: list[int] = []
    for measure in measures:
        pos = max(range(len(shapes)), key=lambda i: (measure(*shapes[i]), -i), default=None)
        if pos is not None and pos not in picked:
            picked.append(pos)
    return picked


@torch.no_grad()
def validate(model: Transformer, corpus: Corpus, max_tokens: int, device: torch.device,
             dtype: str = "fp32", cpu_kernels: bool = True) -> dict[str, float]:
    """Validation NLL per target token and perplexity (unsmoothed, as the paper reports).
    `cpu_kernels`: see `loss.generator_loss`."""
    was_training = model.training
    model.eval()
    nll_sum, n_tok = 0.0, 0
    for idx in token_batches(corpus.src_lens, corpus.tgt_lens, max_tokens, seed=0, epoch=0,
                             shuffle=False):
        b = collate(corpus, idx).to(device)
        with _autocast(device, dtype):
            features = model(b.src, b.tgt_in, features_only=True)
            _, nll = generator_loss(features, model.generator.weight, b.tgt_out, 0.0,
                                    cpu_kernels=cpu_kernels)
        nll_sum += float(nll)
        n_tok += b.tgt_tokens
    model.train(was_training)
    mean_nll = nll_sum / max(n_tok, 1)
    return {"valid_nll": mean_nll, "valid_ppl": math.exp(min(mean_nll, 50.0))}


def _autocast(device: torch.device, dtype: str) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)  # the CPU allocator raises a plain RuntimeError
    return isinstance(e, RuntimeError) and ("not enough memory" in text
                                            or "can't allocate memory" in text)


def _has_nonfinite(out: Any) -> bool:
    if isinstance(out, Tensor):
        return out.is_floating_point() and not bool(torch.isfinite(out).all())
    if isinstance(out, (tuple, list)):
        return any(_has_nonfinite(x) for x in out)
    return False


@torch.no_grad()
def find_nonfinite(model: nn.Module, batch: Batch, device: torch.device,
                   dtype: str = "fp32") -> str:
    """Name where a forward pass first turns non-finite (fairseq's NanDetector).

    Parameters are checked first; then one forward pass over `batch` with a hook on every
    module: hooks run as modules finish, so the first module reported is the innermost
    one whose output is non-finite.
    """
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return f"parameter {name}"
    first: list[str] = []

    def hook(name: str) -> Callable[..., None]:
        def check(_m: nn.Module, _inp: Any, out: Any) -> None:
            if not first and _has_nonfinite(out):
                first.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        b = batch.to(device)
        with _autocast(device, dtype):
            model(b.src, b.tgt_in)
    finally:
        for h in handles:
            h.remove()
    if first:
        return f"module {first[0]} (its output is the first non-finite value)"
    return "no module: the forward pass is finite, so the loss or the gradient overflowed"


class _StopSignal:
    """SIGTERM/SIGINT: finish the current step, save, then stop (Marian --sigterm save-and-exit)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.received = signum
        log.warning("received %s: finishing this step, saving, then stopping",
                    signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class Trainer:
    """One training run in one directory: builds or resumes everything, then `run()`s."""

    def __init__(self, cfg: Config, data_dir: str | Path, run_dir: str | Path, *,
                 device: str = "cpu", reset_optimizer: bool = False,
                 reset_dataloader: bool = False, hooks: Hooks | None = None) -> None:
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        self.dist, device = init_from_env(device)
        self.device = torch.device(device)
        self.hooks = hooks or Hooks()
        self.manifest = load_manifest(self.data_dir)
        self.tokenizer = Tokenizer.load(self.data_dir / "spm.model")
        from dataclasses import replace

        self.cfg = replace(cfg, model=replace(cfg.model, vocab_size=self.tokenizer.vocab_size))
        self.cfg.validate()
        self.train_data = load_corpus(self.data_dir, "train")
        t = self.cfg.train
        self._bpe_dropout = (BPEDropout(self.train_data, self.tokenizer, t.bpe_dropout, t.max_len)
                             if t.bpe_dropout > 0 else None)
        self._both_directions: Corpus | None = None
        valid_path = self.data_dir / "valid.pt"
        self.valid_data = load_corpus(self.data_dir, "valid") if valid_path.exists() else None
        self.data_sha256 = sha256_file(self.data_dir / "train.pt")
        # Rank 0 owns the directory: it takes the lock before touching anything in it
        # (resuming removes stale temp files, which must never be another trainer's).
        self._lock: ckpt_lib.RunLock | None = None
        if self.dist.is_main:
            ckpt_lib.check_run_dir(self.run_dir)
            self._lock = ckpt_lib.RunLock(self.run_dir).__enter__()
        self.dist.barrier()
        torch.manual_seed(self.cfg.train.seed)  # the same initial weights for a given seed
        self.model = Transformer(self.cfg.model).to(self.device)
        self.model.pack_padding = None if self.cfg.train.pack_padding else False
        self.model.use_cpu_kernels(self.cfg.train.cpu_kernels)
        if self.cfg.train.compile:
            # in place: parameters and state_dict keys stay those of the plain model
            self.model.compile(dynamic=True)
        # Under torchrun the forward pass goes through DDP, which averages the gradients;
        # checkpoints hold the plain model, so they do not depend on the world size.
        self.net: nn.Module = self.model
        if self.dist.active:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = make_optimizer(self.model, self.cfg.train)
        self.state = TrainState(world_size=self.dist.world_size)
        self.resumed_from: Path | None = None
        self.faults = Faults.from_env(self.dist.rank)
        self.faults.install(self.model)
        #: build batches ahead on a thread (`_batch_stream`): on GPUs; on the CPU the
        #: thread would compete with the step's own threads for the cores
        self.prefetch = self.device.type == "cuda"
        self._oom_batches: set[tuple[int, int]] = set()
        self._last_batches: list[Batch] = []
        self._resume(reset_optimizer, reset_dataloader)

    def close(self) -> None:
        """Release the run directory (run() does this when it ends)."""
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _resume(self, reset_optimizer: bool, reset_dataloader: bool) -> None:
        found = ckpt_lib.latest_valid_checkpoint(self.run_dir, clean=self.dist.is_main)
        if found is None:
            return
        path, saved = found
        check_resume_compatible(saved, self.cfg, reset_optimizer=reset_optimizer,
                                reset_dataloader=reset_dataloader)
        if saved.get("vocab_sha256") != self.tokenizer.sha256:
            raise TrainingError(f"cannot resume from {path}: its vocabulary differs from "
                                f"{self.data_dir / 'spm.model'}")
        if saved.get("data_sha256") != self.data_sha256 and not reset_dataloader:
            raise TrainingError(f"cannot resume from {path}: the training data "
                                f"{self.data_dir / 'train.pt'} changed since it was written "
                                "(pass --reset-dataloader to start a new epoch on the new data)")
        self.model.load_state_dict(saved["model"])
        if not reset_optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["train_state"])
        if reset_dataloader:
            self.state.epoch, self.state.batch_in_epoch = self.state.epoch + 1, 0
        self._reshard()
        self.resumed_from = path
        log.info("resumed from %s: step %d, epoch %d, batch %d of the epoch, lr %.3g, best "
                 "valid nll %.4f, %d validations without improvement, %d non-finite and %d "
                 "out-of-memory updates skipped", path, self.state.step, self.state.epoch,
                 self.state.batch_in_epoch, self.lr(self.state.step + 1),
                 self.state.best_valid_nll, self.state.valid_without_improvement,
                 self.state.nonfinite_skipped, self.state.oom_skipped)

    def _reshard(self) -> None:
        """Carry the data position over to another number of ranks (checkpoints do not
        depend on the world size). Rank r takes batches r, r+W, ... of the epoch, so a
        position of c batches per rank on W ranks is c*W batches of the epoch; on W' ranks
        resume at floor(c*W / W'): up to W'-1 batches are seen again, none is skipped."""
        old, new = self.state.world_size, self.dist.world_size
        if old == new:
            return
        consumed = self.state.batch_in_epoch * old
        self.state.batch_in_epoch = consumed // new
        log.warning("resuming a %d-rank run on %d ranks: epoch %d continues after %d of its "
                    "batches (%d seen again)", old, new, self.state.epoch, consumed,
                    consumed - self.state.batch_in_epoch * new)
        self.state.world_size = new

    def lr(self, step: int) -> float:
        """Eq. 3 times lr_scale, times the factor left by divergence rollbacks."""
        t = self.cfg.train
        return self.state.lr_factor * learning_rate(step, self.cfg.model.d_model,
                                                    t.warmup_steps, t.lr_scale)

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
            for i, batch in _batches_from(self._epoch_data(epoch), self.cfg.train, epoch,
                                          start, self.dist):
                yield epoch, i + 1, batch
            epoch, start = epoch + 1, 0

    def _epoch_data(self, epoch: int) -> Corpus:
        """The training pairs of `epoch`: the prepared ones, or a BPE-dropout draw that
        depends on (seed, epoch) only, so that a resumed run sees the same epochs; in
        both directions for the first `train.bidirectional_epochs` epochs."""
        t = self.cfg.train
        corpus = (self.train_data if self._bpe_dropout is None
                  else self._bpe_dropout.epoch(t.seed * 1_000_003 + epoch))
        if epoch >= t.bidirectional_epochs:
            return corpus
        if self._bpe_dropout is not None:  # a new draw each epoch
            return corpus.both_directions()
        if self._both_directions is None:  # the prepared pairs: built once
            self._both_directions = corpus.both_directions()
        return self._both_directions

    def checkpoint_dict(self) -> dict[str, Any]:
        tok = self.tokenizer.to_bytes()
        return {
            "format": "aiayn-checkpoint-1", "config": self.cfg.to_dict(),
            "vocab_sha256": self.tokenizer.sha256,
            "tokenizer": torch.frombuffer(bytearray(tok), dtype=torch.uint8),
            "data_sha256": self.data_sha256, "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(), "step": self.state.step,
            "epoch": self.state.epoch, "train_state": self.state.to_dict(),
            "rng": {"torch": torch.get_rng_state()},
        }

    def save(self) -> Path | None:
        """Rank 0 writes; every rank first checks that all hold the same weights (a rank
        that fell out of step must never go unnoticed) and waits for the write to end."""
        if self.dist.active and not self.dist.same_on_all(self._checksum(), self.device):
            raise TrainingError(f"ranks hold different weights at step {self.state.step}: "
                                "a rank fell out of step; stopping without saving")
        path = None
        if self.dist.is_main:
            path = ckpt_lib.save_checkpoint(self.run_dir, self.checkpoint_dict(),
                                            self.cfg.train.keep_last)
        self.dist.barrier()
        return path

    def _checksum(self) -> float:
        return float(sum(p.detach().double().abs().sum() + p.detach().double().sum()
                         for p in self.model.parameters()))

    def rollback(self, onset_step: int, reason: str) -> Path:
        """Reload the newest valid checkpoint from before `onset_step` (the divergence
        guard); the counters of what went wrong are kept, the learning rate lowered."""
        t = self.cfg.train
        if self.state.rollbacks >= t.max_rollbacks:
            raise TrainingError(f"{reason}; already rolled back {self.state.rollbacks} times "
                                f"(train.max_rollbacks): stopping")
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
            raise TrainingError(f"{reason}; no valid checkpoint from step {onset_step} or "
                                "before to roll back to: stopping")
        keep = self.state
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["train_state"])
        self._reshard()  # the checkpoint may come from a run on another number of ranks
        for name in ("nonfinite_skipped", "oom_skipped", "train_seconds"):
            setattr(self.state, name, getattr(keep, name))
        self.state.rollbacks = keep.rollbacks + 1
        self.state.lr_factor = keep.lr_factor * t.divergence_lr_factor
        self.faults.disarm_lr()
        log.warning("%s: rolled back to %s (step %d); learning rate now x%g (rollback %d of "
                    "at most %d)", reason, path, self.state.step, self.state.lr_factor,
                    self.state.rollbacks, t.max_rollbacks)
        self._log({"step": self.state.step, "event": "rollback", "reason": reason,
                   "checkpoint": str(path), "lr_factor": self.state.lr_factor})
        return path

    def _update(self, stream: BatchStream) -> dict[str, float]:
        """One optimizer step over `update_freq` batches; a non-finite one is skipped."""
        t = self.cfg.train
        step = self.state.step + 1
        self.faults.begin_attempt(step)
        _seed_step(t.seed, step, self.dist.rank, self.dist.world_size)
        loss_sum, nll_sum, flops = 0.0, 0.0, 0.0
        src_tok: float = 0  # summed over ranks as a float
        batches = [next(stream) for _ in range(t.update_freq)]
        self._last_batches = [b for _, _, b in batches]
        if self.hooks.on_batch:
            for epoch, pos, b in batches:
                self.hooks.on_batch(step, epoch, pos, b.ids)
        # The loss is a mean over the update's target tokens (on all ranks): scaling each
        # batch's sum by the total before backward saves a pass over the gradients. DDP
        # averages over ranks, hence the factor world_size.
        (tgt_tok,) = self.dist.all_sum([sum(b.tgt_tokens for _, _, b in batches)], self.device)
        scale = self.dist.world_size / max(tgt_tok, 1)
        for i, (epoch, pos, batch) in enumerate(batches):
            batch = batch.to(self.device, non_blocking=self.device.type == "cuda")
            if t.word_dropout > 0:
                batch = batch.drop_words(t.word_dropout)
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or not self.dist.active else \
                self.net.no_sync()  # type: ignore[operator]
            try:
                with sync:
                    self.faults.oom()
                    loss, nll = self._loss(self.net, batch)
                    loss = self.faults.nan_loss(loss)
                    (loss * scale).backward()
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not _is_oom(e):
                    raise
                loss = nll = None  # type: ignore[assignment]  # free what they held
                return self._skip_oom(e, batches, i)
            loss_sum += float(loss.detach())
            nll_sum += float(nll)  # type: ignore[arg-type]  # None only on the OOM path
            src_tok += batch.src_tokens
            flops += training_flops(  # the model's work: the real tokens (model.Packing)
                self.cfg.model, batch.src.size(0), batch.src.size(1), batch.tgt_in.size(1),
                src_tokens=batch.src_tokens, tgt_tokens=batch.tgt_tokens,
            ) * (2 if t.rdrop_alpha > 0 else 1)
            self.state.epoch, self.state.batch_in_epoch = epoch, pos
        if self.dist.active:  # every rank reports, and decides on, the same totals
            loss_sum, nll_sum, src_tok, flops = self.dist.all_sum(
                [loss_sum, nll_sum, src_tok, flops], self.device)
        tgt_tok, src_tok = int(tgt_tok), int(src_tok)
        gnorm = float(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), t.clip_norm if t.clip_norm > 0 else math.inf))
        stats = {"loss": loss_sum / max(tgt_tok, 1), "nll": nll_sum / max(tgt_tok, 1),
                 "lr": self.lr(step), "gnorm": gnorm, "src_tokens": src_tok,
                 "tgt_tokens": tgt_tok}
        if not (math.isfinite(loss_sum) and math.isfinite(gnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.state.nonfinite_skipped += 1
            stats["skipped"] = 1.0
            return stats
        for group in self.optimizer.param_groups:
            group["lr"] = stats["lr"] * self.faults.lr_factor(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.faults.after_update(step, self.model)
        self.state.step = step
        self.state.tokens_seen += src_tok + tgt_tok
        self.state.flops += flops
        return stats

    def _loss(self, net: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        """The batch's summed training loss and NLL, through `net` (DDP or the model)."""
        t = self.cfg.train
        with _autocast(self.device, t.dtype):
            if t.rdrop_alpha > 0:  # both passes in one batch: two masks
                features = net(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1),
                               features_only=True)
                return rdrop_loss(features, self.model.generator.weight,
                                  batch.tgt_out.repeat(2, 1), t.eps_ls, t.rdrop_alpha)
            features = net(batch.src, batch.tgt_in, features_only=True)
            return generator_loss(features, self.model.generator.weight, batch.tgt_out,
                                  t.eps_ls, cpu_kernels=t.cpu_kernels)

    def preflight(self) -> None:
        """C7: forward and backward over this epoch's largest batches before training, so
        that a batch too big for memory fails now, with advice, not hours into the run.

        Nothing of it stays: no update, the gradients dropped, the random state restored
        (each step reseeds anyway), and through the plain model, so no rank waits in a
        collective for it. On a GPU the caching allocator keeps the memory for step 1.
        """
        t = self.cfg.train
        epoch = self.state.epoch
        corpus = self._epoch_data(epoch)
        order = _epoch_order(corpus, t, epoch, self.dist)
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        shapes = []
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            for pos in largest_batches(corpus.src_lens, corpus.tgt_lens, order):
                batch = collate(corpus, order[pos])
                what = (f"batch {pos + 1} of epoch {epoch}: {batch.src.size(0)} sentences, "
                        f"source {tuple(batch.src.shape)}, target {tuple(batch.tgt_in.shape)}")
                shapes.append([list(batch.src.shape), list(batch.tgt_in.shape)])
                try:
                    loss, _ = self._loss(self.model, batch.to(self.device))
                    loss.backward()
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not _is_oom(e):
                        raise
                    raise TrainingError(
                        f"out of memory on {self.device} before training, on the largest "
                        f"batches of the epoch ({what}): lower train.max_tokens (now "
                        f"{t.max_tokens}) or train.max_len (now {t.max_len})") from e
                finally:
                    self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if cuda:
            peak, memory = torch.cuda.max_memory_allocated(self.device) / 2**30, "GPU memory"
        else:  # the process's peak so far; ru_maxrss is in KiB (bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, memory = rss / (2**30 if sys.platform == "darwin" else 2**20), "RSS"
        log.info("pre-flight: the epoch's %d largest batches fit (%.1f s; peak %s %.2f GiB)",
                 len(shapes), seconds, memory, peak)
        self._log({"step": self.state.step, "event": "preflight", "shapes": shapes,
                   "seconds": seconds, "peak_gib": peak})

    def _skip_oom(self, e: BaseException, batches: list[tuple[int, int, Batch]],
                  failed: int) -> dict[str, float]:
        """C6: skip an update whose batch ran out of memory (single process only).

        Under torchrun the other ranks are already inside this step's all-reduce, so one
        rank cannot skip alone (RELIABILITY D5): it stops, and torchrun ends the job.
        """
        epoch, pos, batch = batches[failed]
        what = (f"batch {pos} of epoch {epoch}: {batch.src.size(0)} sentences, source "
                f"{tuple(batch.src.shape)}, target {tuple(batch.tgt_in.shape)}, "
                f"{batch.src_tokens + batch.tgt_tokens} tokens")
        if self.dist.active:
            raise TrainingError(f"rank {self.dist.rank}: out of memory at step "
                                f"{self.state.step + 1} on {what}; a rank cannot skip a step "
                                f"alone, so the job stops ({e})") from e
        if (epoch, pos) in self._oom_batches:
            raise TrainingError(f"out of memory twice on the same {what}: lower "
                                "train.max_tokens") from e
        self._oom_batches.add((epoch, pos))
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        last_epoch, last_pos, _ = batches[-1]
        self.state.epoch, self.state.batch_in_epoch = last_epoch, last_pos
        self.state.oom_skipped += 1
        log.warning("out of memory at step %d on %s: update skipped (%d so far)",
                    self.state.step + 1, what, self.state.oom_skipped)
        self._log({"step": self.state.step + 1, "event": "oom_skipped", "epoch": epoch,
                   "batch": pos, "src_shape": list(batch.src.shape),
                   "tgt_shape": list(batch.tgt_in.shape),
                   "tokens": batch.src_tokens + batch.tgt_tokens})
        return {"oom": 1.0}

    def _crash(self, consecutive: int) -> TrainingError:
        """C2: after repeated non-finite updates, keep the evidence and name the culprit.

        The model is the last good one (skipped updates leave it untouched); it goes to
        crash-<step>.pt, never over a checkpoint, with the name of the first module whose
        output is non-finite on the last batch.
        """
        t, step = self.cfg.train, self.state.step + 1
        culprit = "not checked on this rank"
        path = self.run_dir / f"crash-{step}.pt"
        if self.dist.is_main:
            culprit = find_nonfinite(self.model, self._last_batches[-1], self.device, t.dtype)
            try:
                ckpt_lib.save_checkpoint_file(path, {
                    **self.checkpoint_dict(),
                    "crash": {"step": step, "consecutive_nonfinite": consecutive,
                              "first_nonfinite": culprit,
                              "batch_src_shape": list(self._last_batches[-1].src.shape)}})
            except ckpt_lib.CheckpointError as e:
                log.error("could not write %s: %s", path, e)
            self._log({"step": step, "event": "crash", "first_nonfinite": culprit})
        self.dist.barrier()
        return TrainingError(f"{consecutive} consecutive non-finite updates at step {step}: "
                             f"stopping. First non-finite: {culprit}. The model of step "
                             f"{self.state.step} is in {path}; checkpoints are untouched.")

    def _diverged(self, losses: list[float]) -> bool:
        """Short-window mean above the long window's mean by divergence_sigma std devs."""
        t = self.cfg.train
        if len(losses) < t.divergence_window + t.divergence_short:
            return False
        long = torch.tensor(losses[-t.divergence_window - t.divergence_short:
                                   -t.divergence_short], dtype=torch.float64)
        short = sum(losses[-t.divergence_short:]) / t.divergence_short
        return short > float(long.mean()) + t.divergence_sigma * float(long.std())

    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        with open(self.run_dir / "train_log.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _check_pace(self, step: int, seconds_per_step: float) -> None:
        """Warn early, not at the end, when max_minutes will stop the run before max_steps
        (e.g. a recipe sized on one CPU run on a slower one): the user can stop and change
        the config while little time is spent."""
        t = self.cfg.train
        budget = 60 * t.max_minutes
        need = self.state.train_seconds + seconds_per_step * (t.max_steps - step)
        if need <= budget:
            return
        last = step + max(0, int((budget - self.state.train_seconds) / seconds_per_step))
        log.warning("at %.3f s a step, max_steps %d needs ~%.0f minutes of training: "
                    "max_minutes %g will stop this run near step %d", seconds_per_step,
                    t.max_steps, need / 60, t.max_minutes, last)
        self._log({"step": step, "event": "budget_ends_first",
                   "seconds_per_step": seconds_per_step, "projected_minutes": need / 60,
                   "projected_last_step": last})

    def _validate(self) -> dict[str, float]:
        if self.valid_data is None or not self.dist.is_main:
            return {}
        t = self.cfg.train
        metrics = validate(self.model, self.valid_data, t.max_tokens, self.device, t.dtype,
                           t.cpu_kernels)
        self.state.best_valid_nll = min(self.state.best_valid_nll, metrics["valid_nll"])
        self._log({"step": self.state.step, "time": self.state.train_seconds, **metrics})
        log.info("step %d: valid nll %.4f, ppl %.2f", self.state.step, metrics["valid_nll"],
                 metrics["valid_ppl"])
        if self.hooks.on_valid:
            self.hooks.on_valid(self.state.step, metrics)
        return metrics

    def _validate_and_check_patience(self) -> bool:
        """Validate; True when `patience` validations in a row brought no better NLL."""
        best = self.state.best_valid_nll
        metrics = self._validate()
        if not metrics:
            return False
        if metrics["valid_nll"] < best:
            self.state.valid_without_improvement = 0
        else:
            self.state.valid_without_improvement += 1
        patience = self.cfg.train.patience
        if patience and self.state.valid_without_improvement >= patience:
            log.warning("no better validation NLL in %d validations (patience %d): stopping",
                        self.state.valid_without_improvement, patience)
            return True
        return False

    def run(self) -> TrainResult:
        """Train until max_steps or max_minutes, saving and validating at intervals."""
        t = self.cfg.train
        result = TrainResult(self.state, self.run_dir, None)
        if self.state.step >= t.max_steps:
            log.warning("already at step %d >= max_steps %d: nothing to do", self.state.step,
                        t.max_steps)
            result.stopped_by = "already_done"
            return result
        if self.dist.is_main:
            write_text_atomic(self.run_dir / "config.json",
                              json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        log.info("model: %d parameters; %d training pairs; effective batch ~%d tokens per "
                 "side x %d accumulation x %d ranks = ~%d", count_parameters(self.model),
                 len(self.train_data), t.max_tokens, t.update_freq, self.dist.world_size,
                 t.max_tokens * t.update_freq * self.dist.world_size)
        if self.state.epoch < t.bidirectional_epochs:
            log.info("bidirectional training: epochs up to %d on every pair in both "
                     "directions (%d pairs), then source->target only",
                     t.bidirectional_epochs - 1, 2 * len(self.train_data))
        if t.dtype == "bf16" and self.dist.is_main:
            warning = slow_bf16_warning(self.device)
            if warning:
                log.warning(warning)
                self._log({"step": self.state.step, "event": "slow_bf16", "message": warning})
            if (t.bpe_dropout > 0 and self.device.type == "cpu" and os.environ.get(
                    "ONEDNN_PRIMITIVE_CACHE_CAPACITY") == str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)):
                log.warning("BPE-dropout brings new batch shapes every epoch, and aiayn's "
                            "large oneDNN kernel cache (%d) then keeps growing (memory, "
                            "slower steps): start with ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 "
                            "(docs/performance.md)", ONEDNN_PRIMITIVE_CACHE_CAPACITY)
        self.model.train()
        if t.preflight:
            self.preflight()
        stream = self._batch_stream()
        last_save = time.monotonic()
        consecutive_bad = 0
        recent_losses: list[float] = []  # for the divergence guard
        window = [0.0, 0.0, 0]  # loss and NLL sums, target tokens since the last log line
        start_step = self.state.step
        pace = _Pace(60 * t.max_minutes, self.state.train_seconds)
        with contextlib.closing(self), _StopSignal() as stop, contextlib.ExitStack() as done:
            done.callback(lambda: stream.close())  # the stream in use then (rollbacks)
            while self.state.step < t.max_steps:
                t0 = time.perf_counter()
                stats = self._update(stream)
                dt = time.perf_counter() - t0
                self.state.train_seconds += dt
                if "oom" in stats:
                    continue
                stats["tokens_per_s"] = (stats["src_tokens"] + stats["tgt_tokens"]) / dt
                if "skipped" in stats:
                    consecutive_bad += 1
                    log.warning("non-finite loss or gradient at step %d: update skipped "
                                "(%d so far)", self.state.step + 1, self.state.nonfinite_skipped)
                    self._log({"step": self.state.step + 1, "event": "nonfinite_skipped",
                               "count": self.state.nonfinite_skipped})
                    if consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
                        raise self._crash(consecutive_bad)
                    continue
                consecutive_bad = 0
                step = self.state.step
                if t.divergence != "off":
                    recent_losses = [*recent_losses[-t.divergence_window - t.divergence_short:],
                                     stats["loss"]]
                    if self._diverged(recent_losses):
                        short = recent_losses[-t.divergence_short:]
                        reason = (f"loss diverged at step {step}: mean "
                                  f"{sum(short) / len(short):.3f}"
                                  f" over the last {len(short)} steps")
                        if t.divergence == "stop":
                            raise TrainingError(reason + " (train.divergence = 'stop')")
                        self.rollback(step - t.divergence_short, reason)
                        stream.close()
                        stream, recent_losses = self._batch_stream(), []
                        continue
                result.history.append({"step": step, **stats})
                per_step = pace.seconds_per_step(step - start_step, self.state.train_seconds)
                if per_step is not None:
                    self._check_pace(step, per_step)
                if self.hooks.on_step:
                    self.hooks.on_step(step, stats)
                n = int(stats["tgt_tokens"])
                window = [window[0] + stats["loss"] * n, window[1] + stats["nll"] * n,
                          int(window[2]) + n]
                if step % t.log_interval_steps == 0:
                    # The logged loss and NLL are means over the interval's target tokens
                    # (one batch's value is too noisy to plot); the rest is this step's.
                    tokens = max(int(window[2]), 1)
                    self._log({"step": step, "time": self.state.train_seconds,
                               "epoch": self.state.epoch, **stats,
                               "loss": window[0] / tokens, "nll": window[1] / tokens})
                    window = [0.0, 0.0, 0]
                impatient = False
                if step % t.valid_interval_steps == 0:
                    impatient = self._validate_and_check_patience()
                out_of_time = t.max_minutes > 0 and self.state.train_seconds >= 60 * t.max_minutes
                due_by_time = (t.save_interval_minutes > 0
                               and time.monotonic() - last_save >= 60 * t.save_interval_minutes)
                # Decided together: each rank's clock and signals are its own.
                out_of_time, stopping, due_by_time, impatient = self.dist.any_each(
                    [out_of_time, stop.received is not None, due_by_time, impatient],
                    self.device)
                due = due_by_time or (t.save_interval_steps > 0
                                      and step % t.save_interval_steps == 0)
                finished = step >= t.max_steps or out_of_time or stopping or impatient
                if due or finished:
                    result.last_checkpoint = self.save()
                    last_save = time.monotonic()
                if out_of_time:
                    result.stopped_by = "max_minutes"
                    break
                if stopping:
                    result.stopped_by = signal.Signals(stop.received or signal.SIGTERM).name
                    break
                if impatient:
                    result.stopped_by = "patience"
                    break
        if result.stopped_by in ("max_steps", "max_minutes") and (
                self.state.step % t.valid_interval_steps):
            self._validate()
        self.dist.barrier()  # no rank leaves while rank 0 still writes
        result.state = self.state  # a rollback replaces the state object
        return result


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path, *, device: str = "cpu",
          reset_optimizer: bool = False, reset_dataloader: bool = False,
          hooks: Hooks | None = None) -> TrainResult:
    """Train (or resume) a model on a prepared data directory; see :class:`Trainer`."""
    trainer = Trainer(cfg, data_dir, run_dir, device=device, reset_optimizer=reset_optimizer,
                      reset_dataloader=reset_dataloader, hooks=hooks)
    try:
        return trainer.run()
    finally:
        trainer.close()
        if trainer.dist.active:
            shutdown()
