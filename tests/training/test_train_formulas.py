"""The training recipe's formulas (section 5.3 Eq. 3, section 5.4 label smoothing)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiayn.config import PAD_ID
from aiayn.fast import native
from aiayn.training.loss import _rdrop_loss_unfused, generator_loss, label_smoothed_loss, rdrop_loss
from aiayn.training.trainer import learning_rate


@pytest.mark.parametrize("step", [1, 10, 3999, 4000, 4001, 10_000, 100_000])
def test_learning_rate_is_eq3(step):
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)."""
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    assert learning_rate(step, 512, 4000) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(step, 512, 4000, scale=2.0) == pytest.approx(2 * expected, rel=1e-12)


def test_learning_rate_peaks_at_warmup():
    """Section 5.3: linear increase for warmup_steps, then inverse square root decay."""
    lrs = [learning_rate(s, 512, 4000) for s in range(1, 10_000)]
    assert max(range(len(lrs)), key=lrs.__getitem__) + 1 == 4000
    assert learning_rate(4000, 512, 4000) == pytest.approx(512**-0.5 * 4000**-0.5)


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
        -1, target.unsqueeze(-1), torch.full((3, 5, 1), 1 - eps, dtype=torch.float64)
    )
    ref_loss = (-(q * logp).sum(-1) * (target != PAD_ID)).sum()
    (2.5 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert not nll.requires_grad


def _projection_case(dtype: torch.dtype = torch.float64, vocab: int = 2100, seed: int = 0):
    """Decoder features, an output weight and targets with padding, over several row blocks
    and vocabulary blocks of `generator_loss` (ROWS_PER_BLOCK, VOCAB_BLOCK)."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(9, 17, 16, dtype=dtype, generator=g)
    weight = torch.randn(vocab, 16, dtype=dtype, generator=g)
    target = torch.randint(4, vocab, (9, 17), generator=g)
    target[2, 5:] = PAD_ID
    target[7, 11:] = PAD_ID
    return features, weight, target


def _second_pass(features: torch.Tensor) -> torch.Tensor:
    """The R-Drop tests' second pass: the features moved by fixed noise (its "dropout")."""
    g = torch.Generator().manual_seed(1)
    return features + 0.3 * torch.randn(features.shape, dtype=features.dtype, generator=g)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_projection_and_loss_equal_the_definition(eps):
    """generator_loss(features, W) = label_smoothed_loss(features @ W^T): loss, NLL and the
    gradients for the features and the (shared) weight, float64; padding rows get none."""
    features, weight, target = _projection_case()
    f1, w1 = features.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = generator_loss(f1, w1, target, eps)
    (3.0 * loss).backward()
    f2, w2 = features.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss, ref_nll = label_smoothed_loss(f2 @ w2.t(), target, eps)
    (3.0 * ref_loss).backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-12)
    torch.testing.assert_close(f1.grad, f2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)
    assert f1.grad[target == PAD_ID].abs().max() == 0
    with torch.no_grad():  # validation: no gradient table, the same numbers
        assert float(generator_loss(features, weight, target, eps)[1]) == pytest.approx(
            float(ref_nll), rel=1e-12
        )


