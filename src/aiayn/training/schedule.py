"""The optimizer and its schedule (section 5.3): Adam with beta1 = 0.9, beta2 = 0.98,
eps = 1e-9, and Eq. 3's warmup then inverse-square-root decay."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.config import Config, TrainConfig
from aiayn.training.state import TrainState


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), steps from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def step_lr(cfg: Config, state: TrainState, step: int) -> float:
    """The rate of step `step` in a run: Eq. 3 times train.lr_scale, times the factor that
    divergence rollbacks left (`state.lr_factor`)."""
    t = cfg.train
    return state.lr_factor * learning_rate(step, cfg.model.d_model, t.warmup_steps, t.lr_scale)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Adam:
    """Adam with beta1 = 0.9, beta2 = 0.98, eps = 1e-9 (section 5.3); lr is set every step.

    PyTorch's fused implementation (one kernel over all parameters, on CPU and CUDA) does
    the same arithmetic as the per-parameter loop, several times faster on small models.
    """
    return torch.optim.Adam(
        model.parameters(), lr=0.0, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=True
    )
