"""Section 5's training step, as a reader of the paper looks for it.

One update: the step's batches (several when gradients accumulate to a larger batch) through
the model, the label-smoothed loss of section 5.4 (`training.loss`, eps_ls), backward, the
gradient clipped where `train.clip_norm` is set, then Adam (section 5.3) at Eq. 3's rate.

Everything else a long run needs is around it, in `trainer.Trainer`: which batches, reseeding
dropout, the guards (a non-finite loss, out of memory, divergence, signals), checkpoints,
logs. What the step cannot decide alone it reports: an out-of-memory batch raises
`BatchOutOfMemoryError`, a non-finite loss or an fp16 overflow comes back as the outcome, and the
trainer's guards act on it. The parts it computes with are passed in (`StepParts`): under
torchrun the network is the DDP wrapper and the sums are over ranks; with fp16 the scaler
scales the loss (a no-op otherwise); the fault injector of the reliability tests sits at
four points (a no-op in a normal run).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.data.batching import Batch
from aiayn.training.distributed import DistContext
from aiayn.training.guards import is_oom
from aiayn.training.state import StepHook


@dataclass
class StepParts:
    """What a step computes with: the network (the model, or its DDP wrapper), the model
    (for clipping), the loss (summed label-smoothed loss and NLL of a batch), Adam, the fp16
    loss scaler, the ranks, the fault hook, the device, and from the config the clipping
    norm (<= 0: none), the word-dropout rate, and the FLOPs a batch costs."""

    net: nn.Module
    model: nn.Module
    loss: Callable[[nn.Module, Batch], tuple[Tensor, Tensor]]
    optimizer: torch.optim.Optimizer
    scaler: Any  # torch.amp.GradScaler, enabled for fp16 only
    dist: DistContext
    hook: StepHook
    device: torch.device
    clip_norm: float
    word_dropout: float
    flops: Callable[[Batch], float]


@dataclass
class StepOutcome:
    """What one step did: "updated", "nonfinite" (a non-finite loss or gradient: no update)
    or "overflow" (fp16's loss scale overflowed: no update, the scale lowered); its logged
    statistics, tokens and FLOPs; the loss scale it ran at (fp16)."""

    outcome: str
    stats: dict[str, float]
    src_tokens: int
    tgt_tokens: int
    flops: float
    loss_scale: float = 1.0


class BatchOutOfMemoryError(Exception):
    """Batch `index` of the step ran out of memory (the cause is the original error)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"batch {index} of the step ran out of memory")
        self.index = index


def train_step(parts: StepParts, batches: list[Batch], step: int, lr: float) -> StepOutcome:
    """One update of section 5 over `batches`, at learning rate `lr` (Eq. 3 at `step`)."""
    p = parts
    # The loss is the mean over the update's target tokens on all ranks: each batch's sum is
    # scaled by the total before backward (DDP averages over ranks, hence world_size).
    (tgt_tok,) = p.dist.all_sum([sum(b.tgt_tokens for b in batches)], p.device)
    scale = p.dist.world_size / max(tgt_tok, 1)
    loss_sum, nll_sum, src_tok, flops = 0.0, 0.0, 0.0, 0.0
    for i, batch in enumerate(batches):
        batch = batch.to(p.device, non_blocking=p.device.type == "cuda")
        if p.word_dropout > 0:
            batch = batch.drop_words(p.word_dropout)
        last = i == len(batches) - 1  # DDP all-reduces the gradients with the last backward
        sync = contextlib.nullcontext() if last or not p.dist.active else p.net.no_sync()  # type: ignore[operator]
        try:
            with sync:
                p.hook.before_forward()
                loss, nll = p.loss(p.net, batch)  # label-smoothed (eps_ls), summed
                loss = p.hook.on_loss(loss)
                p.scaler.scale(loss * scale).backward()  # fp16: times the loss scale
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            loss = nll = None  # type: ignore[assignment]  # free what they held
            raise BatchOutOfMemoryError(i) from e
        loss_sum += float(loss.detach())
        nll_sum += float(nll)  # type: ignore[arg-type]  # None only on the OOM path
        src_tok += batch.src_tokens
        flops += p.flops(batch)
    if p.dist.active:  # every rank reports, and decides on, the same totals
        loss_sum, nll_sum, src_tok, flops = p.dist.all_sum(
            [loss_sum, nll_sum, src_tok, flops], p.device
        )
    tgt, src = int(tgt_tok), int(src_tok)
    if math.isfinite(loss_sum):  # else no update below; the scaler is untouched
        p.scaler.unscale_(p.optimizer)  # fp16: clip and log the true gradient
    clip = p.clip_norm if p.clip_norm > 0 else math.inf
    gnorm = float(torch.nn.utils.clip_grad_norm_(p.model.parameters(), clip))
    stats = {
        "loss": loss_sum / max(tgt, 1),
        "nll": nll_sum / max(tgt, 1),
        "lr": lr,
        "gnorm": gnorm,
        "src_tokens": src,
        "tgt_tokens": tgt,
    }
    # fp16: inf/NaN gradients under a finite loss are the loss scale overflowing, the
    # scaler's to handle; a non-finite loss is the guards' in any dtype
    fp16 = p.scaler.is_enabled()
    if not (math.isfinite(loss_sum) and (fp16 or math.isfinite(gnorm))):
        p.optimizer.zero_grad(set_to_none=True)
        return StepOutcome("nonfinite", stats, src, tgt, flops)
    for group in p.optimizer.param_groups:
        group["lr"] = lr * p.hook.lr_factor(step)
    loss_scale = 1.0
    if fp16:
        loss_scale = p.scaler.get_scale()
        p.scaler.step(p.optimizer)  # Adam, unless the gradients overflowed
        p.scaler.update()  # halve the scale on an overflow, double after 2000 clean steps
        if p.scaler.get_scale() < loss_scale:  # the scale falls only on an overflow
            p.optimizer.zero_grad(set_to_none=True)
            return StepOutcome("overflow", stats, src, tgt, flops, loss_scale)
        stats["loss_scale"] = loss_scale
    else:
        p.optimizer.step()  # Adam (beta1 0.9, beta2 0.98, eps 1e-9)
    p.optimizer.zero_grad(set_to_none=True)
    p.hook.after_update(step, p.model)
    return StepOutcome("updated", stats, src, tgt, flops, loss_scale)
