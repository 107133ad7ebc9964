"""Constrained decoding: the beam search's hook for a per-hypothesis mask of allowed tokens.

`beam_search(..., constraint=C)` asks a `Constraint` before every step which tokens each
live hypothesis may take next, and tells it after the step which token each surviving
hypothesis took and which row it extends, so the constraint's state follows the beam's
reordering (and the dropping of finished sentences) exactly as the model's incremental
state does. The search itself knows nothing of what is constrained: the parser's tree
constraint (`aiayn.decoding.tree_constraint`: every output a tree over exactly the input
words) and translation's prefix-constrained or forced decoding (`ForcedPrefix` below) are
each one implementation.

The protocol, batched (R rows = live hypotheses; one row per sentence before the first
step, then `beam` rows per sentence still decoding, in the search's row order):

- ``start(caps)``: the state for B sentences, one row each; ``caps[b]`` is sentence b's
  output length cap (tokens, EOS not counted: at the cap a hypothesis ends as it is, so a
  constraint that must end in a complete structure plans for it).
- ``allowed(state)``: (R, V) bool on the model's device, True where the token may come
  next. A row with no True has no extension (its slot empties). The search sets log P to
  -inf outside the mask after normalising over the whole vocabulary: the model's
  distribution is not renormalised (fairseq's prefix_allowed_tokens_fn does the same).
- ``advance(state, tokens, origin)``: the state of the next step's rows: row i extends
  the current row ``origin[i]`` with ``tokens[i]`` (both (R',) long). A token may be one
  the mask did not allow (the candidate of an empty slot, whose score is -inf, or an EOS
  that just finished its hypothesis): the constraint must accept it without error (and
  may allow nothing after it); it never reaches an output.

- ``reweigh(state, log_probs)`` (optional; absent or None: the scores are the
  log-probabilities): the scores the search ranks by, from the (R, V) table of the
  model's log-probabilities (same shape, and it may write into the table; the mask
  applies after it). The tree constraint, with `word_mass`, scores a word's piece by the
  model's probability of any word piece.

Costs: one (R, V) bool mask a step; `benchmarks/bench_constraint.py` measures the tree
constraint against unconstrained decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from aiayn.config import EOS_ID


class Constraint(Protocol):
    """What `beam_search` asks of a constraint (see the module docstring)."""

    def start(self, caps: Sequence[int]) -> Any: ...

    def allowed(self, state: Any) -> Tensor: ...

    def advance(self, state: Any, tokens: Tensor, origin: Tensor) -> Any: ...


@dataclass
class _PrefixState:
    sent: Tensor  # (R,) sentence of each row
    step: int


class ForcedPrefix:
    """Each sentence's output starts with given token ids, then is free: prefix-constrained
    decoding (an interactive translator's accepted prefix), or forced decoding when the
    prefix ends in EOS (scoring a given output). An example of the protocol, and what
    translation's forced decoding builds on."""

    def __init__(self, prefixes: Sequence[Sequence[int]], vocab_size: int, device: Any) -> None:
        longest = max((len(p) for p in prefixes), default=0)
        self.length = torch.tensor([len(p) for p in prefixes], device=device)
        self.ids = torch.full((len(prefixes), max(1, longest)), EOS_ID, device=device)
        for b, p in enumerate(prefixes):
            self.ids[b, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        self.vocab_size, self.device = vocab_size, device

    def start(self, caps: Sequence[int]) -> _PrefixState:
        return _PrefixState(torch.arange(len(caps), device=self.device), 0)

    def allowed(self, state: _PrefixState) -> Tensor:
        rows = state.sent.numel()
        forced = self.length[state.sent] > state.step
        mask = (~forced).unsqueeze(1).expand(rows, self.vocab_size).clone()
        col = self.ids[state.sent, min(state.step, self.ids.size(1) - 1)]
        mask[torch.arange(rows, device=self.device)[forced], col[forced]] = True
        return mask

    def advance(self, state: _PrefixState, tokens: Tensor, origin: Tensor) -> _PrefixState:
        return _PrefixState(state.sent[origin], state.step + 1)
