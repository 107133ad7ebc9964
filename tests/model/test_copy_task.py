"""A copy task the Transformer must learn, not just run (sections 3, 5.3, 5.4 and 6.1).

Random symbol strings are copied from source to target: the decoder has to attend to the
right source position at each step (encoder-decoder attention, 3.2.3), which it can
only do through the positional encodings (3.5). Trained with the label-smoothed loss
(5.4), Adam and the Eq. 3 schedule (5.3), decoded greedily with incremental state (6.1).
"""

from __future__ import annotations

import torch

from aiayn.decoding.search import greedy_search
from helpers import copy_batch, random_strings, train_copy_model


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
