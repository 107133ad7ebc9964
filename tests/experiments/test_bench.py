"""Benchmarks and FLOP counts: the counted FLOPs agree with PyTorch's own FLOP counter."""

from __future__ import annotations

import platform
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aiayn.config import EOS_ID, PAD_ID, ModelConfig
from aiayn.experiments.bench import bench_decode, bench_train, random_batch
from aiayn.fast import accelerate, native
from aiayn.fast.flops import forward_flops, training_flops
from aiayn.fast.packing import Packing
from aiayn.model import Transformer
from helpers import ROOT

CFG = ModelConfig(N=2, d_model=32, d_ff=48, h=4, d_k=8, d_v=12, vocab_size=50, P_drop=0.0)


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, h=1, d_k=32, d_v=32, N=1)])
def test_forward_flops_equal_pytorch_flop_counter(cfg):
    """Every matrix product of section 3 (projections, Q K^T, weights x V, FFN, output
    layer), counted from shapes, equals what PyTorch counts while running the model."""
    model = Transformer(cfg).eval()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt)
    assert forward_flops(cfg, 3, 7, 5) == counter.get_total_flops()


def test_forward_flops_of_a_packed_batch_equal_pytorch_flop_counter(monkeypatch):
    """With padding, the CPU runs the position-wise products on the real tokens only
    (`aiayn.fast.packing.Packing`): the count with src_tokens / tgt_tokens is what PyTorch
    counts, and the padded count is what it counts with packing switched off."""
    monkeypatch.setattr(Packing, "granule", 1)  # exactly the real tokens
    model = accelerate(Transformer(CFG)).eval()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    src[0, 4:], src[2, 6:], tgt[1, 2:] = PAD_ID, PAD_ID, PAD_ID
    n_src, n_tgt = int((src != PAD_ID).sum()), int((tgt != PAD_ID).sum())
    for packed, expected in (
        (True, forward_flops(CFG, 3, 7, 5, src_tokens=n_src, tgt_tokens=n_tgt)),
        (False, forward_flops(CFG, 3, 7, 5)),
    ):
        model.pack_padding = packed
        with FlopCounterMode(display=False) as counter:
            model(src, tgt)
        assert counter.get_total_flops() == expected
    assert forward_flops(CFG, 3, 7, 5, src_tokens=n_src, tgt_tokens=n_tgt) < forward_flops(
        CFG, 3, 7, 5
    )


def test_training_flops_equal_pytorch_flop_counter_forward_and_backward():
    model = Transformer(CFG).train()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt).sum().backward()
    # Backward = 2 x forward, except that no gradient is taken for the input token ids'
    # embedding lookup (not a product) and the first layer's input needs none either.
    assert training_flops(CFG, 3, 7, 5) == pytest.approx(counter.get_total_flops(), rel=0.05)


def test_random_batch_lengths_and_padding():
    ids = random_batch(50, 100, lo=3, hi=6, seed=1)
    lengths = (ids != PAD_ID).sum(1)
    assert ((lengths >= 4) & (lengths <= 7)).all()  # 3..6 tokens + EOS
    assert ((ids == EOS_ID).sum(1) == 1).all()


def test_bench_train_and_decode_report_the_protocol_fields():
    train = bench_train("tiny", "fp32", steps=1, warmup=0, vocab=200, batch=8, peak=False)
    assert train["tokens_per_s"] > 0 and train["model_tflops"] > 0 and train["max_rss_gib"] > 0
    decode = bench_decode("tiny", "fp32", beam=2, out_len=5, sentences=6, batch=4, vocab=200)
    assert decode["sentences_per_s"] > 0 and decode["sentences"] == 6
    assert decode["native_beam_step"] == (native.library() is not None)
    assert decode["native_attention"] == (native.library() is not None)


