"""What the tree constraint costs a beam-search step (issue 70: at most 10% of decoding).

A constrained search does the unconstrained search's work plus, each step, the
constraint's `allowed` (an (R, V) mask), `reweigh` (with word_mass: each row's mass of
word pieces) and `advance` (the state gathered by the beam's rows), and picks its top k
from a masked table with PyTorch ops instead of the speed paths' compiled `lse_topk`.
This measures each part on the parser's shapes (Transformer-Tiny: N = 4, d_model 128,
V 4,000; beam 21; sentences of the given words file), as one search:

- the constrained search's total time, and the share of it inside the constraint's calls
  (timed around each call);
- the top-k of one step's (R, V) logits by the unconstrained path (`best_next_tokens`'
  compiled or PyTorch path) and by the masked path, on the same table;

so the overhead per step is (constraint calls + masked top-k - unmasked top-k) over the
unconstrained step. Weights are random (a step's cost does not depend on them); with
--checkpoint a trained model and its vocabulary are used instead.

    python benchmarks/bench_constraint.py --input RUN/data/ptb/dev.words [--checkpoint CKPT]
        [--sentences 64] [--beam 21] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.decoding import search
from aiayn.decoding.parse import sentence_words
from aiayn.decoding.search import beam_search
from aiayn.decoding.translate import pad_batch
from aiayn.decoding.tree_constraint import Brackets, TreeConstraint, TreeLimits
from aiayn.files import read_lines
from aiayn.model import Transformer


class Timed:
    """A constraint whose `allowed` and `advance` calls are timed."""

    def __init__(self, inner: TreeConstraint) -> None:
        self.inner, self.seconds, self.steps = inner, 0.0, 0

    def start(self, caps):  # type: ignore[no-untyped-def]
        return self.inner.start(caps)

    def allowed(self, state):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        mask = self.inner.allowed(state)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return mask

    @property
    def reweigh(self):  # type: ignore[no-untyped-def]
        # called inside the masked top-k, whose time counts it
        return self.inner.reweigh

    def advance(self, state, tokens, origin):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = self.inner.advance(state, tokens, origin)
        self.seconds += time.perf_counter() - t0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input", required=True, type=Path, help="sentences (treebank words)")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--beam", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--word-mass",
        action="store_true",
        help="score words as one action (recipe.word_mass)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab, labels = 4000, 26
    model = Transformer(
        ModelConfig(N=4, d_model=128, d_ff=256, h=4, d_k=32, d_v=32, vocab_size=vocab)
    ).eval()
    brackets = Brackets(
        tuple(f"L{i}" for i in range(labels)),
        tuple(range(10, 10 + labels)),
        tuple(range(10 + labels, 10 + 2 * labels)),
    )
    lines = list(read_lines(args.input))[: args.sentences]
    # each word one or two pieces, ids from the rest of the vocabulary (what a 4,000-piece
    # vocabulary gives WSJ words: ~1.2 pieces a word)
    gen = torch.Generator().manual_seed(1)
    pieces = [
        [
            torch.randint(
                100, vocab, (1 + int(torch.rand(1, generator=gen) < 0.2),), generator=gen
            ).tolist()
            for _ in sentence_words(line)
        ]
        for line in lines
    ]
    src = pad_batch([[i for w in p for i in w] + [2] for p in pieces], "cpu")
    limits = TreeLimits(28, 6)  # the sample's training trees
    masked_topk = search._masked_topk
    spent = {"masked": 0.0, "plain": 0.0}

    def timed_topk(logits, k, exclude, allowed, reweigh=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = masked_topk(logits, k, exclude, allowed, reweigh)
        t1 = time.perf_counter()
        # what the unconstrained search does with the same logits: its top-k path
        search.logits_topk(logits, k, exclude)
        t2 = time.perf_counter()
        spent["masked"] += t1 - t0
        spent["plain"] += t2 - t1
        return out

    search._masked_topk = timed_topk  # type: ignore[assignment]
    results = []
    for _ in range(args.rounds):
        spent.update(masked=0.0, plain=0.0)
        timed = Timed(TreeConstraint(pieces, brackets, vocab, limits, word_mass=args.word_mass))
        t0 = time.perf_counter()
        beam_search(model, src, args.beam, 0.3, 1.0, 300, constraint=timed)
        total = time.perf_counter() - t0
        # an unconstrained search of the same steps: no constraint calls, the plain top-k
        unconstrained = total - timed.seconds - spent["masked"]
        overhead = timed.seconds + spent["masked"] - spent["plain"]
        results.append(
            {
                "sentences": len(lines),
                "beam": args.beam,
                "steps": timed.steps,
                "search_s": total,
                "constraint_calls_s": timed.seconds,
                "topk_masked_s": spent["masked"],
                "topk_plain_s": spent["plain"],
                "unconstrained_equivalent_s": unconstrained,
                "overhead_fraction": overhead / unconstrained,
                "threads": args.threads,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    best = min(results, key=lambda x: x["overhead_fraction"])
    summary = {"rounds": results, "best_overhead_fraction": best["overhead_fraction"]}
    print(json.dumps({"best_overhead_fraction": best["overhead_fraction"]}))
    if args.json:
        args.json.write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
