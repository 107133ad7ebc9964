"""aiayn.fast.kernels' Triton attention, run by Triton's interpreter on the CPU.

The kernel is meant for CUDA GPUs (tests/test_cuda.py runs it there); Triton's
interpreter (TRITON_INTERPRET=1) executes the same kernel code with NumPy, so wherever
Triton is installed the forward and backward are checked against float64 Eq. 1 without a
GPU (skipped where Triton is not installed: CPU-only PyTorch builds, such as CI's). The
probe that keeps a failing or wrong kernel out of training is tested everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aiayn.fast import kernels

SCRIPT = r"""
import json, sys
import torch
from aiayn.fast import kernels

def eq1(q, k, v, mask, causal):
    s = q @ k.transpose(-2, -1) / q.size(-1) ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        s = s.masked_fill(~torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril(),
                          float("-inf"))
    return s.softmax(-1) @ v

out = []
for b, h, tq, tk, d, causal, masked in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(tq * 100 + tk)
    qkv = torch.randn(b, max(tq, tk), 3 * h * d, generator=g)
    q, k, v = (x.unflatten(-1, (h, d)).transpose(1, 2) for x in qkv.split(h * d, -1))
    q, k, v = (x[:, :, :n].detach().requires_grad_() for x, n in ((q, tq), (k, tk), (v, tk)))
    mask = None
    if masked:
        lengths = torch.randint(1, tk + 1, (b,), generator=g)
        mask = (torch.arange(tk) < lengths[:, None])[:, None, None, :]
        if masked == 2:  # one mask broadcast over the batch
            mask = mask[:1]
    o = kernels.attention(q, k, v, mask, causal)
    grad = torch.randn(o.shape, generator=g)
    o.backward(grad)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = eq1(*ref_in, mask, causal)
    ref.backward(grad.double())
    rel = lambda a, r: float((a.detach().double() - r.detach()).norm() / r.detach().norm())
    out.append([rel(o, ref)] + [rel(x.grad, r.grad) for x, r in zip((q, k, v), ref_in)])
assert kernels.works_on(torch.device("cpu"))  # the probe passes the interpreted kernel
print(json.dumps(out))
"""

CASES = [  # batch, heads, Tq, Tk, d_k, causal, padding mask (2: one for the whole batch)
    (3, 2, 5, 7, 16, False, 1),
    (2, 2, 9, 9, 32, True, 0),
    (4, 2, 17, 17, 64, False, 1),
    (2, 1, 1, 6, 16, False, 1),
    (3, 2, 4, 11, 16, False, 2),
]


@pytest.mark.skipif(not kernels.available(), reason="needs Triton")
def test_interpreted_kernel_is_eq1_forward_and_backward():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == len(CASES)
    for case, errs in zip(CASES, errors, strict=True):
        assert max(errs) < 1e-5, (case, errs)  # float32 (IEEE products) against float64


def test_the_probe_keeps_a_failing_or_wrong_kernel_out(monkeypatch: pytest.MonkeyPatch):
    """`works_on` (checked once per device before training relies on the kernel) answers
    False, with a warning, when the kernel raises (say, a Triton that does not fit the GPU)
    or gives results other than Eq. 1's; True for a correct one."""
    from aiayn.model import scaled_dot_product_attention

    cpu = torch.device("cpu")

    def formula(q, k, v, mask, causal):  # a correct "kernel": Eq. 1 written out
        return scaled_dot_product_attention(q, k, v, mask, causal=causal)

    def wrong(q, k, v, mask, causal):
        return formula(q, k, v, mask, causal) * 1.1

    def broken(*args):
        raise ImportError("no Triton here")

    for fake, message in ((wrong, "differ from Eq. 1"), (broken, "ImportError")):
        kernels.works_on.cache_clear()
        monkeypatch.setattr(kernels, "attention", fake)
        with pytest.warns(UserWarning, match=message):
            assert not kernels.works_on(cpu)
    kernels.works_on.cache_clear()
    monkeypatch.setattr(kernels, "attention", formula)
    assert kernels.works_on(cpu)
    kernels.works_on.cache_clear()
