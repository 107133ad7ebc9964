"""The parser's decoding constraint: every output is a linearized tree over exactly the
input's words, by construction (section 6.3 decoded under a grammar of trees).

A `Constraint` (`aiayn.decoding.constraints`) for `beam_search`. The target language is
`aiayn.parsing.linearize.linearize`'s: `(S (NP Pierre Vinken )NP , ... )S`, each bracket one
subword piece, each word its own pieces (or XX's, for GAFL's target). After a prefix, the
tokens allowed next are:

- the next piece of the word being written, and nothing else, inside a word;
- between words: an open bracket `(L` of any label (if a word is left for it to hold,
  the depth is below `max_depth` and fewer than `max_opens` opens came in a row; at the
  top only as the first token: one root); the first piece of the next input word (inside
  the root); the close bracket `)L` of the innermost open constituent, with its label (if
  it holds something, and for the root only once every word is written);
- EOS once the root is closed, and only then.

A length budget keeps every hypothesis completable within the search's cap (input length
+ 300 for the parser): a token is allowed only if the pieces left plus the brackets still
to close fit in the tokens left after it, so a hypothesis ended by the cap is a whole tree
too. The state is batched tensors (depth, label stack, pieces written, ...), gathered by
the search's row order each step; the mask is built with a few vectorized writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID, PAD_ID
from aiayn.files import InputError


@dataclass(frozen=True)
class TreeLimits:
    """Bounds on the trees decoded: deepest nesting of constituents, most open brackets in
    a row. `tree_limits` takes them from the training trees."""

    max_depth: int = 64
    max_opens: int = 64

    def validate(self) -> None:
        if self.max_depth < 1 or self.max_opens < 1:
            raise ValueError(f"tree limits must be >= 1, got {self}")


def tree_limits(targets: Sequence[str]) -> TreeLimits:
    """The largest depth and run of open brackets in linearized trees (the training
    targets): what the constraint allows, so no decoded tree is deeper than one seen."""
    depth = opens = 0
    for line in targets:
        d = run = 0
        for tok in line.split():
            if tok[0] == "(" and len(tok) > 1:
                d, run = d + 1, run + 1
                depth, opens = max(depth, d), max(opens, run)
            elif tok[0] == ")" and len(tok) > 1:
                d, run = d - 1, 0
            else:
                run = 0
    return TreeLimits(max(1, depth), max(1, opens))


@dataclass(frozen=True)
class Brackets:
    """The token ids of each label's open and close bracket (one subword piece each)."""

    labels: tuple[str, ...]
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]


def bracket_tokens(tokenizer: Any) -> Brackets:
    """The labels whose `(L` and `)L` are each one piece of `tokenizer`'s vocabulary: what
    the parser can write (its vocabulary was trained on the linearized trees)."""
    labels, opens, closes = [], [], []
    for piece in sorted(tokenizer.pieces()):
        text = piece.replace("\u2581", "")
        if len(text) < 2 or text[0] != "(" or "(" in text[1:] or ")" in text[1:]:
            continue
        o, c = tokenizer.encode(text), tokenizer.encode(")" + text[1:])
        if len(o) == 1 and len(c) == 1 and text[1:] not in labels:
            labels.append(text[1:])
            opens.append(o[0])
            closes.append(c[0])
    if not labels:
        raise InputError(
            "the model's vocabulary holds no bracket pieces '(L' and ')L': not a parser's "
            "(or decode with --no-constrained)"
        )
    return Brackets(tuple(labels), tuple(opens), tuple(closes))


@dataclass
class _State:
    sent: Tensor  # (R,) the sentence of each row
    p: Tensor  # (R,) pieces written
    depth: Tensor  # (R,) constituents open
    stack: Tensor  # (R, max_depth) label index of each open constituent, outermost first
    top_empty: Tensor  # (R,) bool: the innermost open constituent holds nothing yet
    opens: Tensor  # (R,) open brackets in a row just before
    started: Tensor  # (R,) bool: the root is open or closed
    done: Tensor  # (R,) bool: the root is closed
    dead: Tensor  # (R,) bool: an empty slot (a token not allowed, or EOS): nothing follows
    caps: Tensor  # (B,) each sentence's output cap
    step: int
    mask: Tensor | None = None  # the last `allowed`, to check the token taken


