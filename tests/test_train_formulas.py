"""The training recipe's formulas (section 5.3 Eq. 3, section 5.4 label smoothing)."""

from __future__ import annotations

import pytest
import torch

from aiayn.config import PAD_ID
from aiayn.train import label_smoothed_loss, learning_rate


@pytest.mark.parametrize("step", [1, 10, 3999, 4000, 4001, 10_000, 100_000])
def test_learning_rate_is_eq3(step):
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)."""
    expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    assert learning_rate(step, 512, 4000) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(step, 512, 4000, scale=2.0) == pytest.approx(2 * expected, rel=1e-12)


def test_learning_rate_peaks_at_warmup():
    """Section 5.3: linear increase for warmup_steps, then inverse square root decay."""
    lrs = [learning_rate(s, 512, 4000) for s in range(1, 10_000)]
    assert max(range(len(lrs)), key=lrs.__getitem__) + 1 == 4000
    assert learning_rate(4000, 512, 4000) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)


def literal_smoothed_loss(logits, target, eps):
    """Szegedy et al.: q'(k) = (1 - eps) delta(k, y) + eps / K; loss = -sum_k q'(k) log p(k)."""
    logp = torch.log_softmax(logits.double(), -1)
    K = logits.shape[-1]
    total = 0.0
    for b in range(target.shape[0]):
        for t in range(target.shape[1]):
            y = int(target[b, t])
            if y == PAD_ID:
                continue
            q = torch.full((K,), eps / K, dtype=torch.float64)
            q[y] += 1 - eps
            total += float(-(q * logp[b, t]).sum())
    return total


def test_label_smoothing_matches_the_definition():
    """Section 5.4: eps_ls = 0.1 label smoothing, padding ignored."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    target = torch.randint(1, 11, (2, 5), generator=g)
    target[1, 3:] = PAD_ID
    loss, nll = label_smoothed_loss(logits, target, 0.1)
    assert float(loss) == pytest.approx(literal_smoothed_loss(logits, target, 0.1), rel=1e-5)
    assert float(nll) == pytest.approx(literal_smoothed_loss(logits, target, 0.0), rel=1e-5)


def test_eps_zero_is_plain_nll():
    """Section 5.4 / Table 3 row D: eps_ls = 0 is ordinary maximum likelihood."""
    logits = torch.randn(3, 4, 9)
    target = torch.randint(1, 9, (3, 4))
    loss, nll = label_smoothed_loss(logits, target, 0.0)
    expected = -torch.log_softmax(logits, -1).gather(-1, target[..., None]).sum()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(loss) == float(nll)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_gradient_equals_autograd_of_the_definition(eps):
    """Section 5.4: the written-out gradient (softmax - q) equals autograd of the formula."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, generator=g)
    target = torch.randint(4, 11, (3, 5), generator=g)
    target[1, 3:] = PAD_ID
    mine = logits.clone().requires_grad_()
    loss, nll = label_smoothed_loss(mine, target, eps)
    (2.5 * loss).backward()
    ref = logits.clone().requires_grad_()
    logp = torch.log_softmax(ref.double(), -1)
    q = torch.full_like(logp, eps / 11).scatter_add_(
        -1, target.unsqueeze(-1), torch.full((3, 5, 1), 1 - eps, dtype=torch.float64))
    ref_loss = (-(q * logp).sum(-1) * (target != PAD_ID)).sum()
    (2.5 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert not nll.requires_grad