def test_bench_trains_fp16_with_the_loss_scaler():
    """`bench train --dtype fp16` runs the trainer's fp16 step: the loss times a GradScaler's
    scale; at a scale past float16's range (2^40: the float16 gradients overflow) Adam is
    skipped and the scale halved; at PyTorch's initial 2^16 the step trains, and the
    result reports the scale reached."""
    from aiayn.experiments.bench import train_step

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    step, model, _, _ = train_step("tiny", "fp16", vocab=200, batch=4, scaler=scaler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    assert scaler.get_scale() == 2.0**39
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    result = bench_train("tiny", "fp16", steps=1, warmup=0, vocab=200, batch=4, peak=False)
    assert result["dtype"] == "fp16" and result["loss_scale"] == 2.0**16
    assert "loss_scale" not in bench_train(
        "tiny", "fp32", steps=1, warmup=0, vocab=200, batch=4, peak=False
    )


def test_int8_ceiling_is_measured_with_the_int8_product_and_training_refuses_int8(monkeypatch):
    """int8 decoding's peak_fraction is against the rate of the product it runs
    (int8_ops.int8_matmul: torch._int_mm where it is exact, else aiayn's kernel), not
    float32's; int8 is not a training mode."""
    from aiayn.fast.flops import matmul_peak
    from aiayn.fast.int8_ops import backend

    backend()  # its one-time check of torch._int_mm, made before counting
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(
        torch,
        "_int_mm",
        lambda a, b: calls.append((a.dtype, b.dtype, tuple(b.shape))) or real(a, b),
    )
    assert matmul_peak(torch.int8, n=64, repeats=2) > 0
    if backend() == "torch":
        assert calls == [(torch.int8, torch.int8, (64, 64))] * 4  # two warm-up, two timed
    else:  # not exact on this CPU (no VNNI): int8 runs aiayn's own kernel, not _int_mm
        assert calls == []
    with pytest.raises(ValueError, match="int8 is a decoding mode"):
        bench_train("tiny", "int8", steps=1, warmup=0, vocab=200, batch=8, peak=False)
    with pytest.raises(ValueError, match="fp16"):
        bench_decode("tiny", "fp16", beam=2, out_len=5, sentences=6, batch=4, vocab=200)


def test_compare_table_ratios_use_each_peers_best_round():
    """benchmarks/compare.py's ratios are conservative: with --rounds, aiayn's rows are
    divided by the best measurement of each peer in the run (HF and each CTranslate2
    compute type alike), whatever the order of the rounds."""
    compare = _load_benchmark("compare")

    def rec(system, dtype, attn, value):
        return {
            "kind": "decode",
            "preset": "tiny",
            "dtype": dtype,
            "system": system,
            "attn": attn,
            "sentences_per_s": value,
            "max_rss_gib": 0.5,
        }

    records = [
        rec("aiayn", "bf16", "aiayn", 120.0),
        rec("hf-marian", "bf16", "eager", 60.0),
        rec("ctranslate2", "any", "int8", 150.0),
        rec("aiayn", "bf16", "aiayn", 120.0),
        rec("hf-marian", "bf16", "eager", 80.0),
        rec("ctranslate2", "any", "int8", 100.0),
    ]
    rows = [r for r in compare.table(records).splitlines() if "| aiayn |" in r]
    assert len(rows) == 2
    for row in rows:  # 120 / 80 and 120 / 150, not the last round's 100
        assert "x1.50 HF" in row and "x0.80 CT2 int8" in row


def _load_benchmark(name: str):
    import importlib.util

    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_plan_on_a_gpu_has_no_ctranslate2_and_carries_the_batch():
    """compare.py --device cuda: every row runs on the GPU, training rows at the asked
    batch, and CTranslate2 (compared on the CPU only) is left out."""
    import argparse

    compare = _load_benchmark("compare")
    args = argparse.Namespace(
        presets="base",
        what="train,decode",
        dtypes="bf16",
        hf_attn="eager,sdpa",
        ct2="int8",
        steps=3,
        beam=4,
        out_len=20,
        workers=1,
        device="cuda",
        batch_sentences=1700,
    )
    specs = compare.plan(args)
    assert {s["system"] for s in specs} == {"aiayn", "hf-marian"}
    assert all(s["device"] == "cuda" for s in specs)
    assert all(s["batch"] == 1700 for s in specs if s["kind"] == "train")
    args.device = "cpu"
    assert any(s["system"] == "ctranslate2" for s in compare.plan(args))


def test_profile_train_prints_the_operator_table(capsys, monkeypatch):
    profile_train = _load_benchmark("profile_train")
    monkeypatch.setattr(
        "sys.argv",
        [
            "profile_train.py",
            "--preset",
            "tiny",
            "--dtype",
            "fp32",
            "--batch-sentences",
            "4",
            "--steps",
            "1",
            "--rows",
            "5",
        ],
    )
    assert profile_train.main() == 0
    out = capsys.readouterr().out
    assert "aten::mm" in out and "step wall" in out


def _slow_bf16_warning_in_a_process(env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    code = "from aiayn.fast.machine import slow_bf16_warning; print(slow_bf16_warning('cpu'))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 oneDNN ISAs")
def test_slow_bf16_warning_on_a_cpu_without_native_bf16():
    # oneDNN held to AVX2 (as on a CPU without AVX-512): bf16 products fall back to generic
    # code, tens of times slower than float32, and the check must say so with both rates.
    text = _slow_bf16_warning_in_a_process({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "no native bf16" in text and "GFLOP/s" in text and "class avx2" in text
    assert "dtype auto (the default) picks float32" in text


def test_no_slow_bf16_warning_where_the_cpu_has_native_bf16():
    from aiayn.experiments.recipe import cpu_kernels

    kernels = cpu_kernels()
    if not (kernels.get("amx_bf16") or kernels.get("avx512_bf16")):
        pytest.skip("this CPU has no native bf16")
    assert _slow_bf16_warning_in_a_process({}) == "None"
