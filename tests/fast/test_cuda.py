"""The CUDA paths against the CPU ones: the same model, loss, training and search on a GPU.

On CUDA the model takes other kernels than on the CPU (PyTorch's fused attention instead
of the written-out formula, PyTorch's dropout, the unfused output layer and loss), so
these tests hold the GPU's results to the CPU's, in float32 with TF32 off, where the two
must agree to rounding. They are skipped on machines without a GPU (CI); they were run on
a lent H100 (docs/performance.md, "GPU").
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from aiayn.config import BOS_ID, EOS_ID, PAD_ID, apply_overrides, get_preset
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.experiments import bench
from aiayn.training.loss import generator_loss, label_smoothed_loss
from helpers import fast_transformer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 1000


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 products in float32 (TF32 rounds operands to 10 bits: ~1e-3 off)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _pair(n: int = 48) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    src = bench.random_batch(n, VOCAB, lo=5, hi=20, seed=11)
    tgt = bench.random_batch(n, VOCAB, lo=4, hi=18, seed=12)  # ends in EOS: the output side
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS_ID), tgt[:, :-1]], dim=1)
    return src, tgt_in.masked_fill(tgt_in == EOS_ID, PAD_ID), tgt


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().norm())


def test_forward_and_gradients_match_the_cpu():
    """Padded batches of uneven lengths: fused SDPA with masks on the GPU gives the
    written-out Eq. 1's logits and gradients."""
    torch.manual_seed(0)  # dropout off: the two devices would draw different masks
    model = fast_transformer(
        replace(get_preset("tiny").model, vocab_size=VOCAB, P_drop=0.0)
    ).train()
    src, tgt_in, tgt = _pair()
    out = {}
    for dev in ("cpu", "cuda"):
        m = model.to(dev)
        m.zero_grad(set_to_none=True)
        logits = m(src.to(dev), tgt_in.to(dev))
        loss, _ = label_smoothed_loss(logits, tgt.to(dev), 0.1)
        loss.backward()
        out[dev] = (
            logits.detach().cpu(),
            loss.item(),
            {k: p.grad.detach().cpu() for k, p in m.named_parameters()},
        )
    (lc, loss_c, gc), (lg, loss_g, gg) = out["cpu"], out["cuda"]
    real = (tgt != PAD_ID).unsqueeze(-1).expand_as(lc)  # padded positions are free to differ
    assert _rel(lg[real], lc[real]) < 1e-5
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    for k in gc:
        # 2e-3, not 1e-5: a ReLU pre-activation within rounding of 0 can land on the other
        # side of the kink on one device. Such a flip (one unit of one token; found by
        # comparing both with float64) moved some weight gradients by 5e-4 relative, while
        # the GPU's were within 2e-6 of float64. A wrong mask or formula is off by O(1).
        assert _rel(gg[k], gc[k]) < 2e-3, k


def test_generator_loss_on_cuda_is_the_plain_loss():
    """On CUDA `generator_loss` takes the unfused path: it must give the same loss (and
    gradient) as projecting all positions and `label_smoothed_loss` over the non-pad ones."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 12, 64, generator=g).cuda().requires_grad_()
    w = (torch.randn(VOCAB, 64, generator=g) * 0.1).cuda().requires_grad_()
    target = bench.random_batch(8, VOCAB, lo=5, hi=11, seed=4).cuda()
    loss, nll = generator_loss(h, w, target, 0.1)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref, ref_nll = label_smoothed_loss(h @ w.t(), target, 0.1)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    assert _rel(gh, h.grad) < 1e-6 and _rel(gw, w.grad) < 1e-6


@pytest.mark.parametrize("nbest", [1, 4])
def test_beam_and_greedy_search_match_the_cpu(nbest: int):
    """Same hypotheses (tokens) and scores to rounding; with beam 4 and nbest 4 every
    hypothesis of every sentence is compared, so the beam bookkeeping is too."""
    model = bench.random_model("tiny", VOCAB).eval()
    src = bench.random_batch(40, VOCAB, lo=3, hi=25, seed=5)
    cpu = beam_search(model, src, 4, 0.6, 1.0, 12, nbest)
    gpu = beam_search(model.cuda(), src.cuda(), 4, 0.6, 1.0, 12, nbest)
    assert [[h.tokens for h in s] for s in gpu] == [[h.tokens for h in s] for s in cpu]
    for s_c, s_g in zip(cpu, gpu, strict=True):
        for a, b in zip(s_c, s_g, strict=True):
            assert b.score == pytest.approx(a.score, abs=1e-4)
    assert greedy_search(model, src.cuda(), 1.0, 12) == greedy_search(model.cpu(), src, 1.0, 12)


def test_bf16_inference_on_cuda_stays_close_to_fp32():
    """cast_for_inference("bf16") on a GPU model: plain bf16 linears (oneDNN packing is for
    the CPU only), and a greedy search that mostly agrees with fp32's."""
    from aiayn.fast.inference import PackedLinear
    from aiayn.fast.machine import cast_for_inference

    model = bench.random_model("tiny", VOCAB).cuda().eval()
    src = bench.random_batch(64, VOCAB, lo=5, hi=20, seed=6).cuda()
    ref = greedy_search(model, src, 1.0, 10)
    half = cast_for_inference(model, "bf16")
    assert not any(isinstance(m, PackedLinear) for m in half.modules())
    assert half.generator.weight.dtype == torch.bfloat16
    out = greedy_search(half, src, 1.0, 10)
    same = sum(a == b for r, o in zip(ref, out, strict=True) for a, b in zip(r, o, strict=False))
    total = sum(min(len(r), len(o)) for r, o in zip(ref, out, strict=True))
    assert same / total > 0.8  # random weights: near-ties flip, most tokens agree