@pytest.mark.skipif(native.library() is None, reason="no compiled library")
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_rows_in_c_equal_the_definition_in_float32(eps):
    """The loss's pass over the float32 logits in C (`native.smoothed_ce`, train.cpu_kernels):
    loss, NLL and both gradients as the definition computed in float64, to float32
    rounding; the validation path (no gradient table) the same NLL."""
    features, weight, target = _projection_case(torch.float32, vocab=3000, seed=2)
    f1, w1 = features.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = generator_loss(f1, w1, target, eps, cpu_kernels=True)
    loss.backward()
    f2, w2 = features.double().requires_grad_(), weight.double().requires_grad_()
    ref_loss, ref_nll = label_smoothed_loss(f2 @ w2.t(), target, eps)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    torch.testing.assert_close(f1.grad.double(), f2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert float(
            generator_loss(features, weight, target, eps, cpu_kernels=True)[1]
        ) == pytest.approx(float(ref_nll), rel=1e-6)


def test_rdrop_loss_is_its_definition():
    """R-Drop on two different halves: the halves' mean smoothed loss plus alpha/4 x both
    KL directions, each written out as sum p (log p - log q) over the real tokens."""
    features, weight, target = _projection_case()
    other = _second_pass(features)
    stacked, targets = torch.cat([features, other]), target.repeat(2, 1)
    loss, nll = rdrop_loss(stacked, weight, targets, 0.1, alpha=5.0)
    ce1, nll1 = label_smoothed_loss(features @ weight.t(), target, 0.1)
    ce2, nll2 = label_smoothed_loss(other @ weight.t(), target, 0.1)
    real = target != PAD_ID
    lp = torch.log_softmax(features @ weight.t(), -1)[real]
    lq = torch.log_softmax(other @ weight.t(), -1)[real]
    kl_pq = (lp.exp() * (lp - lq)).sum()
    kl_qp = (lq.exp() * (lq - lp)).sum()
    assert float(kl_pq) > 0 and float(kl_qp) > 0
    assert float(loss) == pytest.approx(
        float((ce1 + ce2) / 2 + 5.0 / 4 * (kl_pq + kl_qp)), rel=1e-12
    )
    assert float(nll) == pytest.approx(float((nll1 + nll2) / 2), rel=1e-12)


def test_rdrop_loss_of_two_equal_passes_is_the_plain_loss_with_its_gradient():
    """Without dropout the halves agree: the KL term and its gradient vanish, and the loss
    and the gradients of features and weight are the paper's objective's."""
    features, weight, target = _projection_case()
    f1, w1 = features.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = rdrop_loss(torch.cat([f1, f1]), w1, target.repeat(2, 1), 0.1, alpha=5.0)
    loss.backward()
    f2, w2 = features.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss, ref_nll = generator_loss(f2, w2, target, 0.1)
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-12)
    assert float(nll) == pytest.approx(float(ref_nll), rel=1e-12)
    torch.testing.assert_close(f1.grad, f2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_fused_rdrop_loss_has_the_definitions_value_and_gradients():
    """The CPU training path writes the R-Drop gradient out in closed form; on two
    different halves it must match autograd through the loss as written (float64)."""
    features, weight, target = _projection_case()
    other = _second_pass(features)
    targets = target.repeat(2, 1)
    f1, w1 = torch.cat([features, other]).requires_grad_(), weight.clone().requires_grad_()
    loss, nll = rdrop_loss(f1, w1, targets, 0.1, alpha=5.0)  # fused: gradients wanted
    loss.backward()
    f2, w2 = torch.cat([features, other]).requires_grad_(), weight.clone().requires_grad_()
    ref_loss, ref_nll = _rdrop_loss_unfused(f2, w2, targets, 0.1, alpha=5.0)
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-12)
    assert float(nll) == pytest.approx(float(ref_nll), rel=1e-12)
    assert f1.grad.abs().max() > 0
    torch.testing.assert_close(f1.grad, f2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


def _assert_fused_bf16_as_accurate(
    features: torch.Tensor,
    weight: torch.Tensor,
    exact: Any,
    fused: Any,
    unfused: Any,
    scale: float = 1.0,
) -> None:
    """Under bf16 autocast the fused loss, and its gradients for features and weight, must
    be no further from `exact` in float64 than the unfused path is."""
    exact_f, exact_w = features.double().requires_grad_(), weight.double().requires_grad_()
    ref = exact(exact_f, exact_w)
    ref.backward()

    def rel(mine: torch.Tensor, r: torch.Tensor) -> float:
        return float((mine.double() - r * scale).norm() / (r * scale).norm())

    errors = {}
    for name, fn in {"fused": fused, "unfused": unfused}.items():
        f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(f, w)
        (loss * scale).backward()
        assert f.grad.dtype == w.grad.dtype == torch.float32
        errors[name] = [
            abs(loss.item() - ref.item()) / ref.item(),
            rel(f.grad, exact_f.grad),
            rel(w.grad, exact_w.grad),
        ]
    for fused_error, unfused_error in zip(errors["fused"], errors["unfused"], strict=True):
        assert fused_error < 1.5 * unfused_error + 1e-6, errors
    assert max(errors["fused"]) < 2e-2, errors


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_fused_projection_and_loss_in_bf16_are_as_accurate_as_the_unfused_path(cpu_kernels):
    """Under bf16 autocast both paths round the logits and the gradient table to bf16; the
    fused one, with its rows in C (`native.smoothed_ce`) or in PyTorch ops, must be no
    further from float64 than nn.Linear + label_smoothed_loss."""
    features, weight, target = _projection_case(torch.float32, vocab=3000, seed=1)
    _assert_fused_bf16_as_accurate(
        features,
        weight * 0.3,
        exact=lambda f, w: label_smoothed_loss(f @ w.t(), target, 0.1)[0],
        fused=lambda f, w: generator_loss(f, w, target, 0.1, cpu_kernels=cpu_kernels)[0],
        unfused=lambda f, w: label_smoothed_loss(torch.nn.functional.linear(f, w), target, 0.1)[0],
        scale=1 / 100,
    )


def test_fused_rdrop_loss_in_bf16_is_as_accurate_as_the_unfused_path():
    """The R-Drop gradient table is bf16 under autocast too; no further from float64 than
    the loss as written under the same autocast."""
    features, weight, target = _projection_case(torch.float32, vocab=3000, seed=1)
    stacked = torch.cat([features, _second_pass(features)])
    targets = target.repeat(2, 1)
    _assert_fused_bf16_as_accurate(
        stacked,
        weight * 0.3,
        exact=lambda f, w: _rdrop_loss_unfused(f, w, targets, 0.1, alpha=5.0)[0],
        fused=lambda f, w: rdrop_loss(f, w, targets, 0.1, alpha=5.0)[0],
        unfused=lambda f, w: _rdrop_loss_unfused(f, w, targets, 0.1, alpha=5.0)[0],
    )
