"""aiayn against the systems users would pick instead, on identical shapes, in one run.

    pip install -e '.[bench]'            # transformers (and ctranslate2, when it is used)
    python benchmarks/compare.py         # tiny and base, training and decoding
    python benchmarks/compare.py --presets base --what train --dtypes bf16 --rounds 2
    AIAYN_CPU_ISA=avx2 python benchmarks/compare.py --dtypes auto  # as on an AVX2-only CPU

Peers are built from configs with random weights (never downloaded):
- HF MarianMTModel configured as the paper's model (post-norm, sinusoidal positions,
  shared and scaled embeddings, ReLU), with eager and sdpa attention.
- CTranslate2 (decoding only) running aiayn's own random-weight model, converted with
  `aiayn.deploy.export.to_ctranslate2`, at its float32 and int8 compute types (it has no bf16 on
  a CPU). It decodes the same weights as aiayn, so the work per sentence is identical.
Each measurement runs in its own process (so that max_rss_gib is its own), with the same
allocator settings for all, and the systems alternate within each round: the machine's
speed drifts by ~10% over minutes, so only measurements of one run compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "536870912",
}
VOCAB = 10_000


def hf_model(preset: str, attn: str) -> Any:
    """HF MarianMTModel laid out as the paper's Transformer, random weights."""
    from transformers import MarianConfig, MarianMTModel

    from aiayn.config import get_preset

    m = get_preset(preset).model
    config = MarianConfig(
        vocab_size=VOCAB,
        decoder_vocab_size=VOCAB,
        d_model=m.d_model,
        encoder_layers=m.N,
        decoder_layers=m.N,
        encoder_attention_heads=m.h,
        decoder_attention_heads=m.h,
        encoder_ffn_dim=m.d_ff,
        decoder_ffn_dim=m.d_ff,
        activation_function="relu",
        dropout=m.P_drop,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=512,
        scale_embedding=True,
        pad_token_id=0,
        eos_token_id=3,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )
    import torch

    torch.manual_seed(0)
    config._attn_implementation = attn
    return MarianMTModel(config)


def hf_train(
    preset: str,
    dtype: str,
    attn: str,
    steps: int,
    warmup: int = 3,
    device: str = "cpu",
    batch: int = 291,
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from aiayn.config import BOS_ID, EOS_ID, PAD_ID
    from aiayn.experiments.bench import _timed, max_rss_gib, random_batch

    dev = torch.device(device)
    model = hf_model(preset, attn).to(dev).train()
    # fused Adam where PyTorch has it for the device, as aiayn's optimizer
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    src = random_batch(batch, VOCAB, seed=1).to(dev)
    tgt = random_batch(batch, VOCAB, seed=2).to(dev)
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS_ID), tgt[:, :-1]], dim=1)
    tgt_in = tgt_in.masked_fill(tgt_in == EOS_ID, PAD_ID)
    n_tokens = int((src != PAD_ID).sum() + (tgt != PAD_ID).sum())

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(
                input_ids=src,
                attention_mask=src != PAD_ID,
                decoder_input_ids=tgt_in,
                decoder_attention_mask=tgt_in != PAD_ID,
            ).logits
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), tgt.flatten(), ignore_index=PAD_ID, label_smoothing=0.1
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t = statistics.median(_timed(step, steps, warmup, dev))
    return {
        "tokens_per_s": n_tokens / t,
        "seconds_per_step": t,
        "max_rss_gib": max_rss_gib(),
        "batch_sentences": batch,
        "device": device,
    }


def hf_decode(
    preset: str,
    dtype: str,
    attn: str,
    beam: int,
    out_len: int,
    sentences: int = 500,
    batch: int = 64,
    device: str = "cpu",
) -> dict[str, Any]:
    import torch

    from aiayn.config import PAD_ID
    from aiayn.experiments.bench import _sync, max_rss_gib, random_batch

    dev = torch.device(device)
    model = hf_model(preset, attn).to(dev).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    src = random_batch(sentences, VOCAB, seed=3).to(dev)

    def run() -> None:
        with torch.inference_mode():
            for i in range(0, sentences, batch):
                chunk = src[i : i + batch]
                model.generate(
                    input_ids=chunk,
                    attention_mask=chunk != PAD_ID,
                    num_beams=beam,
                    do_sample=False,
                    min_new_tokens=out_len,
                    max_new_tokens=out_len,
                    length_penalty=0.6 if beam > 1 else 1.0,
                )

    run_small = src[:batch]
    model.generate(
        input_ids=run_small,
        attention_mask=run_small != PAD_ID,
        num_beams=beam,
        max_new_tokens=2,
        min_new_tokens=2,
    )  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    run()
    _sync(dev)
    t = time.perf_counter() - t0
    return {
        "sentences_per_s": sentences / t,
        "seconds": t,
        "max_rss_gib": max_rss_gib(),
        "device": device,
    }