@pytest.mark.rows("B6")
def test_training_on_cuda_matches_the_cpu_and_loads_back(small_data: Path, tmp_path: Path):
    """The training loop on a GPU (fp32, no dropout): the CPU run's losses step for step,
    and a checkpoint that loads on a machine without a GPU and translates there as on the
    GPU (B6). bf16 autocast on CUDA trains too, to within 2% of fp32's losses over these
    steps."""
    from aiayn.checkpoints import load_model
    from aiayn.training.trainer import train

    base = {
        "N": 1,
        "d_model": 32,
        "d_ff": 64,
        "h": 2,
        "d_k": 16,
        "d_v": 16,
        "P_drop": 0.0,
        "train.max_tokens": 300,
        "max_steps": 8,
        "save_interval_steps": 8,
        "valid_interval_steps": 8,
        "train.warmup_steps": 4,
    }
    runs = {}
    for dev, dtype in (("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")):
        cfg = apply_overrides(get_preset("tiny"), {**base, "dtype": dtype})
        runs[dev, dtype] = train(cfg, small_data, tmp_path / f"{dev}-{dtype}", device=dev)
    cpu = [h["loss"] for h in runs["cpu", "fp32"].history]
    gpu = [h["loss"] for h in runs["cuda", "fp32"].history]
    half = [h["loss"] for h in runs["cuda", "bf16"].history]
    assert gpu == pytest.approx(cpu, rel=1e-4)
    assert half == pytest.approx(gpu, rel=2e-2)
    assert cpu[-1] < cpu[0]  # it learns
    model, tok, _ = load_model(tmp_path / "cuda-fp32" / "checkpoint_8.pt", device="cpu")
    assert next(model.parameters()).device.type == "cpu"
    on_gpu, _, _ = load_model(tmp_path / "cuda-fp32" / "checkpoint_8.pt", device="cuda")
    src = bench.random_batch(24, tok.vocab_size, lo=3, hi=15, seed=7)
    cpu_out = beam_search(model, src, 4, 0.6, 1.0, 10, 1)
    gpu_out = beam_search(on_gpu, src.cuda(), 4, 0.6, 1.0, 10, 1)
    assert [s[0].tokens for s in gpu_out] == [s[0].tokens for s in cpu_out]
    assert [s[0].score for s in gpu_out] == pytest.approx([s[0].score for s in cpu_out], abs=1e-4)


