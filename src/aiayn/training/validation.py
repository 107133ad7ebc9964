"""Validation (section 6): the unsmoothed NLL per target token and its perplexity."""

from __future__ import annotations

import math

import torch

from aiayn.data.batching import collate, token_batches
from aiayn.data.corpus import Corpus
from aiayn.model import Transformer
from aiayn.training.loss import generator_loss
from aiayn.training.precision import autocast

__all__ = ["autocast", "validate"]


@torch.no_grad()
def validate(
    model: Transformer,
    corpus: Corpus,
    max_tokens: int,
    device: torch.device,
    dtype: str = "fp32",
    cpu_kernels: bool = True,
) -> dict[str, float]:
    """Validation NLL per target token and perplexity (unsmoothed, as the paper reports).
    `cpu_kernels`: see `loss.generator_loss`."""
    was_training = model.training
    model.eval()
    nll_sum, n_tok = 0.0, 0
    for idx in token_batches(
        corpus.src_lens, corpus.tgt_lens, max_tokens, seed=0, epoch=0, shuffle=False
    ):
        b = collate(corpus, idx).to(device)
        with autocast(device, dtype):
            features = model(b.src, b.tgt_in, features_only=True)
            _, nll = generator_loss(
                features, model.generator.weight, b.tgt_out, 0.0, cpu_kernels=cpu_kernels
            )
        nll_sum += float(nll)
        n_tok += b.tgt_tokens
    model.train(was_training)
    mean_nll = nll_sum / max(n_tok, 1)
    return {"valid_nll": mean_nll, "valid_ppl": math.exp(min(mean_nll, 50.0))}
