"""What keeps a long run safe (RELIABILITY.md group C and A5): non-finite updates skipped
and then diagnosed, out-of-memory batches skipped, a loss that diverges rolled back, the
largest batches tried before training, signals that save and stop, and a budget that the
run's pace will not meet said early.

`Guards` is one object the `Trainer` holds: the trainer's loop calls it where a guard
applies, with the counters (`TrainState`) it acts on.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn import checkpoints as ckpt_lib
from aiayn.config import Config
from aiayn.data.batching import Batch, EpochBatches, collate
from aiayn.data.corpus import Corpus
from aiayn.model import Transformer
from aiayn.training.distributed import DistContext
from aiayn.training.epochs import epoch_order
from aiayn.training.persistence import Checkpoints
from aiayn.training.precision import MIN_LOSS_SCALE
from aiayn.training.state import TrainingError, TrainState
from aiayn.training.validation import autocast
from aiayn.training.watch import TrainLog

log = logging.getLogger(__name__)

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
#: The pre-flight check tries no further batch once this many seconds are spent (the first
#: batch, the most padded tokens, always runs): on a CPU where each of its three large
#: batches took a minute (bf16 emulated) it would otherwise cost minutes of a short budget.
PREFLIGHT_SECONDS = 10.0


@dataclass
class Pace:
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
            and now_s - self.start_s >= PACE_EARLY_FRACTION * self.budget_s
        )
        if since is None or not due:
            return None
        self.checked = True
        return (now_s - self.marks[since]) / (done - since)


def largest_batches(
    src_lens: torch.Tensor, tgt_lens: torch.Tensor, order: EpochBatches
) -> list[int]:
    """C7: the positions in `order` of the batches likely to need the most memory.

    Which one that is depends on the model and the device, so three are taken, one per
    growing term of a training step's memory: the most padded tokens (position-wise
    activations), the largest B x (S^2 + T^2 + S*T) (attention weights) and the most
    padded target tokens (the logits, B x T x vocabulary). Lengths as `collate` pads them:
    source + EOS, target + BOS. Distinct positions, in that order.
    """
    # an empty batch (a null slice of a global batch) measures 0
    shapes = order.shapes(src_lens, tgt_lens).tolist()
    measures = (
        lambda b, S, T: b * (S + T),
        lambda b, S, T: b * (S * S + T * T + S * T),
        lambda b, S, T: b * T,
    )
    picked: list[int] = []
    for measure in measures:
        pos = max(range(len(shapes)), key=lambda i: (measure(*shapes[i]), -i), default=None)
        if pos is not None and pos not in picked:
            picked.append(pos)
    return picked


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)  # the CPU allocator raises a plain RuntimeError
    return isinstance(e, RuntimeError) and (
        "not enough memory" in text or "can't allocate memory" in text
    )


def has_nonfinite(out: Any) -> bool:
    if isinstance(out, Tensor):
        return out.is_floating_point() and not bool(torch.isfinite(out).all())
    if isinstance(out, (tuple, list)):
        return any(has_nonfinite(x) for x in out)
    return False


@torch.no_grad()
def find_nonfinite(
    model: nn.Module, batch: Batch, device: torch.device, dtype: str = "fp32"
) -> str:
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
            if not first and has_nonfinite(out):
                first.append(name)

        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        b = batch.to(device)
        with autocast(device, dtype):
            model(b.src, b.tgt_in)
    finally:
        for h in handles:
            h.remove()
    if first:
        return f"module {first[0]} (its output is the first non-finite value)"
    return "no module: the forward pass is finite, so the loss or the gradient overflowed"


class StopSignal:
    """SIGTERM/SIGINT: finish the current step, save, then stop (Marian --sigterm save-and-exit)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.received = signum
        log.warning(
            "received %s: finishing this step, saving, then stopping", signal.Signals(signum).name
        )

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@dataclass
class LoopState:
    """What the loop of `Trainer.run` carries from step to step."""

    stream: Any  # (epoch, position, batch) forever: Trainer._batch_stream
    stop: StopSignal
    pace: Pace
    start_step: int
    last_save: float = field(default_factory=time.monotonic)
    consecutive_bad: int = 0  # non-finite updates in a row
    recent_losses: list[float] = field(default_factory=list)  # for the divergence guard
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0])  # since the last log