@pytest.mark.rows("C7")
def test_a_batch_too_big_for_the_gpu_fails_in_the_preflight(small_data: Path, tmp_path: Path):
    """C7 with a real CUDA out-of-memory error: the GPU's allocator capped just above what
    the model and its optimizer hold, the pre-flight's largest batch cannot fit, and the
    run stops before step 1 with advice instead of failing later."""
    from aiayn.checkpoints import list_checkpoints
    from aiayn.training.trainer import Trainer, TrainingError

    cfg = apply_overrides(
        get_preset("tiny"),
        {
            "N": 2,
            "d_model": 512,
            "d_ff": 2048,
            "h": 8,
            "d_k": 64,
            "d_v": 64,
            "P_drop": 0.1,
            "train.max_tokens": 4000,
            "max_steps": 2,
            "save_interval_steps": 1,
        },
    )
    trainer = Trainer(cfg, small_data, tmp_path / "run", device="cuda")
    # cuBLAS's handle is allocated outside PyTorch's allocator: create it before the cap,
    # so that the error below is the allocator's out-of-memory error
    torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(
            (torch.cuda.memory_reserved() + 8 * 2**20) / total
        )
        with pytest.raises(
            TrainingError,
            match=r"out of memory on cuda.*before training.*"
            r"lower train.max_tokens \(now 4000\)",
        ):
            trainer.run()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        trainer.close()
        torch.cuda.empty_cache()
    assert list_checkpoints(tmp_path / "run") == []


def test_fp16_trains_and_resumes_bitwise_on_cuda(small_data: Path, tmp_path: Path):
    """fp16 with dynamic loss scaling on a GPU: the losses within 2% of fp32's (dropout
    off), the scaler's state in every checkpoint, and a run (dropout on) stopped at step 4
    and resumed ends bitwise as the uninterrupted one: each step's loss, the weights, Adam
    and the scaler. "auto" is bf16 on a GPU that multiplies bf16 natively, else fp16."""
    from aiayn.checkpoints import load_checkpoint
    from aiayn.training.persistence import SCALER_KEY
    from aiayn.training.precision import resolve_dtype
    from aiayn.training.trainer import train
    from helpers import SMALL_TRAINING, step_losses

    base = {
        **SMALL_TRAINING,
        "P_drop": 0.0,
        "train.max_tokens": 300,
        "max_steps": 8,
        "warmup_steps": 4,
        "save_interval_steps": 4,
        "valid_interval_steps": 4,
    }

    def cfg(**over):
        return apply_overrides(get_preset("tiny"), {**base, **over})

    fp32 = train(cfg(dtype="fp32"), small_data, tmp_path / "fp32", device="cuda")
    fp16 = train(cfg(dtype="fp16"), small_data, tmp_path / "fp16", device="cuda")
    losses32 = [h["loss"] for h in fp32.history]
    losses16 = [h["loss"] for h in fp16.history]
    assert losses16 == pytest.approx(losses32, rel=2e-2) and losses16 != losses32
    assert losses16[-1] < losses16[0]
    assert all(h["loss_scale"] > 0 for h in fp16.history)
    saved = load_checkpoint(tmp_path / "fp16" / "checkpoint_8.pt")[SCALER_KEY]
    assert saved["scale"] == fp16.history[-1]["loss_scale"]
    assert saved["scale"] == 2.0**16 / 2**fp16.state.overflow_skipped  # no growth in 8 steps

    dropout = cfg(dtype="fp16", P_drop=0.1)
    train(dropout, small_data, tmp_path / "full", device="cuda")
    train(
        cfg(dtype="fp16", P_drop=0.1, max_steps=4), small_data, tmp_path / "resumed", device="cuda"
    )
    train(dropout, small_data, tmp_path / "resumed", device="cuda")
    assert dict(step_losses(tmp_path / "resumed")) == dict(step_losses(tmp_path / "full"))
    a = load_checkpoint(tmp_path / "full" / "checkpoint_8.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint_8.pt")
    assert a[SCALER_KEY] == b[SCALER_KEY]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    adam_a, adam_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(
        torch.equal(adam_a[i][k], adam_b[i][k]) for i in adam_a for k in ("exp_avg", "exp_avg_sq")
    )
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_dtype("auto", "cuda") == ("bf16" if native else "fp16")


def test_bench_runs_on_cuda():
    """`aiayn bench train|decode` on a GPU: tokens/s, and the peak fraction against the
    matrix-product ceiling measured on the same GPU."""
    r = bench.bench_train("tiny", "bf16", "cuda", steps=2, warmup=1, batch=32)
    assert r["tokens_per_s"] > 0 and 0 < r["peak_fraction"] < 1
    r = bench.bench_train("tiny", "fp16", "cuda", steps=2, warmup=1, batch=32)
    assert r["tokens_per_s"] > 0 and 0 < r["peak_fraction"] < 1
    assert r["loss_scale"] == 2.0**16  # PyTorch's initial scale: no overflow here
    d = bench.bench_decode("tiny", "bf16", "cuda", beam=2, out_len=5, sentences=16, batch=8)
    assert d["sentences_per_s"] > 0


