"""Parsing's decoding speed against translation's, per output token, on one model.

Parsing is translation whose target is a linearized tree, plus the rebuild of each output
into a tree (`aiayn.decoding.parse`). This times both on the same checkpoint, sentences
and settings, interleaved round by round (this machine's speed drifts by ~10% over minutes):
`translate_lines` (the search alone) and `parse_lines` (the search, the rebuild, the repair
counts). Their output tokens are the same, so the ratio of tokens per second is what parsing
costs beyond translation.

    python benchmarks/parse_speed.py --checkpoint RUN/checkpoint_avg.pt \\
        --input RUN/data/ptb/dev.words --sentences 100 --beam 21 --beam 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from aiayn.checkpoints import load_ensemble
from aiayn.decoding.ensemble import as_decoder
from aiayn.decoding.parse import parse_lines, sentence_words
from aiayn.decoding.translate import translate_lines
from aiayn.experiments.manifest import environment
from aiayn.files import read_lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path, help="a parsing model")
    ap.add_argument("--input", required=True, type=Path, help="sentences, a line each")
    ap.add_argument("--sentences", type=int, default=100, help="the first N lines (default 100)")
    ap.add_argument("--beam", type=int, action="append", help="beam sizes (repeatable; default 21)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    models, tokenizer, cfg = load_ensemble([args.checkpoint])
    model = as_decoder(models)
    lines = list(read_lines(args.input))[: args.sentences]
    sources = [" ".join(sentence_words(x)) for x in lines]
    rows = []
    for beam in args.beam or [21]:
        decode = replace(cfg.decode, beam=beam, nbest=1)
        times: dict[str, list[float]] = {"translate": [], "parse": []}
        tokens = 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            raw = translate_lines(model, tokenizer, sources, decode)
            times["translate"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            result = parse_lines(model, tokenizer, lines, decode, constrained=False)
            times["parse"].append(time.perf_counter() - t0)
            assert result.raw == raw  # the same search, the same outputs
            tokens = result.output_tokens
        best = {k: min(v) for k, v in times.items()}
        row = {
            "beam": beam,
            "alpha": decode.alpha,
            "sentences": len(lines),
            "output_tokens": tokens,
            "translate_s": best["translate"],
            "parse_s": best["parse"],
            "translate_tokens_per_s": tokens / best["translate"],
            "parse_tokens_per_s": tokens / best["parse"],
            "parse_sentences_per_s": len(lines) / best["parse"],
            "parse_over_translate_time": best["parse"] / best["translate"],
            "ill_formed": len(result.ill_formed),
        }
        rows.append(row)
        print(
            f"beam {beam}: {len(lines)} sentences, {tokens} output tokens; translate "
            f"{row['translate_tokens_per_s']:.0f} tokens/s, parse {row['parse_tokens_per_s']:.0f} "
            f"tokens/s ({row['parse_sentences_per_s']:.2f} sentences/s); parse/translate time "
            f"{row['parse_over_translate_time']:.3f} (best of {args.rounds} rounds)"
        )
    if args.json:
        record = {"rows": rows, "threads": torch.get_num_threads(), **environment()}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
