"""A copy task the Transformer must learn, not just run (sections 3, 5.3, 5.4 and 6.1).

Random symbol strings are copied from source to target: the decoder has to attend to the
right source position at each step (encoder-decoder attention, 3.2.3), which it can
only do through the positional encodings (3.5). Trained with the label-smoothed loss
(5.4), Adam and the Eq. 3 schedule (5.3), decoded greedily with incremental state (6.1).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from aiayn.batching import pad_right
from aiayn.config import BOS_ID, EOS_ID, ModelConfig, TrainConfig
from aiayn.loss import label_smoothed_loss
from aiayn.model import Transformer
from aiayn.search import greedy_search
from aiayn.train import learning_rate, make_optimizer

FIRST_SYMBOL, N_SYMBOLS = EOS_ID + 1, 10  # ids 4..13; 0-3 are PAD, UNK, BOS, EOS
MIN_LEN, MAX_LEN = 3, 8
STEPS, BATCH = 400, 32
MODEL = ModelConfig(N=2, d_model=64, d_ff=128, h=4, d_k=16, d_v=16, P_drop=0.0,
                    vocab_size=FIRST_SYMBOL + N_SYMBOLS)
# Eq. 3 at full scale peaks at 0.0125 for d_model = 64: too high for this small model and
# batch (the loss spikes); 0.15 x Eq. 3 learns the task reliably in 400 steps.
TRAIN = TrainConfig(warmup_steps=100, eps_ls=0.1, lr_scale=0.15)


pytestmark = pytest.mark.usefixtures("one_thread")


def random_strings(n: int, g: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g).tolist()
    return [torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + N_SYMBOLS, (k,), generator=g).tolist()
            for k in lengths]


def copy_batch(strings: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """src = x EOS, tgt_in = BOS x, tgt_out = x EOS (teacher forcing, shifted right)."""
    src = pad_right([s + [EOS_ID] for s in strings])
    tgt_in = pad_right([[BOS_ID] + s for s in strings])
    tgt_out = pad_right([s + [EOS_ID] for s in strings])
    return src, tgt_in, tgt_out


def train_copy_model(g: torch.Generator, steps: int = STEPS
                     ) -> tuple[Transformer, set[tuple[int, ...]]]:
    model = Transformer(MODEL)
    optimizer = make_optimizer(model, TRAIN)
    seen: set[tuple[int, ...]] = set()
    model.train()
    for step in range(1, steps + 1):
        strings = random_strings(BATCH, g)
        seen.update(map(tuple, strings))
        src, tgt_in, tgt_out = copy_batch(strings)
        loss, _ = label_smoothed_loss(model(src, tgt_in), tgt_out, TRAIN.eps_ls)
        n_tokens = int((tgt_out != 0).sum())
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, MODEL.d_model, TRAIN.warmup_steps,
                                        TRAIN.lr_scale)
        optimizer.zero_grad(set_to_none=True)
        (loss / n_tokens).backward()
        optimizer.step()
    return model.eval(), seen


def test_transformer_learns_to_copy() -> None:
    """>= 90% of unseen strings are copied exactly by greedy decoding after 400 steps."""
    torch.manual_seed(0)  # initial weights
    g = torch.Generator().manual_seed(1)  # data
    model, seen = train_copy_model(g)
    held_out = [s for s in random_strings(300, g) if tuple(s) not in seen][:200]
    assert len(held_out) == 200
    src, _, _ = copy_batch(held_out)
    outputs = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    exact = sum(out == s for out, s in zip(outputs, held_out, strict=True))
    assert exact / len(held_out) >= 0.9, f"{exact} of {len(held_out)} copied exactly"