class TreeConstraint:
    """Linearized trees over given words (see the module docstring).

    Args:
        words: each sentence's words as piece ids, a list per word (what the target
            writes in the word's place: the word's pieces, or XX's for GAFL's target).
        brackets: the labels' bracket tokens (`bracket_tokens`).
        vocab_size: V of the model's output.
        limits: depth and open-run bounds (`tree_limits`).
        word_mass: score a word's pieces by the model's probability of writing any word
            piece there (`word_scores`); False: by the probability of the input's piece.
    """

    def __init__(
        self,
        words: Sequence[Sequence[Sequence[int]]],
        brackets: Brackets,
        vocab_size: int,
        limits: TreeLimits = TreeLimits(),
        device: Any = "cpu",
        word_mass: bool = False,
    ) -> None:
        limits.validate()
        # the search's optional rescoring hook (`aiayn.decoding.constraints`): only with
        # word_mass, so that the default search is the plain one
        self.reweigh: Callable[[_State, Tensor], Tensor] | None = (
            self.word_scores if word_mass else None
        )
        self.limits, self.vocab_size, self.device = limits, vocab_size, device
        flat = [[i for w in ws for i in w] for ws in words]
        if any(not f for f in flat) or any(not w for ws in words for w in ws):
            raise ValueError("every sentence needs a word, and every word a piece")
        longest = max(len(f) for f in flat)
        self.pieces = torch.full((len(flat), longest + 1), EOS_ID, dtype=torch.long)
        self.boundary = torch.zeros((len(flat), longest + 1), dtype=torch.bool)
        for b, ws in enumerate(words):
            self.pieces[b, : len(flat[b])] = torch.tensor(flat[b], dtype=torch.long)
            at = 0
            for w in ws:
                self.boundary[b, at] = True
                at += len(w)
            self.boundary[b, at] = True  # after the last word
        self.pieces, self.boundary = self.pieces.to(device), self.boundary.to(device)
        self.total = torch.tensor([len(f) for f in flat], device=device)
        self.open_ids = torch.tensor(brackets.open_ids, dtype=torch.long, device=device)
        self.close_ids = torch.tensor(brackets.close_ids, dtype=torch.long, device=device)
        self.open_label = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
        self.open_label[self.open_ids] = torch.arange(len(brackets.labels), device=device)
        self.is_close = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.is_close[self.close_ids] = True
        # the tokens that are not a word's: brackets and the specials (a few dozen ids)
        specials = torch.tensor([PAD_ID, BOS_ID, EOS_ID], device=device)
        self.not_word = torch.cat([self.open_ids, self.close_ids, specials]).unique()

    def word_scores(self, s: _State, log_p: Tensor) -> Tensor:
        """The scores the search ranks the next tokens by (`word_mass`: the constraint's
        `reweigh`): the model's log P (R, V), except that the input's next piece scores
        log P(any word piece) instead of log P(that piece). Which word comes next is fixed
        by the input, so only the decision to write a word (against opening or closing a
        bracket) is scored, as GAFL's XX target scores it; a model unsure of its place in
        the input then no longer escapes into brackets, but one that reads well loses
        recall (measured: docs/results.md#parsing). Writes into `log_p`."""
        # log(1 - P(bracket or special)): a few dozen columns, not the vocabulary; where
        # the model is sure of a bracket the rounding of 1 - P only moves a hopeless word
        rest = log_p[:, self.not_word].exp().sum(dim=1)
        mass = torch.log1p(-rest.clamp(max=1.0 - 2**-23))
        piece = self.pieces[s.sent, s.p].unsqueeze(1)
        return log_p.scatter_(1, piece, mass.unsqueeze(1))

    def start(self, caps: Sequence[int]) -> _State:
        b = len(caps)
        if b != self.pieces.size(0):
            raise ValueError(f"{b} sentences decoding, the constraint has {self.pieces.size(0)}")
        # one more: the root's open and close, around every piece
        short = [i for i in range(b) if caps[i] < int(self.total[i]) + 2]
        if short:
            raise ValueError(f"sentence {short[0]}: its output cap cannot hold its tree")
        cap = torch.tensor(list(caps), device=self.device)
        zeros = torch.zeros(b, dtype=torch.long, device=self.device)
        no = torch.zeros(b, dtype=torch.bool, device=self.device)
        stack = torch.zeros((b, self.limits.max_depth), dtype=torch.long, device=self.device)
        sent = torch.arange(b, device=self.device)
        return _State(sent, zeros, zeros, stack, no, zeros, no, no, no, cap, 0)

    def allowed(self, s: _State) -> Tensor:
        rows = s.sent.numel()
        at = torch.arange(rows, device=self.device)
        left = self.total[s.sent] - s.p  # pieces still to write
        room = s.caps[s.sent] - (s.step + 1)  # tokens left after the next one
        live = ~s.dead & ~s.done
        boundary = self.boundary[s.sent, s.p] & live
        mid = live & ~boundary
        piece = self.pieces[s.sent, s.p]
        word = mid | (boundary & (left > 0) & (s.depth >= 1) & (left - 1 + s.depth <= room))
        opens = (
            boundary
            & (left > 0)
            & (s.depth < self.limits.max_depth)
            & (s.opens < self.limits.max_opens)
            & ((s.depth > 0) | ~s.started)
            & (left + s.depth + 1 <= room)
        )
        close = boundary & (s.depth >= 1) & ~s.top_empty & ((s.depth > 1) | (left == 0))
        top = s.stack[at, (s.depth - 1).clamp(min=0)]
        mask = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        mask[:, self.open_ids] = opens.unsqueeze(1)
        # scatter, not boolean indexing: no host-device synchronisation on a GPU
        for col, ok in ((piece, word), (self.close_ids[top], close)):
            col = col.unsqueeze(1)
            mask.scatter_(1, col, mask.gather(1, col) | ok.unsqueeze(1))
        mask[:, EOS_ID] |= s.done & ~s.dead
        s.mask = mask
        return mask

    def advance(self, s: _State, tokens: Tensor, origin: Tensor) -> _State:
        assert s.mask is not None, "advance before allowed"
        g = replace(
            s,
            **{
                k: getattr(s, k)[origin]
                for k in ("sent", "p", "depth", "stack", "top_empty", "opens", "started")
            },
            done=s.done[origin],
            dead=s.dead[origin],
            mask=None,
        )
        ok = s.mask[origin, tokens] & ~g.dead & (tokens != EOS_ID)
        at_boundary = self.boundary[g.sent, g.p]
        label = self.open_label[tokens]
        is_open = ok & at_boundary & (label >= 0)
        is_close = ok & at_boundary & ~is_open & self.is_close[tokens]
        is_piece = ok & ~is_open & ~is_close
        depth_at = g.depth.clamp(max=self.limits.max_depth - 1).unsqueeze(1)
        pushed = torch.where(is_open, label, g.stack.gather(1, depth_at).squeeze(1))
        stack = g.stack.scatter(1, depth_at, pushed.unsqueeze(1))
        depth = g.depth + is_open.long() - is_close.long()
        return _State(
            sent=g.sent,
            p=g.p + is_piece.long(),
            depth=depth,
            stack=stack,
            top_empty=torch.where(is_open, True, torch.where(ok, False, g.top_empty)),
            opens=torch.where(is_open, g.opens + 1, torch.where(ok, 0, g.opens)),
            started=g.started | is_open,
            done=g.done | (is_close & (depth == 0)),
            dead=~ok,
            caps=s.caps,
            step=s.step + 1,
        )
