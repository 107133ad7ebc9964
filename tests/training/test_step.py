"""`train_step` is section 5's step: over two accumulated batches it makes the update that
the paper's recipe written out by hand makes (the label-smoothed loss averaged over all the
update's target tokens, backward, the gradient clipped, Adam at the given rate), and it
leaves the weights alone when the loss is not finite."""

from __future__ import annotations

import copy
import math

import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from aiayn.data.batching import Batch
from aiayn.model import Transformer
from aiayn.training.distributed import init_from_env
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.state import StepHook
from aiayn.training.step import StepParts, train_step

CFG = ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, P_drop=0.0, vocab_size=30)
EPS_LS, LR, CLIP = 0.1, 3e-3, 0.5


def batch(seed: int, rows: int, src_len: int, tgt_len: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, CFG.vocab_size, (rows, src_len), generator=g)
    y = torch.randint(4, CFG.vocab_size, (rows, tgt_len), generator=g)
    src[:, -1] = EOS_ID
    src[0, -2:] = torch.tensor([EOS_ID, PAD_ID])  # one padded row
    bos = torch.full((rows, 1), BOS_ID)
    eos = torch.full((rows, 1), EOS_ID)
    tgt_in, tgt_out = torch.cat([bos, y], 1), torch.cat([y, eos], 1)
    tgt_out[0, -1] = PAD_ID
    return Batch(src, tgt_in, tgt_out, torch.arange(rows))


def loss_fn(net: torch.nn.Module, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return label_smoothed_loss(net(b.src, b.tgt_in), b.tgt_out, EPS_LS)


def parts(model: Transformer, opt: torch.optim.Optimizer, loss=loss_fn) -> StepParts:
    dist, _ = init_from_env("cpu")
    return StepParts(
        net=model,
        model=model,
        loss=loss,
        optimizer=opt,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        dist=dist,
        hook=StepHook(),
        device=torch.device("cpu"),
        clip_norm=CLIP,
        word_dropout=0.0,
        flops=lambda b: 1.0,
    )


def adam(model: torch.nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)


def test_the_step_is_the_papers_update_written_out():
    torch.manual_seed(0)
    model = Transformer(CFG)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    batches = [batch(1, 3, 7, 6), batch(2, 2, 5, 9)]
    done = train_step(parts(model, adam(model)), batches, step=1, lr=LR)

    ref_opt = adam(ref)
    losses = [loss_fn(ref, b) for b in batches]
    tokens = sum(b.tgt_tokens for b in batches)
    (sum(loss for loss, _ in losses) / tokens).backward()  # mean over the update's tokens
    gnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    for group in ref_opt.param_groups:
        group["lr"] = LR
    ref_opt.step()

    assert done.outcome == "updated" and done.tgt_tokens == tokens == (3 * 7 - 1) + (2 * 10 - 1)
    assert math.isclose(done.stats["loss"], sum(float(x.detach()) for x, _ in losses) / tokens)
    assert math.isclose(done.stats["gnorm"], float(gnorm), rel_tol=1e-5)
    assert float(gnorm) > CLIP  # the clipping was exercised
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7), name
        assert p.grad is None  # zeroed after the update
    pairs = zip(model.parameters(), init.parameters(), strict=True)
    moved = [not torch.equal(p, q) for p, q in pairs]
    assert all(moved)  # every weight took the step


def test_a_non_finite_loss_leaves_the_weights_alone():
    torch.manual_seed(0)
    model = Transformer(CFG)
    before = copy.deepcopy(model.state_dict())

    def nan_loss(net, b):
        loss, nll = loss_fn(net, b)
        return loss * float("nan"), nll

    done = train_step(parts(model, adam(model), nan_loss), [batch(1, 3, 7, 6)], step=1, lr=LR)
    assert done.outcome == "nonfinite" and math.isnan(done.stats["loss"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
