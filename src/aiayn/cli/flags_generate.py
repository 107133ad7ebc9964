"""The parsers of forced decoding (`score`), of sampling (translate --sampling) and the
--workers flag that translate, parse and serve share."""

from __future__ import annotations

import argparse

from aiayn.cli.formatting import command_parser


def workers_count(text: str) -> int | str:
    """The type of --workers: "auto" or a count >= 1."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor auto") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or auto), got {n}")
    return n


def add_workers_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--workers of translate, parse and serve (`aiayn.decoding.workers.default_workers`)."""
    p.add_argument(
        "--workers",
        type=workers_count,
        default="auto",
        metavar="N",
        help=help + "; auto: on the CPU one per thread PyTorch uses here (the "
        "physical cores, or OMP_NUM_THREADS), 1 on a GPU",
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """translate's sampling flags (docs/api.md, "Sampling")."""
    g = p.add_argument_group(
        "sampling (instead of beam search; back-translation, Edunov et al. 2018)"
    )
    g.add_argument(
        "--sampling",
        action="store_true",
        help="draw each output from the model's distribution instead of searching: "
        "temperature, then --top-k, then --top-p; several per line with --samples; "
        "reproducible for a --seed, whatever the batching",
    )
    g.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="with --sampling: N outputs a line, as 'i ||| text ||| score' lines when N > 1 "
        "(score: the sample's log-probability under the model, length-normalised); "
        "--nbest N means the same (default: 1)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="with --sampling: divide the logits by T > 0 (< 1 sharper, > 1 flatter; "
        "default: 1, the model's distribution)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="with --sampling: draw among the K most probable tokens only (default: 0, all)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="with --sampling: nucleus sampling, among the most probable tokens whose "
        "mass reaches P in (0, 1] (default: 1, all)",
    )
    g.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="with --sampling: the random seed; line i's samples come from a stream "
        "seeded by (S, i) (default: 0)",
    )


def add_score(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = command_parser(
        sub,
        "score",
        "score given translations: each pair's log-probability under the model",
        """\
Forced decoding (fairseq's --score-reference, marian-scorer): for each line pair the
model's log-probability of the reference given the source, by teacher forcing, as
tab-separated columns:
  total       log P(ref | src), natural log, over the reference's subwords and EOS
  per_token   total / tokens
  normalized  total / ((5 + tokens) / 6) ** alpha, the beam search's score
  tokens      the reference's subwords + 1 (EOS)
One line per pair in input order (--json: a JSON object a line). A JSON summary goes to
stderr: pairs, tokens, the mean per-token log-probability and the perplexity.

examples:
  aiayn score --checkpoint runs/tiny/averaged.pt \\
      --src data/multi30k/test_2016_flickr.en.gz --ref data/multi30k/test_2016_flickr.de.gz
  aiayn score --checkpoint a.pt --src test.en --ref test.hyp --json --output scores.jsonl""",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        action="extend",
        metavar="FILE.pt",
        help="a model; several (same vocabulary) score as an ensemble: the mean of their "
        "next-token probabilities",
    )
    p.add_argument("--src", required=True, metavar="FILE", help="sources, plain or gzip")
    p.add_argument(
        "--ref",
        required=True,
        metavar="FILE",
        help="the texts to score, a line per source line, plain or gzip",
    )
    p.add_argument("--output", metavar="FILE", help="the scores (default: stdout)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an --output file that is a checkpoint or gzip file",
    )
    p.add_argument("--json", action="store_true", help="a JSON object a line instead of columns")
    p.add_argument(
        "--alpha",
        type=float,
        help="length penalty of the normalized column (default: the checkpoint's; paper: 0.6)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="TOKENS",
        help="tokens per batch, the longer side of each pair (default: the checkpoint's)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["auto", "fp32", "bf16", "int8"],
        help="precision: fp32 (the default: scores are measurements) or, as for "
        "translate, auto, bf16, int8",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    return p
