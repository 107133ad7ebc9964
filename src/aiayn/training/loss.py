"""The training objective: label-smoothed cross-entropy (section 5.4), alone on logits, or
fused with the pre-softmax projection (section 3.4) for training.

`label_smoothed_loss(logits, ...)` is the loss as written. `generator_loss(features,
weight, ...)` gives the same loss and gradients from the decoder's output; on the CPU it
projects only the non-pad target positions and works through the (tokens, V) table in
blocks of rows small enough to stay in cache, writing the gradient (softmax - q) in place
of the logits. There the table is most of the memory traffic of a small model's step
(tiny preset, 8k vocabulary: ~60 of ~120 ms for the projection and loss together were
passes over it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn import speed
from aiayn.config import PAD_ID

#: Rows of the (tokens, V) table per block: 64 x 8k float32 is 2 MiB, one core's L2 cache.
ROWS_PER_BLOCK = 64
#: Vocabulary columns per matrix product of the projection: one (tokens, 256) x
#: (256, 8000) bf16 product ran at half the speed of eight (256, 1024) ones (same values).
VOCAB_BLOCK = 1024


def label_smoothed_loss(logits: Tensor, target: Tensor, eps_ls: float) -> tuple[Tensor, Tensor]:
    """Cross-entropy against (1 - eps_ls) * one-hot + eps_ls * uniform (Szegedy et al. 2016).

    Args:
        logits: (B, T, V). target: (B, T) with PAD_ID at padding, which is ignored.
    Returns:
        (smoothed loss, plain NLL), both summed over the non-pad tokens, in float32; the
        NLL carries no gradient.
    """
    loss, nll = _SmoothedCrossEntropy.apply(logits.flatten(0, 1), target.flatten(), eps_ls)
    return loss, nll


class _SmoothedCrossEntropy(torch.autograd.Function):
    """The loss above with its gradient written out: d loss / d logits = softmax - q.

    Autograd through log_softmax, gather and sum takes ~4 passes over the (B*T, V)
    logits plus a zero-filled scatter; the closed form takes two. Tested against autograd.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        # (N, V) in float32 at least, whatever the compute dtype (bf16 logits are upcast).
        lprobs = F.log_softmax(
            logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)
        )
        real = target != PAD_ID
        nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1).masked_fill(~real, 0.0).sum()
        uniform = -lprobs.sum(dim=-1).masked_fill(~real, 0.0).sum() / lprobs.size(1)
        loss = (1.0 - eps) * nll + eps * uniform
        ctx.save_for_backward(lprobs, target, real)
        ctx.eps, ctx.logits_dtype = eps, logits.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None]:
        lprobs, target, real = ctx.saved_tensors
        eps, vocab = ctx.eps, lprobs.size(1)
        grad = lprobs.exp().sub_(eps / vocab)  # softmax - the uniform part of q
        grad.scatter_add_(
            1,
            target.unsqueeze(1),
            torch.full_like(target, -(1.0 - eps), dtype=grad.dtype).unsqueeze(1),
        )
        grad.mul_((real.to(grad.dtype) * grad_loss).unsqueeze(1))  # padding gets no gradient
        return grad.to(ctx.logits_dtype), None, None


def generator_loss(
    features: Tensor, weight: Tensor, target: Tensor, eps_ls: float, *, cpu_kernels: bool = True
) -> tuple[Tensor, Tensor]:
    """`label_smoothed_loss(features @ weight.T, target, eps_ls)`, computed faster.

    Args:
        features: (B, T, D) decoder output. weight: (V, D) the pre-softmax projection
            (the shared embedding). target: (B, T) with PAD_ID at padding.
    Returns:
        (smoothed loss, plain NLL) summed over the non-pad tokens, in float32 at least.
        Under autocast the projection runs in the autocast dtype, as `nn.Linear` would.

    The fused path is for the CPU. Elsewhere this is the unfused loss: on a GPU the
    selection of the real rows waits for the device (a 20% slower base step at 291
    sentences on an H100), and the passes over the table are not what limits the step.
    `cpu_kernels` (train.cpu_kernels): the table's rows in compiled code where the speed
    paths provide it (`aiayn.speed`: `aiayn.fast.native.smoothed_ce`); else PyTorch ops
    (other rounding).
    """
    device = features.device.type
    if device != "cpu":
        return label_smoothed_loss(F.linear(features, weight), target, eps_ls)
    dtype = _compute_dtype(features)
    h, t = _real_rows(features, target)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _FusedProjectionLoss.apply(
                h,
                weight,
                dtype,
                lambda table: _smoothed_ce_rows(
                    table, t, eps_ls, write_grad=True, cpu_kernels=cpu_kernels
                ),
            )
        logits = _project(h.to(dtype), weight.to(dtype))
        loss, nll = _smoothed_ce_rows(logits, t, eps_ls, write_grad=False, cpu_kernels=cpu_kernels)
        return loss, nll


