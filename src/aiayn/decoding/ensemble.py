"""Several models decoding as one: the mean of their next-token distributions.

Beyond the paper: its own rows are single models (Table 2 lists other systems' ensembles).
Ensembling is what fairseq's ``--path a.pt:b.pt`` and OpenNMT's ``-model a.pt b.pt`` do,
with the same rule as theirs: at every step the members' probabilities are averaged,

    log P_ens(y | y_<t, x) = log (1/K) sum_k P_k(y | y_<t, x),

so the search (greedy or beam, with the length penalty) runs unchanged on top. Members
must share the vocabulary (checked when they are loaded: `aiayn.checkpoints.io.load_ensemble`);
each keeps its own encoder output and incremental state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class EnsembleState:
    """One member's per-layer incremental states, reordered together (beam search)."""

    def __init__(self, states: Any) -> None:
        self.states = states

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        for state in self.states:
            state.reorder(index, sentences)


class Ensemble:
    """An `aiayn.decoding.search.IncrementalDecoder` over K members (Transformers, or anything with
    `encode`, `init_state` and `decode_step`) whose next-token scores are log-probabilities
    of the members' mean distribution, in float32."""

    def __init__(self, members: Sequence[Any]) -> None:
        if not members:
            raise ValueError("an ensemble needs at least one model")
        self.members = list(members)
        cfgs = [m.cfg for m in self.members if getattr(m, "cfg", None) is not None]
        if len({c.vocab_size for c in cfgs}) > 1:
            raise ValueError(
                "ensemble members have different vocabulary sizes: "
                + ", ".join(str(c.vocab_size) for c in cfgs)
            )
        # `search.position_limit` reads cfg.max_positions: the shortest member's table
        self.cfg = (
            dataclasses.replace(cfgs[0], max_positions=min(c.max_positions for c in cfgs))
            if cfgs
            else None
        )

    def eval(self) -> Ensemble:
        for m in self.members:
            if hasattr(m, "eval"):
                m.eval()
        return self

    def encode(self, src: Tensor) -> tuple[list[Tensor], Tensor]:
        """Each member's encoder output, and the source mask (the same for all)."""
        outputs = [m.encode(src) for m in self.members]
        return [memory for memory, _ in outputs], outputs[0][1]

    def init_state(self, memory: list[Tensor], max_len: int) -> list[EnsembleState]:
        return [
            EnsembleState(m.init_state(mem, max_len))
            for m, mem in zip(self.members, memory, strict=True)
        ]

    def decode_step(self, tokens: Tensor, src_mask: Tensor, states: list[EnsembleState]) -> Tensor:
        """Next-token log-probabilities (R, V) of the members' mean distribution."""
        log_p = [
            F.log_softmax(m.decode_step(tokens, src_mask, s.states).float(), dim=-1)
            for m, s in zip(self.members, states, strict=True)
        ]
        return torch.logsumexp(torch.stack(log_p), dim=0) - math.log(len(log_p))


def as_decoder(models: Sequence[Any]) -> Any:
    """One model as it is (its own search path, bit for bit), several as an `Ensemble`."""
    return models[0] if len(models) == 1 else Ensemble(models)