class Guards:
    """The guards around each step: what to do with a skipped update, an fp16 overflow, an
    out-of-memory batch or a loss that diverges, the pre-flight check, the pace."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        dist: DistContext,
        device: torch.device,
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        checkpoints: Checkpoints,
        train_log: TrainLog,
    ) -> None:
        self.cfg, self.run_dir, self.dist, self.device = cfg, run_dir, dist, device
        self.model, self.optimizer = model, optimizer
        self.checkpoints, self.train_log = checkpoints, train_log
        #: (epoch, position) of the batches that ran out of memory: a second time stops
        self.oom_batches: set[tuple[int, int]] = set()

    def after_skipped_update(self, loop: LoopState, state: TrainState, last: Batch) -> None:
        """C1/C2: a non-finite update was skipped: log it; after
        MAX_CONSECUTIVE_NONFINITE in a row, stop with the evidence (`crash`; `last` is
        the step's last batch)."""
        loop.consecutive_bad += 1
        log.warning(
            "non-finite loss or gradient at step %d: update skipped (%d so far)",
            state.step + 1,
            state.nonfinite_skipped,
        )
        self.train_log.write(
            {"step": state.step + 1, "event": "nonfinite_skipped", "count": state.nonfinite_skipped}
        )
        if loop.consecutive_bad >= MAX_CONSECUTIVE_NONFINITE:
            raise self.crash(state, loop.consecutive_bad, last)

    def after_overflow(
        self, state: TrainState, step: int, loss_scale: float, new_scale: float
    ) -> None:
        """fp16: the loss scaler found inf/NaN gradients at `loss_scale` and skipped step
        `step` (Adam did not run), halving the scale to `new_scale`. That is how dynamic
        loss scaling finds its scale, not a divergence: logged, not counted among the
        non-finite updates (C1/C2), no rollback (C4). Overflows that drive the scale below
        MIN_LOSS_SCALE are gradients non-finite at any scale: stop."""
        log.info(
            "fp16 overflow at step %d (loss scale %g): update skipped, scale now %g (%d so far)",
            step,
            loss_scale,
            new_scale,
            state.overflow_skipped,
        )
        self.train_log.write(
            {
                "step": step,
                "event": "overflow_skipped",
                "loss_scale": loss_scale,
                "new_loss_scale": new_scale,
                "count": state.overflow_skipped,
            }
        )
        if new_scale < MIN_LOSS_SCALE:
            raise TrainingError(
                f"fp16 loss scale fell to {new_scale:g} (below {MIN_LOSS_SCALE:g}) at step "
                f"{step}: the gradients overflow at every scale, so the loss diverged "
                "(or a weight or batch holds inf/NaN); the checkpoints are untouched. "
                "Resume with a lower learning rate (train.lr_scale), or train in bf16 "
                "or fp32 (--dtype)"
            )

    def divergence(self, loop: LoopState, state: TrainState, loss: float) -> str | None:
        """C4: with train.divergence on, add the step's loss to the window; if the loss
        diverged, stop ("stop": TrainingError) or say why, for the trainer to roll back
        ("rollback"); None while it has not."""
        t = self.cfg.train
        if t.divergence == "off":
            return None
        keep = t.divergence_window + t.divergence_short
        loop.recent_losses = [*loop.recent_losses[-keep:], loss]
        if not self._diverged(loop.recent_losses):
            return None
        short = loop.recent_losses[-t.divergence_short :]
        reason = (
            f"loss diverged at step {state.step}: mean {sum(short) / len(short):.3f}"
            f" over the last {len(short)} steps"
        )
        if t.divergence == "stop":
            raise TrainingError(reason + " (train.divergence = 'stop')")
        return reason

    def preflight(
        self,
        state: TrainState,
        corpus: Corpus,
        loss_fn: Callable[[nn.Module, Batch], tuple[Tensor, Tensor]],
    ) -> None:
        """C7: forward and backward over this epoch's (`corpus`) largest batches before
        training, so that a batch too big for memory fails now, with advice, not hours
        into the run.

        Nothing of it stays: no update, the gradients dropped, the random state restored
        (each step reseeds anyway), and through the plain model, so no rank waits in a
        collective for it. On a GPU the caching allocator keeps the memory for step 1.
        Bounded: no batch after the first once `PREFLIGHT_SECONDS` are spent.
        """
        t = self.cfg.train
        epoch = state.epoch
        order = epoch_order(corpus, t, epoch, self.dist)
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        shapes: list[list[list[int]]] = []
        picked = largest_batches(corpus.src_lens, corpus.tgt_lens, order)
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            for pos in picked:
                if shapes and time.perf_counter() - t0 > PREFLIGHT_SECONDS:
                    break
                batch = collate(corpus, order[pos])
                what = (
                    f"batch {pos + 1} of epoch {epoch}: {batch.src.size(0)} sentences, "
                    f"source {tuple(batch.src.shape)}, target {tuple(batch.tgt_in.shape)}"
                )
                shapes.append([list(batch.src.shape), list(batch.tgt_in.shape)])
                try:
                    loss, _ = loss_fn(self.model, batch.to(self.device))
                    loss.backward()
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not is_oom(e):
                        raise
                    raise TrainingError(
                        f"out of memory on {self.device} before training, on the largest "
                        f"batches of the epoch ({what}): lower train.max_tokens (now "
                        f"{t.max_tokens}) or train.max_len (now {t.max_len})"
                    ) from e
                finally:
                    self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if cuda:
            peak, memory = torch.cuda.max_memory_allocated(self.device) / 2**30, "GPU memory"
        else:  # the process's peak so far; ru_maxrss is in KiB (bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak, memory = rss / (2**30 if sys.platform == "darwin" else 2**20), "RSS"
        skipped = len(picked) - len(shapes)
        log.info(
            "pre-flight: the epoch's %d largest batches fit (%.1f s; peak %s %.2f GiB)%s",
            len(shapes),
            seconds,
            memory,
            peak,
            f"; {skipped} more not tried (over its {PREFLIGHT_SECONDS:g} s)" if skipped else "",
        )
        self.train_log.write(
            {
                "step": state.step,
                "event": "preflight",
                "shapes": shapes,
                "not_tried": skipped,
                "seconds": seconds,
                "peak_gib": peak,
            }
        )

    def skip_oom(
        self,
        state: TrainState,
        e: BaseException,
        batches: list[tuple[int, int, Batch]],
        failed: int,
    ) -> dict[str, float]:
        """C6: skip an update whose batch ran out of memory (single process only).

        Under torchrun the other ranks are already inside this step's all-reduce, so one
        rank cannot skip alone (RELIABILITY D5): it stops, and torchrun ends the job.
        """
        epoch, pos, batch = batches[failed]
        what = (
            f"batch {pos} of epoch {epoch}: {batch.src.size(0)} sentences, source "
            f"{tuple(batch.src.shape)}, target {tuple(batch.tgt_in.shape)}, "
            f"{batch.src_tokens + batch.tgt_tokens} tokens"
        )
        if self.dist.active:
            raise TrainingError(
                f"rank {self.dist.rank}: out of memory at step "
                f"{state.step + 1} on {what}; a rank cannot skip a step "
                f"alone, so the job stops ({e})"
            ) from e
        if (epoch, pos) in self.oom_batches:
            raise TrainingError(
                f"out of memory twice on the same {what}: lower train.max_tokens"
            ) from e
        self.oom_batches.add((epoch, pos))
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        last_epoch, last_pos, _ = batches[-1]
        state.epoch, state.batch_in_epoch = last_epoch, last_pos
        state.oom_skipped += 1
        log.warning(
            "out of memory at step %d on %s: update skipped (%d so far)",
            state.step + 1,
            what,
            state.oom_skipped,
        )
        self.train_log.write(
            {
                "step": state.step + 1,
                "event": "oom_skipped",
                "epoch": epoch,
                "batch": pos,
                "src_shape": list(batch.src.shape),
                "tgt_shape": list(batch.tgt_in.shape),
                "tokens": batch.src_tokens + batch.tgt_tokens,
            }
        )
        return {"oom": 1.0}

    def crash(self, state: TrainState, consecutive: int, last: Batch) -> TrainingError:
        """C2: after repeated non-finite updates, keep the evidence and name the culprit.

        The model is the last good one (skipped updates leave it untouched); it goes to
        crash-<step>.pt, never over a checkpoint, with the name of the first module whose
        output is non-finite on the last batch.
        """
        t, step = self.cfg.train, state.step + 1
        culprit = "not checked on this rank"
        path = self.run_dir / f"crash-{step}.pt"
        where = f"is in {path}"
        if self.dist.is_main:
            culprit = find_nonfinite(self.model, last, self.device, t.dtype)
            try:
                ckpt_lib.save_checkpoint_file(
                    path,
                    {
                        **self.checkpoints.checkpoint_dict(state),
                        "crash": {
                            "step": step,
                            "consecutive_nonfinite": consecutive,
                            "first_nonfinite": culprit,
                            "batch_src_shape": list(last.src.shape),
                        },
                    },
                )
            except ckpt_lib.CheckpointError as e:
                log.error("could not write %s: %s", path, e)
                where = f"could not be saved ({path.name} was not written: {e})"
            self.train_log.write({"step": step, "event": "crash", "first_nonfinite": culprit})
        self.dist.barrier()
        return TrainingError(
            f"{consecutive} consecutive non-finite updates at step {step}: "
            f"stopping. First non-finite: {culprit}. The model of step "
            f"{state.step} {where}; checkpoints are untouched."
        )

    def _diverged(self, losses: list[float]) -> bool:
        """Short-window mean above the long window's mean by divergence_sigma std devs."""
        t = self.cfg.train
        if len(losses) < t.divergence_window + t.divergence_short:
            return False
        long = torch.tensor(
            losses[-t.divergence_window - t.divergence_short : -t.divergence_short],
            dtype=torch.float64,
        )
        short = sum(losses[-t.divergence_short :]) / t.divergence_short
        return short > float(long.mean()) + t.divergence_sigma * float(long.std())

    def check_pace(self, state: TrainState, step: int, seconds_per_step: float) -> None:
        """Warn early, not at the end, when max_minutes will stop the run before max_steps
        (e.g. a recipe sized on one CPU run on a slower one): the user can stop and change
        the config while little time is spent."""
        t = self.cfg.train
        budget = 60 * t.max_minutes
        need = state.train_seconds + seconds_per_step * (t.max_steps - step)
        if need <= budget:
            return
        last = step + max(0, int((budget - state.train_seconds) / seconds_per_step))
        log.warning(
            "at %.3f s a step, max_steps %d needs ~%.0f minutes of training: "
            "max_minutes %g will stop this run near step %d",
            seconds_per_step,
            t.max_steps,
            need / 60,
            t.max_minutes,
            last,
        )
        self.train_log.write(
            {
                "step": step,
                "event": "budget_ends_first",
                "seconds_per_step": seconds_per_step,
                "projected_minutes": need / 60,
                "projected_last_step": last,
            }
        )
