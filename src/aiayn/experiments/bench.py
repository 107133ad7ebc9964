"""Throughput benchmarks: training step, beam/greedy decoding, and the matmul ceiling.

The protocols are fixed so that runs on different days and machines compare (issue 5):
- train: one training step (forward, label-smoothed loss, backward, Adam) on a batch of
  291 sentence pairs of 12-16 tokens a side (~4,100 + ~4,100 tokens), shared vocabulary of
  10,000, random weights; the median of `steps` timed steps after `warmup` untimed ones.
- decode: 500 random source sentences of 12-16 tokens in batches of 64, every output forced
  to exactly `out_len` tokens (EOS is never chosen before the cap), so that systems are
  compared on identical work whatever their weights.
- peak: an n x n x n matrix product in the same dtype, measured in the same process, so
  `peak_fraction` (model FLOP/s over peak) is immune to the machine's drift.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, get_preset
from aiayn.fast import accelerate, native
from aiayn.fast.flops import forward_flops, matmul_peak, peak_size, training_flops
from aiayn.model import Transformer

#: The products' type per mode: int8 decoding's ceiling is the int8 product rate.
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}
#: fp16 trains with dynamic loss scaling (`aiayn.training.precision.make_scaler`), as
#: `train.dtype = "fp16"` does.
TRAIN_DTYPES = ("fp32", "bf16", "fp16")
DECODE_DTYPES = ("fp32", "bf16", "int8")
FIRST_TOKEN = 4  # ids below are PAD, UNK, BOS, EOS


def max_rss_gib() -> float:
    """Peak resident memory of this process so far, or of its largest finished child (a
    decoding worker) if that was larger (Linux reports KiB). A forked worker's figure
    includes the pages it shares with this process, so the two are not added."""
    return (
        max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        )
        / 2**20
    )


def random_batch(n: int, vocab: int, lo: int = 12, hi: int = 16, seed: int = 0) -> Tensor:
    """(n, hi + 1) source ids: lengths uniform in [lo, hi], then EOS, then padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    ids = torch.randint(FIRST_TOKEN, vocab, (n, hi + 1), generator=g)
    pos = torch.arange(hi + 1)
    ids = ids.masked_fill(pos == lengths[:, None], EOS_ID)
    return ids.masked_fill(pos > lengths[:, None], PAD_ID)


def random_model(preset: str, vocab: int = 10_000) -> Transformer:
    """The benchmarks' model: a preset with random weights from a fixed seed, so that every
    system compared (aiayn, and CTranslate2 through `aiayn.deploy.export`) runs the same weights."""
    torch.manual_seed(0)
    return accelerate(Transformer(replace(get_preset(preset).model, vocab_size=vocab)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_peak(dtype: str = "bf16", device: str = "cpu", n: int | None = None) -> dict[str, Any]:
    """The matrix-product ceiling in FLOP/s (fp16 on a CPU: n = 512, see bench_train);
    dtype auto: the precision training would run in here."""
    from aiayn.training.precision import resolve_dtype

    dtype = resolve_dtype(dtype, device)
    n = n or (512 if dtype == "fp16" and torch.device(device).type == "cpu" else peak_size(device))
    flops = matmul_peak(DTYPES[dtype], n=n, device=device)
    return {"bench": "peak", "dtype": dtype, "device": device, "n": n, "tflops": flops / 1e12}


def train_step(
    preset: str = "base",
    dtype: str = "bf16",
    device: str = "cpu",
    *,
    vocab: int = 10_000,
    batch: int = 291,
    compile: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    lengths: tuple[int, int] = (12, 16),
) -> tuple[Any, Transformer, Tensor, Tensor]:
    """The benchmark's training step as a closure, for `bench_train` and for profiling:
    (step, model, src, tgt). Each call of step() is forward, loss, backward and Adam.

    fp16 runs as the trainer runs it: the loss scaled by a GradScaler (`scaler`, or a
    fresh one with PyTorch's defaults), the gradients unscaled, Adam skipped on an
    overflow and the scale updated; pass `scaler` to read its scale afterwards."""
    from aiayn.training.loss import generator_loss
    from aiayn.training.precision import autocast, make_scaler
    from aiayn.training.trainer import make_optimizer

    cfg = get_preset(preset)
    dev = torch.device(device)
    model = random_model(preset, vocab).to(dev).train()
    if compile:
        model.compile()
    opt = make_optimizer(model, cfg.train)
    lo, hi = lengths
    src = random_batch(batch, vocab, lo, hi, seed=1).to(dev)
    tgt = random_batch(batch, vocab, lo, hi, seed=2).to(dev)  # ends in EOS: tgt_out
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS_ID), tgt[:, :-1]], dim=1)  # shift
    tgt_in = tgt_in.masked_fill(tgt_in == EOS_ID, PAD_ID)
    n_tokens = int((src != PAD_ID).sum() + (tgt != PAD_ID).sum())

    scaler = scaler if scaler is not None else make_scaler(dtype, dev)

    def step() -> None:
        with autocast(dev, dtype):
            features = model(src, tgt_in, features_only=True)
            loss, _ = generator_loss(features, model.generator.weight, tgt, cfg.train.eps_ls)
        scaler.scale(loss / n_tokens).backward()
        scaler.step(opt)  # with the scaler disabled (fp32, bf16): opt.step()
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, model, src, tgt