def _compute_dtype(features: Tensor) -> torch.dtype:
    """The projection's dtype: autocast's when it is on, as `nn.Linear` would run."""
    device = features.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else features.dtype


def _real_rows(features: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The (N, D) features and (N,) targets of the non-pad target positions."""
    flat = target.flatten()
    rows = (flat != PAD_ID).nonzero().squeeze(1)
    return features.flatten(0, 1).index_select(0, rows), flat.index_select(0, rows)


class _FusedProjectionLoss(torch.autograd.Function):
    """Projection and loss of the real target tokens; the gradient table is made in the
    forward pass (block by block, while the logits are in cache) and kept for backward.

    `rows_loss(table)` returns (loss, NLL) of the (N, V) logits table and leaves
    d loss / d logits in it: `_smoothed_ce_rows` or `_rdrop_rows`.
    """

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        weight: Tensor,
        dtype: torch.dtype,
        rows_loss: Callable[[Tensor], tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor]:
        hc, w = h.to(dtype), weight.to(dtype)
        table = _project(hc, w)
        loss, nll = rows_loss(table)
        ctx.save_for_backward(table, hc, w)  # table now holds d loss / d logits
        ctx.dtypes = h.dtype, weight.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Any, ...]:
        grad, hc, w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = (grad @ w).to(h_dtype).mul_(grad_loss)
        gw = (grad.t() @ hc).to(w_dtype).mul_(grad_loss)
        return gh, gw, None, None


def _project(h: Tensor, w: Tensor) -> Tensor:
    """h (N, D) @ w.T -> (N, V), in blocks of VOCAB_BLOCK columns (same values)."""
    out = torch.empty(h.size(0), w.size(0), dtype=h.dtype)
    for s in range(0, w.size(0), VOCAB_BLOCK):
        torch.mm(h, w[s : s + VOCAB_BLOCK].t(), out=out[:, s : s + VOCAB_BLOCK])
    return out


def _smoothed_ce_rows(
    logits: Tensor, target: Tensor, eps: float, *, write_grad: bool, cpu_kernels: bool = False
) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and NLL of logits (N, V) whose rows are all real tokens.

    Per row: lse = log sum exp(logits), NLL = lse - logit[target], and the uniform part of
    q = (1 - eps) * one-hot + eps / V costs lse - mean(logits). The table is scratch
    (float32/64 tables are worked on in place); with `write_grad` it ends holding
    d loss / d logits = softmax - q. `cpu_kernels`: in compiled code where it applies.
    """
    n, vocab = logits.shape
    kernel = speed.IMPLEMENTATIONS.get("smoothed_ce") if cpu_kernels else None
    fast = kernel(logits, target, eps, write_grad) if kernel is not None else None
    if fast is not None:
        lse, picked, total = fast
        nll = (lse - picked).sum()
        return (1.0 - eps) * nll + eps * (lse - total / vocab).sum(), nll
    acc = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits are upcast
    lse = torch.empty(n, dtype=acc, device=logits.device)
    picked = torch.empty_like(lse)
    total = torch.empty_like(lse)
    rows = ROWS_PER_BLOCK
    hit = torch.full((min(n, rows), 1), -(1.0 - eps), dtype=acc, device=logits.device)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        block = logits[s:e]
        x = block.to(acc)  # a copy of bf16 logits; float32 ones are worked on in place
        t = target[s:e, None]
        picked[s:e] = x.gather(1, t).squeeze(1)
        total[s:e] = x.sum(1)
        m = x.amax(1, keepdim=True)
        p = x.sub_(m).exp_()  # unnormalised softmax
        z = p.sum(1, keepdim=True)
        lse[s:e] = (z.log() + m).squeeze(1)
        if write_grad:
            p.mul_(z.reciprocal_()).sub_(eps / vocab)
            p.scatter_add_(1, t, hit[: e - s])
            if p is not block:
                block.copy_(p)
    nll = (lse - picked).sum()
    uniform = (lse - total / vocab).sum()
    return (1.0 - eps) * nll + eps * uniform, nll


def rdrop_loss(
    features: Tensor, weight: Tensor, target: Tensor, eps_ls: float, alpha: float
) -> tuple[Tensor, Tensor]:
    """R-Drop (Liang et al., 2021), an option beyond the paper: the loss of a batch that
    went through the model twice, stacked as two halves with different dropout masks.

    Per token of the original batch: the mean of the two halves' smoothed losses, plus
    `alpha` / 4 x (KL(p1 || p2) + KL(p2 || p1)), the definition of the R-Drop authors'
    fairseq criterion (their CE summed over both copies plus alpha x the mean of the two
    KL directions, over twice the tokens), so their alpha (5 for IWSLT) means the same here.

    Args:
        features: (2B, T, D), the batch's two passes stacked. weight: (V, D).
        target: (2B, T), the targets stacked the same way, PAD_ID at padding.
    Returns:
        (loss, NLL), summed over the non-pad tokens of one half (the NLL is the two halves'
        mean and carries no gradient), so per-token figures compare with `generator_loss`'s.

    On the CPU, when gradients are wanted, the loss and its gradient are fused with the
    projection as in `generator_loss` (one pass of log-softmaxes over the table, the
    gradient written out in closed form); elsewhere it is `_rdrop_loss_unfused`.
    """
    device = features.device.type
    if device != "cpu" or not (
        torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad)
    ):
        return _rdrop_loss_unfused(features, weight, target, eps_ls, alpha)
    dtype = _compute_dtype(features)
    h, t = _real_rows(features, target)
    with torch.autocast(device, enabled=False):
        return _FusedProjectionLoss.apply(
            h, weight, dtype, lambda table: _rdrop_rows(table, t, eps_ls, alpha)
        )