def test_int8_is_refused_on_cuda():
    """Dynamic quantization is a CPU feature: asking for it on a GPU model fails clearly."""
    from aiayn.fast.machine import cast_for_inference

    model = fast_transformer(replace(get_preset("tiny").model, vocab_size=VOCAB)).cuda()
    with pytest.raises(ValueError, match="CPU"):
        cast_for_inference(model, "int8")


# --------------------------------------------------------------------------- aiayn.fast.kernels
def _eq1_float64(q, k, v, mask, causal):
    """Eq. 1 in float64, written out: the reference for every kernel."""
    s = q.double() @ k.double().transpose(-2, -1) / q.size(-1) ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        s = s.masked_fill(
            ~torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril(),
            float("-inf"),
        )
    return s.softmax(-1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tq", "tk", "d", "causal", "masked"),
    [
        (1, 3, 64, False, False),
        (5, 7, 16, False, True),
        (13, 13, 64, True, False),
        (17, 17, 64, False, True),
        (4, 33, 32, False, True),
        (64, 64, 128, True, False),
        (40, 64, 64, False, True),
    ],
)
def test_short_attention_kernel_is_eq1(tq, tk, d, causal, masked, dtype):
    """aiayn's Triton kernel against float64 Eq. 1: output and the gradients of q, k, v, on
    inputs laid out as the model's (heads split off a fused projection: strided)."""
    from aiayn.fast import kernels

    b, h = 6, 3
    g = torch.Generator(device="cuda").manual_seed(tq * 100 + tk)
    qkv = torch.randn(b, max(tq, tk), 3 * h * d, device="cuda", generator=g).to(dtype)
    q, k, v = (x.unflatten(-1, (h, d)).transpose(1, 2) for x in qkv.split(h * d, -1))
    q, k, v = (x[:, :, :n].detach().requires_grad_() for x, n in ((q, tq), (k, tk), (v, tk)))
    mask = None
    if masked:
        lengths = torch.randint(1, tk + 1, (b,), device="cuda", generator=g)
        mask = (torch.arange(tk, device="cuda") < lengths[:, None])[:, None, None, :]
    assert kernels.applies(q, k, v, mask, causal, 0.0)
    out = kernels.attention(q, k, v, mask, causal)
    grad = torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    out.backward(grad)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _eq1_float64(*ref_in, mask, causal)
    ref.backward(grad.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 operands: ~3 significant digits
    assert out.dtype == dtype and out.shape == ref.shape
    assert _rel(out, ref) < tol
    for name, x, r in zip("qkv", (q, k, v), ref_in, strict=True):
        assert _rel(x.grad, r.grad) < tol, name


def test_the_model_takes_the_kernel_where_it_is_faster_and_pytorchs_elsewhere():
    """Dispatch (`kernels.preferred`): aiayn's kernel for large bf16 training batches of
    short sequences; PyTorch's for longer sequences, attention dropout, general masks,
    float32, decoding and small batches. Every path gives the same output."""
    from aiayn.fast import kernels
    from aiayn.model import scaled_dot_product_attention

    b = kernels.MIN_ELEMENTS // (8 * 20 * 64) + 1
    q, k, v = (
        torch.randn(b, 8, 20, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    mask = torch.ones(b, 1, 1, 20, dtype=torch.bool, device="cuda")
    mask[0, ..., 12:] = False
    assert kernels.preferred(q, k, v, mask, False, 0.0)
    assert not kernels.preferred(q, k, v, mask, False, 0.1)  # attention dropout
    assert not kernels.preferred(q[:8], k[:8], v[:8], mask[:8], False, 0.0)  # small batch
    assert not kernels.preferred(q.float(), k.float(), v.float(), mask, False, 0.0)
    with torch.no_grad():
        assert not kernels.preferred(q, k, v, mask, False, 0.0)  # decoding
    assert not kernels.applies(q, k, v, mask.expand(b, 8, 20, 20), False, 0.0)  # general mask
    long = torch.randn(2, 2, kernels.MAX_LEN + 1, 64, device="cuda")
    assert not kernels.applies(long, long, long, None, True, 0.0)
    ours = scaled_dot_product_attention(q, k, v, mask)
    pytorch = scaled_dot_product_attention(q, k, v, mask, fused=True)
    written = scaled_dot_product_attention(q, k, v, mask, fused=False)
    assert _rel(ours, pytorch) < 1e-2 and _rel(ours, written) < 1e-2  # bf16 operands