def bench_train(
    preset: str = "base",
    dtype: str = "bf16",
    device: str = "cpu",
    *,
    steps: int = 10,
    warmup: int = 3,
    vocab: int = 10_000,
    batch: int = 291,
    peak: bool = True,
    compile: bool = False,
    lengths: tuple[int, int] = (12, 16),
) -> dict[str, Any]:
    """Training tokens/s (source + target non-pad tokens) of one preset; see module doc.

    lengths: the sentences' lengths in subwords, uniform in [lo, hi] (without EOS): the
    default is Multi30k's; WMT14's are ~27 on average (e.g. (20, 34)), with its 37K
    vocabulary (`vocab`).

    compile: run the model's forward through torch.compile, with PyTorch's default shape
    handling (the bench's shapes are fixed; `train.compile` asks for dynamic shapes, as
    its batches vary); the compilation happens in the warm-up steps, reported as
    `warmup_seconds`, not in the median.
    """
    from aiayn.training.precision import resolve_dtype

    requested, dtype = dtype, resolve_dtype(dtype, device)  # auto: what train would run
    if dtype not in TRAIN_DTYPES:
        raise ValueError(
            f"training runs in auto, {' or '.join(TRAIN_DTYPES)}, not {dtype!r} "
            "(int8 is a decoding mode: bench decode --dtype int8)"
        )
    dev = torch.device(device)
    # The ceiling is measured first: measured after the training steps, in the same
    # process, it came out several times lower on the CPU (cause not established;
    # docs/performance.md, "Reproduce").
    # float16 products on a CPU without AVX-512 FP16 run PyTorch's generic kernel (0.2-2
    # GFLOP/s on the 2-core EPYC, fp32 ~66: twelve 2048^3 products took minutes): 512^3
    small = dtype == "fp16" and dev.type == "cpu"
    p = matmul_peak(DTYPES[dtype], n=512 if small else None, device=device) if peak else None
    from aiayn.training.precision import make_scaler

    scaler = make_scaler(dtype, dev)
    step, model, src, tgt = train_step(
        preset,
        dtype,
        device,
        vocab=vocab,
        batch=batch,
        compile=compile,
        scaler=scaler,
        lengths=lengths,
    )
    n_tokens = int((src != PAD_ID).sum() + (tgt != PAD_ID).sum())
    t0 = time.perf_counter()
    for _ in range(warmup):  # with compile=True, this is where compiling happens
        step()
    _sync(dev)
    warmup_seconds = time.perf_counter() - t0
    times = _timed(step, steps, 0, dev)
    t = statistics.median(times)
    # the convention (as its own HF figures imply:
    # docs/experiments/2026-11-23-perf-where-we-stand.md): the position-wise products of
    # the real tokens, the attention products over the padded lengths
    flops = training_flops(
        model.cfg,
        batch,
        src.size(1),
        tgt.size(1),
        src_tokens=int((src != PAD_ID).sum()),
        tgt_tokens=int((tgt != PAD_ID).sum()),
    )
    result = {
        "bench": "train",
        "preset": preset,
        "dtype": dtype,
        "dtype_requested": requested,
        "device": device,
        "batch_sentences": batch,
        "lengths": list(lengths),
        "vocab": vocab,
        "tokens": n_tokens,
        "seconds_per_step": t,
        "tokens_per_s": n_tokens / t,
        "model_tflops": flops / t / 1e12,
        "steps": steps,
        "compile": compile,
        "warmup_seconds": warmup_seconds,
        "max_rss_gib": max_rss_gib(),
    }
    if p is not None:
        result.update(peak_tflops=p / 1e12, peak_fraction=flops / t / p)
    if scaler.is_enabled():
        # an overflow skips Adam, so a timed step that overflowed was cheaper: the scale
        # at the end says whether any did (2^16 halves once per overflow)
        result["loss_scale"] = scaler.get_scale()
    return result


