"""What coarser int8 schemes cost, before any BLEU: each layer's error, and paired F1.

    python benchmarks/int8_quality.py layers --checkpoint par.pt \
        --src test_2016_flickr.en.gz --ref test_2016_flickr.de.gz --pairs 100
    python benchmarks/int8_quality.py paired-f1 --gold test.trees --a int8.trees --b int8r7.trees
    python benchmarks/int8_quality.py pairs --checkpoint par.pt

`layers`: the inputs of every linear layer are captured while the float32 model scores the
first --pairs (source, reference) pairs (teacher forcing, `Translator.score`); each layer's
output is then computed from its quantized weight (per output column) and input (per row)
at the bits of each scheme (w8a8 aiayn's int8, w8a7 its 7-bit activations, w7a8 7-bit
weights, w7a7 both), exactly (the integer products in float64), and its relative error
against float32 (||y_q - y|| / ||y||) averaged over the layer's calls. A layer whose input
is never negative (the FFN's second, after the ReLU) keeps 8 bits in every scheme, as
aiayn's int8 does.

`paired-f1`: two parsers' trees for the same gold trees, scored by aiayn's EVALB; the F1
difference with a 95% interval and a one-sided p from a paired bootstrap over sentences
(2,000 resamples, seed 0).

`pairs`: how many (output column, pair of inputs) of the int8 weights could saturate
`vpmaddubsw` if the activations were offset to u8 (a + 128 in [1, 255], CTranslate2's
scheme): a pair sums past 32,767 only where both weights have one sign and
|w0| + |w1| > 128 (the FFN's second layers left out: their inputs need no offset).
"""

from __future__ import annotations

import argparse
import gzip
import random
from collections import defaultdict
from typing import Any

SCHEMES = {"w8a8": (8, 8), "w8a7": (8, 7), "w7a8": (7, 8), "w7a7": (7, 7)}


def _lines(path: str, n: int) -> list[str]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f, strict=False)]


def layers(args: argparse.Namespace) -> None:
    import torch

    import aiayn
    from aiayn.fast.int8_ops import quantize_per_row

    torch.set_num_threads(1)
    translator = aiayn.Translator.load(args.checkpoint, dtype="fp32")
    captured: list[tuple[str, torch.nn.Linear, torch.Tensor]] = []

    def hook(name: str) -> Any:
        def keep(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
            captured.append((name, module, inputs[0].detach().reshape(-1, module.in_features)))

        return keep

    for name, module in translator.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(hook(name))
    translator.score(_lines(args.src, args.pairs), _lines(args.ref, args.pairs))

    def dequantized(t: torch.Tensor, bits: int) -> torch.Tensor:
        q, scale = quantize_per_row(t.float(), bits=bits)
        return q.double() * scale.double()[:, None]

    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, module, x in captured:
        w = module.weight.detach()
        y = x.double() @ w.double().t()
        nonneg = bool((x >= 0).all())
        for scheme, (w_bits, a_bits) in SCHEMES.items():
            w_bits, a_bits = (8, 8) if nonneg else (w_bits, a_bits)
            y_q = dequantized(x, a_bits) @ dequantized(w, w_bits).t()
            errors[name.split(".")[-1]][scheme].append(float((y_q - y).norm() / y.norm()))
    print("| layer | calls | " + " | ".join(SCHEMES) + " |")
    print("|---|---|" + "---|" * len(SCHEMES))
    for layer, by_scheme in errors.items():
        calls = len(by_scheme["w8a8"])
        means = " | ".join(f"{sum(v) / len(v):.4f}" for v in by_scheme.values())
        print(f"| {layer} | {calls} | {means} |")


def paired_f1(args: argparse.Namespace) -> None:
    from aiayn.scoring.evalb import score_files

    def counts(trees: str) -> list[tuple[int, int, int]]:
        result = score_files(args.gold, trees)
        return [
            (s.matched_brackets, s.gold_brackets, s.test_brackets) if s.status == 0 else (0, 0, 0)
            for s in result.sentences
        ]

    a, b = counts(args.a), counts(args.b)

    def f1(c: list[tuple[int, int, int]], idx: list[int]) -> float:
        matched = sum(c[i][0] for i in idx)
        return 200.0 * matched / max(sum(c[i][1] + c[i][2] for i in idx), 1)

    n = len(a)
    every = list(range(n))
    diff = f1(a, every) - f1(b, every)
    rng = random.Random(0)
    diffs = []
    for _ in range(2000):
        sample = [rng.randrange(n) for _ in range(n)]
        diffs.append(f1(a, sample) - f1(b, sample))
    diffs.sort()
    p = sum(1 for d in diffs if (d <= 0) == (diff > 0)) / len(diffs)
    same = sum(x == y for x, y in zip(a, b, strict=True))
    print(
        f"F1 {f1(a, every):.2f} (a) against {f1(b, every):.2f} (b): a - b {diff:+.2f}, 95% "
        f"interval {diffs[50]:+.2f} to {diffs[1949]:+.2f}, one-sided p {p:.3f}; {same} of {n} "
        "sentences with the same bracket counts"
    )


def pairs(args: argparse.Namespace) -> None:
    import torch

    from aiayn.fast.int8_ops import quantize_per_row

    state = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    state = state.get("model", state)
    total = over = 0
    for name, w in state.items():
        if w.dim() != 2 or not name.endswith("weight") or name.endswith("w_2.weight"):
            continue
        q = quantize_per_row(w.float())[0].int()
        q = torch.nn.functional.pad(q, (0, q.size(1) % 2))
        a, b = q[:, 0::2], q[:, 1::2]
        over += int((((a * b) > 0) & ((a.abs() + b.abs()) > 128)).sum())
        total += a.numel()
    print(f"{args.checkpoint}: {over} of {total} pairs over ({100 * over / total:.2f}%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    lay = sub.add_parser("layers", help="each linear layer's error under each int8 scheme")
    lay.add_argument("--checkpoint", required=True, help="a translation or parsing model")
    lay.add_argument("--src", required=True, help="source sentences (plain or gzip)")
    lay.add_argument("--ref", required=True, help="their references (plain or gzip)")
    lay.add_argument("--pairs", type=int, default=100, help="the first N pairs")
    pf = sub.add_parser("paired-f1", help="paired bootstrap of two parsers' EVALB F1")
    pf.add_argument("--gold", required=True, help="gold trees, one a line")
    pf.add_argument("--a", required=True, help="system A's trees")
    pf.add_argument("--b", required=True, help="system B's trees")
    pr = sub.add_parser("pairs", help="weight pairs that an offset u8 input could saturate")
    pr.add_argument("--checkpoint", required=True, help="a model")
    args = p.parse_args()
    {"layers": layers, "paired-f1": paired_f1, "pairs": pairs}[args.what](args)


if __name__ == "__main__":
    main()