def ct2_decode(
    preset: str,
    compute_type: str,
    beam: int,
    out_len: int,
    sentences: int = 500,
    batch: int = 64,
    workers: int = 1,
) -> dict[str, Any]:
    """CTranslate2 on aiayn's bench model (same seed, same sources as `aiayn bench decode`).

    workers > 1: its counterpart of aiayn's workers, `inter_threads` (batches decoded in
    parallel) with the threads divided among them."""
    import tempfile

    import ctranslate2
    import torch

    from aiayn.config import PAD_ID
    from aiayn.deploy.export import to_ctranslate2, vocabulary
    from aiayn.experiments.bench import max_rss_gib, random_batch, random_model

    model = random_model(preset, VOCAB).eval()
    tokens = vocabulary(VOCAB)
    src = random_batch(sentences, VOCAB, seed=3)
    batch_tokens = [[tokens[t] for t in row.tolist() if t != PAD_ID] for row in src]
    with tempfile.TemporaryDirectory() as tmp:
        to_ctranslate2(model, tmp)
        del model
        translator = ctranslate2.Translator(
            tmp,
            device="cpu",
            compute_type=compute_type,
            intra_threads=max(1, torch.get_num_threads() // workers),
            inter_threads=workers,
        )
    options = dict(
        max_batch_size=batch,
        beam_size=beam,
        length_penalty=0.6,
        min_decoding_length=out_len,
        max_decoding_length=out_len,
    )
    translator.translate_batch(
        batch_tokens[:batch], **{**options, "min_decoding_length": 2, "max_decoding_length": 2}
    )  # warm-up
    t0 = time.perf_counter()
    results = translator.translate_batch(batch_tokens, **options)
    t = time.perf_counter() - t0
    lengths = [len(r.hypotheses[0]) for r in results]
    return {
        "sentences_per_s": sentences / t,
        "seconds": t,
        "max_rss_gib": max_rss_gib(),
        "mean_out_len": statistics.mean(lengths),
    }


def aiayn_measure(
    kind: str,
    preset: str,
    dtype: str,
    steps: int,
    beam: int,
    out_len: int,
    workers: int = 1,
    device: str = "cpu",
    batch: int = 291,
) -> dict[str, Any]:
    from aiayn.experiments.bench import bench_decode, bench_train

    if kind == "train":
        return bench_train(preset, dtype, device, steps=steps, batch=batch)
    return bench_decode(
        preset, dtype, device, beam=beam, out_len=out_len, peak=True, workers=workers
    )


def one(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement (in this process) and return its record."""
    system, kind = spec["system"], spec["kind"]
    device, batch = spec.get("device", "cpu"), spec.get("batch", 291)
    if system == "aiayn":
        r = aiayn_measure(
            kind,
            spec["preset"],
            spec["dtype"],
            spec["steps"],
            spec["beam"],
            spec["out_len"],
            spec.get("workers", 1),
            device,
            batch,
        )
    elif system == "ctranslate2":
        r = ct2_decode(
            spec["preset"],
            spec["attn"],
            spec["beam"],
            spec["out_len"],
            workers=spec.get("workers", 1),
        )
    elif kind == "train":
        r = hf_train(
            spec["preset"], spec["dtype"], spec["attn"], spec["steps"], device=device, batch=batch
        )
    else:
        r = hf_decode(
            spec["preset"],
            spec["dtype"],
            spec["attn"],
            spec["beam"],
            spec["out_len"],
            device=device,
        )
    return {**spec, **r}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **MALLOC_ENV, "AIAYN_NO_MALLOC_TUNING": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        return {**spec, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = []
    for preset in args.presets.split(","):
        for kind in args.what.split(","):
            for dtype in args.dtypes.split(","):
                base = {
                    "kind": kind,
                    "preset": preset,
                    "dtype": dtype,
                    "steps": args.steps,
                    "beam": args.beam,
                    "out_len": args.out_len,
                    "device": args.device,
                }
                if kind == "train":
                    base["batch"] = args.batch_sentences
                if kind == "train" and dtype == "int8":
                    continue
                workers = {"workers": args.workers} if kind == "decode" else {}
                specs.append({**base, **workers, "system": "aiayn", "attn": "aiayn"})
                if dtype == "int8":  # aiayn's dynamic quantization; HF has no such mode here
                    continue
                for attn in args.hf_attn.split(","):
                    specs.append({**base, "system": "hf-marian", "attn": attn})
            if kind == "decode" and args.ct2 and args.device == "cpu":
                # Compared with every aiayn dtype row: its own compute types, once per preset.
                for compute_type in args.ct2.split(","):
                    specs.append(
                        {
                            "kind": kind,
                            "preset": preset,
                            "dtype": "any",
                            "steps": args.steps,
                            "beam": args.beam,
                            "out_len": args.out_len,
                            "system": "ctranslate2",
                            "attn": compute_type,
                            "workers": args.workers,
                        }
                    )
    return specs


def table(records: list[dict[str, Any]]) -> str:
    """One row per measurement; aiayn's rows carry their ratios to the peers: the best HF
    setting of the same dtype and, for decoding, each CTranslate2 compute type (with
    --rounds, the best measurement of each peer in the run: the conservative ratio)."""
    rows = [
        "| task | preset | dtype | system | throughput | ratios | peak fraction | RSS GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["kind"], r["preset"], r["dtype"]), []).append(r)
    for (kind, preset, dtype), rs in groups.items():
        unit = "tokens_per_s" if kind == "train" else "sentences_per_s"
        best_hf = max(
            (r[unit] for r in rs if r["system"] == "hf-marian" and unit in r), default=None
        )
        ct2: dict[str, float] = {}  # the best of each compute type over the rounds, as for HF
        for r in groups.get((kind, preset, "any"), []):
            if unit in r:
                ct2[r["attn"]] = max(ct2.get(r["attn"], 0.0), r[unit])
        for r in rs:
            name = r["system"] if r["system"] == "aiayn" else f"{r['system']} ({r['attn']})"
            if unit not in r:
                rows.append(
                    f"| {kind} | {preset} | {dtype} | {name} | error: {r.get('error')} | | | |"
                )
                continue
            ratios = []
            if r["system"] == "aiayn":
                if best_hf:
                    ratios.append(f"x{r[unit] / best_hf:.2f} HF")
                ratios += [f"x{r[unit] / v:.2f} CT2 {c}" for c, v in ct2.items()]
            pf = f"{r['peak_fraction']:.1%}" if "peak_fraction" in r else ""
            rows.append(
                f"| {kind} | {preset} | {dtype} | {name} | {r[unit]:,.1f} {unit} | "
                f"{', '.join(ratios)} | {pf} | {r['max_rss_gib']:.2f} |"
            )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,base", help="model presets, comma-separated")
    p.add_argument("--what", default="train,decode", help="train, decode, or train,decode")
    p.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="aiayn's dtypes (fp32, bf16, int8 for decoding, auto: what this CPU runs best);"
        " HF runs bf16 under autocast, every other in fp32",
    )
    p.add_argument("--hf-attn", default="eager,sdpa", help="HF Marian attention implementations")
    p.add_argument(
        "--ct2", default="int8,float32", help="CTranslate2 compute types for decoding ('' to skip)"
    )
    p.add_argument("--steps", type=int, default=10, help="train: measured steps per system")
    p.add_argument("--beam", type=int, default=4, help="decode: beam size (1: greedy)")
    p.add_argument(
        "--out-len", type=int, default=20, help="decode: every output forced to this many tokens"
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole plan, interleaved")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="decode: aiayn's one-thread worker processes, and as many CTranslate2 "
        "inter_threads (HF generate has no such setting)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu or cuda (CTranslate2 is compared on the CPU only)"
    )
    p.add_argument(
        "--batch-sentences",
        type=int,
        default=291,
        help="training batch in sentence pairs of 12-16 tokens a side (291: ~4,100 "
        "tokens a side, the issue's protocol; 1700: ~25,000, the paper's)",
    )
    p.add_argument("--json", help="also write every record to this file")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    # AIAYN_CPU_ISA=avx2 (or another class): every child, the peers' included, runs with
    # oneDNN's, ATen's, MKL's and CTranslate2's ceilings held to that class
    from aiayn.cpu_isa import apply_isa_environment

    apply_isa_environment()
    if args.device != "cpu" and args.workers != 1:
        p.error("--workers is for CPU decoding")
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return 0
    import platform

    import torch

    from aiayn.cpu_isa import cpu

    c = cpu()
    held = " (held to it by AIAYN_CPU_ISA / ONEDNN_MAX_CPU_ISA)" if c.cap else ""
    where = (
        torch.cuda.get_device_name(args.device)
        if args.device != "cpu"
        else f"{c.model or platform.machine()}, class {c.cls}{held}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"# {where}, torch {torch.__version__}", flush=True)
    records = []
    for round_ in range(args.rounds):
        for spec in plan(args):
            r = run_child({**spec, "round": round_})
            records.append(r)
            print(json.dumps(r), flush=True)
    print(table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