def _timed(fn: Any, steps: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def bench_decode(
    preset: str = "base",
    dtype: str = "fp32",
    device: str = "cpu",
    *,
    beam: int = 4,
    alpha: float = 0.6,
    out_len: int = 20,
    sentences: int = 500,
    batch: int = 64,
    vocab: int = 10_000,
    peak: bool = False,
    workers: int = 1,
) -> dict[str, Any]:
    """Decoding sentences/s with outputs forced to `out_len` tokens; see module doc.

    dtype: "fp32", "bf16" (weights and activations), or "int8" (dynamic quantization).
    workers: batches decoded by this many forked one-thread processes (`aiayn.decoding.workers`);
    the timed run includes starting them.
    """
    from aiayn.decoding.search import beam_search, greedy_search
    from aiayn.decoding.workers import check_workers, map_batches
    from aiayn.fast.machine import cast_for_inference, int8_bits, resolve_decode_dtype

    check_workers(workers, device)
    requested, dtype = dtype, resolve_decode_dtype(dtype, device)  # auto: translate's choice
    cfg = get_preset(preset)
    dev = torch.device(device)
    if dtype not in DECODE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DECODE_DTYPES)}, got {dtype!r}")
    p = matmul_peak(DTYPES[dtype], device=device) if peak else None
    model = random_model(preset, vocab).to(dev).eval()
    model = cast_for_inference(model, requested)  # auto resolves as `dtype` did, with its bits
    src = random_batch(sentences, vocab, seed=3).to(dev)

    starts = range(0, sentences, batch)

    def one_batch(b: int) -> None:
        chunk = src[starts[b] : starts[b] + batch]
        # min_len = the cap: every output is exactly out_len tokens long
        if beam == 1:
            greedy_search(model, chunk, 0.0, out_len, min_len=out_len)
        else:
            beam_search(model, chunk, beam, alpha, 0.0, out_len, min_len=out_len)

    def run() -> None:
        map_batches(one_batch, len(starts), workers)

    if workers > 1:
        # Warm up as the workers will run (one thread), here, so that the forked workers
        # inherit the warm caches; a warm-up inside workers would die with them.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one_batch(0)
        finally:
            torch.set_num_threads(threads)
        t = statistics.median(_timed(run, 1, 0, dev))
    else:
        t = statistics.median(_timed(run, 1, 1, dev))
    # Matrix products of the search: the encoder and its keys/values once per sentence,
    # the decoder once per hypothesis and output position (counted as if teacher-forced);
    # the encoder's for the real source tokens, as bench_train counts.
    mcfg, s_len = replace(cfg.model, vocab_size=vocab), src.size(1)
    n_src = int((src != PAD_ID).sum())
    encoder = forward_flops(mcfg, sentences, s_len, 0, src_tokens=n_src)
    flops = encoder + beam * (
        forward_flops(mcfg, sentences, s_len, out_len, src_tokens=n_src) - encoder
    )
    result = {
        "bench": "decode",
        "preset": preset,
        "dtype": dtype,
        "dtype_requested": requested,
        # int8: its activations' bits (auto's are 7 on CPUs without VNNI, `machine.int8_bits`)
        "int8_bits": int8_bits(requested) if dtype == "int8" else None,
        "device": device,
        "beam": beam,
        "alpha": alpha,
        "out_len": out_len,
        "sentences": sentences,
        "workers": workers,
        # the compiled beam step (normaliser, top-k) and attention (aiayn/native.py)
        "native_beam_step": beam > 1 and dev.type == "cpu" and native.library() is not None,
        "native_attention": dev.type == "cpu"
        and native.attention_applies(
            torch.bfloat16 if dtype == "bf16" else torch.float32,
            cfg.model.h,
            cfg.model.d_k,
            cfg.model.d_v,
        ),
        "batch_sentences": batch,
        "seconds": t,
        "sentences_per_s": sentences / t,
        "model_tflops": flops / t / 1e12,
        "max_rss_gib": max_rss_gib(),
    }
    if p is not None:
        result.update(peak_tflops=p / 1e12, peak_fraction=flops / t / p)
    return result
