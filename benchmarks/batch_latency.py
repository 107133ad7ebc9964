"""Decoding at the batch sizes a server and an interactive user see: aiayn against
CTranslate2, one thread each, interleaved in one process.

    python benchmarks/batch_latency.py --presets tiny,base --batches 1,16,64 --beams 4,1
    python benchmarks/batch_latency.py --checkpoint RUN/checkpoint_avg.pt \
        --input ../shared/data/multi30k/test_2016_flickr.en.gz --batches 1,16,64

Each system decodes the same sources in batches of --batches sentences, one after the other
(a batch of 1 is one sentence at a time: the latency of one request). Presets: the bench
model (`aiayn.experiments.bench.random_model`, random weights, vocabulary 8,000) on random
sources of 12-16 tokens, every output forced to --out-len tokens, as `benchmarks/compare.py`
does. A checkpoint: its own weights on the first sentences of --input (encoded by its
tokenizer), outputs as long as each engine's search makes them (the mean length is printed
beside the rate). --per-layer adds aiayn with the decoder step as PyTorch operators
(`AIAYN_NATIVE_STEP=0`, the path before the one-call step); --python-search adds aiayn
with the one-call step under search.py's loop (the compiled search, csrc/beam_search.c,
switched off). CTranslate2 runs aiayn's
model converted (`aiayn.deploy.export`) in each compute type given, `intra_threads=1`;
aiayn runs `beam_search`/`greedy_search` on the fast model
(`aiayn.fast.machine.cast_for_inference`) with `torch.set_num_threads(1)`.
Rounds repeat the whole plan; the table keeps each cell's rounds and the ratio of aiayn's
best to CTranslate2's best compute type's best.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 8000


def sources(args: argparse.Namespace, name: str, n: int) -> tuple[Any, list[list[int]], int]:
    """(aiayn model in float32, source id lists with EOS, forced output length or 0)."""
    from aiayn.config import EOS_ID, PAD_ID
    from aiayn.experiments.bench import random_batch, random_model

    if name == "checkpoint":
        import itertools

        from aiayn.deploy.export import load_for_export
        from aiayn.files import read_lines

        model, tokenizer, _ = load_for_export(args.checkpoint)
        lines = list(itertools.islice(read_lines(args.input), n))
        ids = [tokenizer.encode(x)[:200] + [EOS_ID] for x in lines]
        return model, ids, 0
    src = random_batch(n, VOCAB, seed=3)
    return (
        random_model(name, VOCAB).eval(),
        [[t for t in row.tolist() if t != PAD_ID] for row in src],
        args.out_len,
    )


def pad(rows: list[list[int]]) -> torch.Tensor:
    from aiayn.config import PAD_ID

    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])


def cast_dtype(model: Any, dtype: str) -> Any:
    """A copy of `model` cast for inference in `dtype`; "int8-r7" is int8 with its inputs
    quantized to 7 bits (AIAYN_INT8_ACTIVATIONS=7, read while casting)."""
    from aiayn.fast.machine import cast_for_inference

    before = os.environ.get("AIAYN_INT8_ACTIVATIONS")
    os.environ["AIAYN_INT8_ACTIVATIONS"] = "7" if dtype == "int8-r7" else "8"
    try:  # casts in place
        return cast_for_inference(copy.deepcopy(model), dtype.removesuffix("-r7"))
    finally:
        if before is None:
            del os.environ["AIAYN_INT8_ACTIVATIONS"]
        else:
            os.environ["AIAYN_INT8_ACTIVATIONS"] = before


def aiayn_run(model: Any, ids: list[list[int]], batch: int, beam: int, out_len: int) -> list[int]:
    from aiayn.decoding.search import beam_search, greedy_search

    lengths = []
    for i in range(0, len(ids), batch):
        src = pad(ids[i : i + batch])
        cap = (0.0, out_len) if out_len else (1.0, 50)
        with torch.inference_mode():
            if beam == 1:
                hyps = greedy_search(model, src, 0.0 if out_len else 1.0, cap[1], min_len=out_len)
                lengths += [len(h) for h in hyps]
            else:
                found = beam_search(model, src, beam, 0.6, *cap, min_len=out_len)
                lengths += [len(h[0].tokens) for h in found]
    return lengths


def ct2_run(
    translator: Any, toks: list[list[str]], batch: int, beam: int, out_len: int
) -> list[int]:
    options: dict[str, Any] = dict(max_batch_size=batch, beam_size=beam, length_penalty=0.6)
    if out_len:
        options.update(min_decoding_length=out_len, max_decoding_length=out_len)
    else:
        options.update(max_input_length=0)
    lengths = []
    for i in range(0, len(toks), batch):
        if not out_len:  # aiayn's cap, input + 50 (the longest input's, for a batch)
            options["max_decoding_length"] = max(len(t) for t in toks[i : i + batch]) + 50
        res = translator.translate_batch(toks[i : i + batch], **options)
        lengths += [len(r.hypotheses[0]) for r in res]
    return lengths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,base", help="bench model presets ('' for none)")
    p.add_argument("--checkpoint", help="also a trained model (with --input)")
    p.add_argument("--input", help="--checkpoint's source sentences (plain or gzip)")
    p.add_argument("--batches", default="1,16,64", help="sentences per search")
    p.add_argument("--beams", default="4,1", help="beam sizes (1: greedy)")
    p.add_argument(
        "--dtypes",
        default="int8,fp32",
        help="aiayn's precisions (int8-r7: int8 with 7-bit activations, AIAYN_INT8_ACTIVATIONS=7)",
    )
    p.add_argument("--ct2", default="int8,float32", help="CTranslate2's compute types")
    p.add_argument("--out-len", type=int, default=20, help="presets: outputs forced to this")
    p.add_argument(
        "--seconds",
        type=float,
        default=3.0,
        help="about this long per cell: the sentences are sized by a first pass",
    )
    p.add_argument("--rounds", type=int, default=2, help="repeat the whole plan, interleaved")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="also aiayn with the step as PyTorch operators (AIAYN_NATIVE_STEP=0): the "
        "path before the one-call step",
    )
    p.add_argument(
        "--python-search",
        action="store_true",
        help="also aiayn with the one-call step and the search's loop in Python (the "
        "compiled search off)",
    )
    p.add_argument("--json", help="also write every record here")
    args = p.parse_args()
    import ctranslate2

    from aiayn import speed
    from aiayn.decoding.search import NEVER_GENERATED
    from aiayn.deploy.export import to_ctranslate2, vocabulary

    torch.set_num_threads(1)
    names = [x for x in args.presets.split(",") if x] + (["checkpoint"] if args.checkpoint else [])
    batches = [int(x) for x in args.batches.split(",")]
    beams = [int(x) for x in args.beams.split(",")]
    records: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory()
    setups = {}
    for name in names:
        model, ids, out_len = sources(args, name, 1024)
        # one string per id (placeholders are enough: both engines read the ids), the
        # sources passed with their EOS, as benchmarks/compare.py does
        table = vocabulary(model.cfg.vocab_size)
        out = to_ctranslate2(model, Path(tmp.name) / name, table, never_generate=NEVER_GENERATED)
        systems: dict[str, Any] = {}
        for dtype in args.dtypes.split(","):
            fast = cast_dtype(model, dtype)
            systems[f"aiayn {dtype}"] = ("aiayn", fast)
            if args.per_layer:
                systems[f"aiayn {dtype} per-layer"] = ("per-layer", fast)
            if args.python_search:
                systems[f"aiayn {dtype} python-search"] = ("python-search", fast)
        for ct in [x for x in args.ct2.split(",") if x]:
            systems[f"CT2 {ct}"] = (
                "ct2",
                ctranslate2.Translator(str(out), device="cpu", compute_type=ct, intra_threads=1),
            )
        toks = [[table[t] for t in row] for row in ids]
        setups[name] = (ids, toks, out_len, systems)

    def run(kind: str, engine: Any, ids: list, toks: list, batch: int, beam: int, out_len: int):
        if kind in ("aiayn", "per-layer", "python-search"):
            os.environ["AIAYN_NATIVE_STEP"] = "0" if kind == "per-layer" else ""
            if kind != "python-search":
                return aiayn_run(engine, ids, batch, beam, out_len)
            whole = speed.IMPLEMENTATIONS.pop("whole_search", None)
            try:
                return aiayn_run(engine, ids, batch, beam, out_len)
            finally:
                if whole is not None:
                    speed.IMPLEMENTATIONS["whole_search"] = whole
        return ct2_run(engine, toks, batch, beam, out_len)

    sizes: dict[tuple[str, int, int], int] = {}
    for name, (ids, toks, out_len, systems) in setups.items():  # warm up and size each cell
        for batch in batches:
            for beam in beams:
                rate = []
                for kind, engine in systems.values():
                    n = batch * 2
                    t0 = time.perf_counter()
                    run(kind, engine, ids[:n], toks[:n], batch, beam, out_len)
                    rate.append(n / (time.perf_counter() - t0))
                n = int(args.seconds * statistics.median(rate)) // batch * batch
                sizes[name, batch, beam] = min(len(ids) // batch * batch, max(batch, n))
    for r in range(args.rounds):
        for name, (ids, toks, out_len, systems) in setups.items():
            for batch in batches:
                for beam in beams:
                    n = sizes[name, batch, beam]
                    for system, (kind, engine) in systems.items():
                        t0 = time.perf_counter()
                        lengths = run(kind, engine, ids[:n], toks[:n], batch, beam, out_len)
                        t = time.perf_counter() - t0
                        rec = {
                            "round": r,
                            "model": name,
                            "batch": batch,
                            "beam": beam,
                            "system": system,
                            "sentences": n,
                            "sentences_per_s": n / t,
                            "ms_per_sentence": 1e3 * t / n,
                            "mean_out_len": statistics.mean(lengths),
                        }
                        records.append(rec)
                        print(json.dumps(rec), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print()
    print("| model | batch | beam | system | sentences/s (rounds) | mean output | vs CT2's best |")
    print("|---|---|---|---|---|---|---|")
    for name in setups:
        for batch in batches:
            for beam in beams:
                cell = [
                    x for x in records if (x["model"], x["batch"], x["beam"]) == (name, batch, beam)
                ]
                best_ct2 = max(
                    (x["sentences_per_s"] for x in cell if x["system"].startswith("CT2")),
                    default=float("nan"),
                )
                for system in setups[name][3]:
                    rows = [x for x in cell if x["system"] == system]
                    rates = " / ".join(f"{x['sentences_per_s']:.1f}" for x in rows)
                    best = max(x["sentences_per_s"] for x in rows)
                    aiayn = system.startswith("aiayn") and best_ct2 == best_ct2  # not NaN
                    ratio = f"{best / best_ct2:.2f}x" if aiayn else ""
                    print(
                        f"| {name} | {batch} | {beam} | {system} | {rates} | "
                        f"{statistics.mean(x['mean_out_len'] for x in rows):.1f} | {ratio} |"
                    )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
