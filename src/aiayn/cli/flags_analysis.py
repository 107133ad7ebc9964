"""The parsers of the analysis commands: table1 (Table 1 measured) and attention (the
attention figures)."""

from __future__ import annotations

import argparse

from aiayn.cli.formatting import command_parser

#: Table 1's layer kinds (aiayn.analysis.layers.KINDS, not imported: the parser stays
#: free of torch; tests/analysis/test_table1.py checks that the two agree).
KINDS = "self-attention,recurrent,convolutional,separable,restricted"


def add_table1(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "table1",
        "measure Table 1: cost per layer, sequential operations, maximum path length",
        """\
One layer of each kind Table 1 compares, at one width d: self-attention (aiayn's
MultiHeadAttention), recurrent (an LSTM), convolutional (a causal kernel-k Conv1d),
separable convolution (depthwise kernel k + pointwise) and restricted self-attention
(each position attends to the r positions centred on it). For n = n-min, 2 n-min, ...,
n-max it measures the time of one forward + backward pass (the median of --repeats),
the FLOPs PyTorch counts (matrix products and convolutions; the LSTM's on the same
weights unrolled into n cell steps, since its fused kernel is opaque to the counter)
and memory (CPU: the bytes of the activations autograd saves; CUDA: the peak
allocated), and fits each to n^p on the large-n half of the grid.

Sequential operations: the longest chain of dependent ops PyTorch runs in one layer's
forward, at path-n/4, path-n/2 and path-n (constant: O(1); growing per position: O(n)).
Maximum path length: the fewest stacked layers after which output n depends on input 1
(forward-mode derivative from input 1, at n = path-n): self-attention 1, a contiguous
causal convolution ceil((n-1)/(k-1)), a dilated one (dilation k^l in layer l)
ceil(log_k n), restricted attention ceil((n-1)/((r-1)/2)); the LSTM connects them in
one layer through n cell steps (counted as the steps every dependency passes through).

It prints the paper's table with the measurement beside each formula and where
self-attention's FLOPs and time overtake the LSTM's (the paper: when n > d), and writes
table1.csv, table1.json and table1.png (log-log: time, FLOPs, memory against n) to
--out. Runtime on an idle 2-core AMD EPYC VM: the defaults 34 s (1.3 GiB of
memory); --d 128 --batch 4 (enough work a pass for the cheap layers' exponents to
show: docs/analysis.md) 1 min 46 s.

examples:
  aiayn table1 --out runs/table1
  aiayn table1 --d 128 --batch 4 --out runs/table1-d128
  aiayn table1 --d 128 --n-max 2048 --repeats 3 --out runs/table1-d128 --json
  aiayn table1 --n-min 16 --n-max 256 --repeats 1 --out /tmp/t1   # a quick look
  aiayn table1 --device cuda --n-max 16384 --out runs/table1-gpu""",
    )
    p.add_argument("--d", type=int, default=64, help="the width of every layer (d_model)")
    p.add_argument(
        "--heads", type=int, default=4, metavar="H", help="heads of the attention layers (h)"
    )
    p.add_argument("--kernel", type=int, default=3, metavar="K", help="the convolutions' kernel k")
    p.add_argument(
        "--r",
        type=int,
        default=9,
        help="restricted self-attention's neighbourhood: the r (odd) positions centred on "
        "each query",
    )
    p.add_argument("--n-min", type=int, default=16, metavar="N", help="shortest sequence length")
    p.add_argument(
        "--n-max",
        type=int,
        default=4096,
        metavar="N",
        help="longest (n doubles from --n-min up to it)",
    )
    p.add_argument("--batch", type=int, default=1, metavar="B", help="sequences per pass")
    p.add_argument(
        "--repeats", type=int, default=5, metavar="R", help="timed passes per point (the median)"
    )
    p.add_argument("--warmup", type=int, default=1, metavar="W", help="untimed passes before them")
    p.add_argument(
        "--path-n",
        type=int,
        default=64,
        metavar="N",
        help="the n at which sequential operations and path lengths are measured",
    )
    p.add_argument(
        "--kinds",
        metavar="KIND,...",
        help="the layer kinds to measure, comma-separated (default: all: "
        + KINDS.replace(",", ", ")
        + ")",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="CPU threads for PyTorch; one by default: on a 2-core machine shared with other "
        "work, two threads waiting on each other stalled single passes from milliseconds "
        "to seconds, and the exponents need no speed",
    )
    p.add_argument(
        "--out", default="runs/table1", metavar="DIR", help="where the CSV, JSON and PNG go"
    )
    p.add_argument("--json", action="store_true", help="print every number as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def add_attention(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "attention",
        "draw a model's attention weights for a sentence (Figures 3-5)",
        """\
Translates --text with the checkpoint (beam search with its options, or --beam), then
runs the model teacher-forced on the sentence and its translation, recording every
head of every encoder self-attention, decoder self-attention and encoder-decoder
attention layer. Writes to --out, for each layer (or --layer only):
  encoder_self_layerL.png, decoder_self_layerL.png, encoder_decoder_layerL.png
      heat maps, a panel per head (or --head only), the subword tokens on the axes
      (queries down, keys across; 0 white, 1 dark)
  encoder_lines_layerL.png
      each encoder head as lines from every word to the words it attends to, as
      opaque as the weight (the paper's Figures 4-5)
  word_layerL.png (with --word)
      one source word's attention in every head, a colour per head (Figure 3)
  attention.json (with --json)
      the token ids and subwords, the translation and every weight:
      encoder_self[layer][head][query][key], decoder_self, encoder_decoder
      (lists from layer 1, head 1)

The decoder's tokens are its inputs, <s> and the translation: row t predicts token
t+1. Layers and heads count from 1, as the paper's "layer 5 of 6" does. Runtime on a
2-core AMD EPYC VM: 13 s (idle) for the En-De recipe's model (N=4, h=4: 20 pictures, about a
second each in matplotlib); --layer draws a quarter of them.

examples:
  aiayn attention --checkpoint runs/en-de/checkpoint_avg.pt \\
      --text "A man in an orange hat is looking at a dog." --out runs/attention
  aiayn attention --checkpoint runs/en-de/checkpoint_avg.pt --text "The dog ran." \\
      --layer 3 --word dog --out runs/attention-dog --json""",
    )
    p.add_argument("--checkpoint", required=True, metavar="FILE.pt", help="a model")
    p.add_argument("--text", required=True, help="the source sentence")
    p.add_argument("--out", required=True, metavar="DIR", help="where the PNGs (and JSON) go")
    p.add_argument(
        "--layer", type=int, metavar="L", help="draw layer L (1..N) only (default: every layer)"
    )
    p.add_argument(
        "--head", type=int, metavar="H", help="draw head H (1..h) only (default: every head)"
    )
    p.add_argument(
        "--word",
        metavar="W",
        help="also draw this source word's attention across heads: a subword as the "
        "vocabulary writes it (with or without its leading '▁'; the first match) or its "
        "1-based position (default: none)",
    )
    p.add_argument(
        "--beam",
        type=int,
        help="beam size of the translation (default: the checkpoint's; 1: greedy)",
    )
    p.add_argument("--json", action="store_true", help="also write attention.json")
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["auto", "fp32", "bf16", "int8"],
        help="inference precision, as for translate; float32 by default, unlike translate's "
        "auto: the pictures show the weights as the model computes them, not as a faster "
        "precision rounds them",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    return p