def _rdrop_loss_unfused(
    features: Tensor, weight: Tensor, target: Tensor, eps_ls: float, alpha: float
) -> tuple[Tensor, Tensor]:
    """`rdrop_loss` as written: the projection, `label_smoothed_loss` and the KL terms."""
    h, t = _real_rows(features, target)
    half = t.numel() // 2
    logits = F.linear(h, weight)
    loss, nll = label_smoothed_loss(logits.unsqueeze(0), t.unsqueeze(0), eps_ls)
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    lp1, lp2 = lprobs[:half], lprobs[half:]
    # sum p1 (log p1 - log p2) + p2 (log p2 - log p1) = sum (p1 - p2)(log p1 - log p2)
    kl_both = ((lp1.exp() - lp2.exp()) * (lp1 - lp2)).sum()
    return loss / 2 + alpha / 4 * kl_both, nll / 2


def _rdrop_rows(table: Tensor, target: Tensor, eps: float, alpha: float) -> tuple[Tensor, Tensor]:
    """The R-Drop loss of a (2n, V) logits table, whose rows i and n + i are the two passes
    of one token; the table ends holding d loss / d logits.

    With d = log p1 - log p2 and K = sum (p1 - p2) d, the gradients of K with respect to
    the two halves' logits are p1 (d - E_p1[d]) + p1 - p2 and p2 (E_p2[d] - d) + p2 - p1;
    the smoothed losses add (p - q) / 2 each. Tested against the unfused definition.
    """
    n, vocab = table.size(0) // 2, table.size(1)
    acc = torch.promote_types(table.dtype, torch.float32)
    smoothed = torch.zeros((), dtype=acc)
    nll = torch.zeros((), dtype=acc)
    kl_both = torch.zeros((), dtype=acc)
    rows = ROWS_PER_BLOCK // 2
    for s in range(0, n, rows):
        e = min(s + rows, n)
        halves = []
        for off in (0, n):
            x = table[off + s : off + e].to(acc)
            lp = F.log_softmax(x, dim=-1)
            t = target[off + s : off + e, None]
            picked = lp.gather(1, t).sum()
            nll -= picked
            smoothed -= (1.0 - eps) * picked + eps / vocab * lp.sum()
            halves.append((lp, t))
        (lp1, t1), (lp2, t2) = halves
        p1, p2 = lp1.exp(), lp2.exp()
        d = lp1 - lp2
        kl_both += ((p1 - p2) * d).sum()
        e1 = (p1 * d).sum(1, keepdim=True)
        e2 = (p2 * d).sum(1, keepdim=True)
        k = alpha / 4
        # (p - q) / 2 + k * (gradient of K), for each half
        g1 = (d - e1).mul_(k).add_(0.5 + k).mul_(p1).sub_(p2, alpha=k).sub_(eps / vocab / 2)
        g2 = (e2 - d).mul_(k).add_(0.5 + k).mul_(p2).sub_(p1, alpha=k).sub_(eps / vocab / 2)
        hit = torch.full_like(e1, -(1.0 - eps) / 2)
        g1.scatter_add_(1, t1, hit)
        g2.scatter_add_(1, t2, hit)
        table[s:e].copy_(g1)
        table[n + s : n + e].copy_(g2)
    return smoothed / 2 + alpha / 4 * kl_both, nll / 2
