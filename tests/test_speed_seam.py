"""The one speed seam (issue 69): the paper's code runs with `aiayn.fast` absent, and
computes what it computes with the speed paths, up to rounding.

A child process blocks every import of `aiayn.fast` (`sys.modules["aiayn.fast"] = None`:
Python then raises ImportError for it and its submodules), builds the paper's model from
a seed, and runs a forward pass, the label-smoothed loss through `generator_loss` (the
fused CPU path's fallback) with its gradients, greedy and beam search, a BPE-dropout
epoch, and two training steps of `train`. This process computes the same with the speed
paths registered (tests import `aiayn.fast` through helpers) on an accelerated copy.

Tolerances, float32 on the CPU, as tests/fast/test_seam.py states them: logits, loss and
gradients within 1e-5 absolute on values of order 1 (and 1e-4 relative on the summed
loss); searches give the same tokens with scores within 1e-4; BPE-dropout's draws are the
same (the compiled and the Python merges are one function of (seed, word)).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn import speed
from aiayn.config import EOS_ID, PAD_ID, ModelConfig
from aiayn.data.bpe_dropout import BPEDropout
from aiayn.data.corpus import load_corpus, load_tokenizer
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.fast import accelerate, is_accelerated
from aiayn.model import Transformer
from aiayn.training.loss import generator_loss
from helpers import ROOT

CFG = ModelConfig(N=2, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0, vocab_size=60)

#: Run in a child process with `aiayn.fast` blocked; prints one JSON line.
CHILD = """
import json, sys
sys.modules["aiayn.fast"] = None  # `import aiayn.fast` (and aiayn.fast.*) now fails
import torch
from aiayn import speed
from aiayn.config import EOS_ID, PAD_ID, ModelConfig
from aiayn.data.bpe_dropout import BPEDropout
from aiayn.data.corpus import load_corpus, load_tokenizer
from aiayn.decoding.search import beam_search, greedy_search
from aiayn.model import Transformer
from aiayn.training.loss import generator_loss
from aiayn.training.trainer import train
from aiayn.config import apply_overrides, get_preset

try:
    import aiayn.fast
    sys.exit("aiayn.fast was importable")
except ImportError:
    pass
assert speed.IMPLEMENTATIONS == {}, speed.IMPLEMENTATIONS
torch.set_num_threads(1)
cfg = ModelConfig(**json.loads(sys.argv[1]))
src, tgt = (torch.tensor(t) for t in json.loads(sys.argv[2]))
torch.manual_seed(0)
model = Transformer(cfg)
out = {}
model.eval()
with torch.no_grad():
    out["logits"] = model(src, tgt).tolist()
    out["greedy"] = greedy_search(model, src, 1.0, 5)
    beams = beam_search(model, src, beam=3, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=2)
    out["beam"] = [[[h.tokens, h.score] for h in hyps] for hyps in beams]
model.train()
features = model(src, tgt[:, :-1], features_only=True)
loss, nll = generator_loss(features, model.generator.weight, tgt[:, 1:], 0.1, cpu_kernels=True)
loss.backward()
out["loss"], out["nll"] = float(loss), float(nll)
out["grads"] = {n: p.grad.tolist() for n, p in model.named_parameters() if p.grad is not None}
data = sys.argv[3]
epoch = BPEDropout(load_corpus(data, "train"), load_tokenizer(data), 0.1, 256).epoch(42)
out["bpe_dropout"] = [[epoch.src(i), epoch.tgt(i)] for i in range(len(epoch))]
settings = {"max_steps": 2, "N": 1, "d_model": 32, "d_ff": 64, "h": 2, "d_k": 16, "d_v": 16,
            "dtype": "auto", "warmup_steps": 2, "valid_interval_steps": 2}
result = train(apply_overrides(get_preset("tiny"), settings), data, sys.argv[4])
out["train"] = [h["loss"] for h in result.history]
out["fast_imported"] = any(m.startswith("aiayn.fast") and sys.modules[m] is not None
                           for m in sys.modules)
print(json.dumps(out))
"""


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded, EOS-terminated sources and BOS-started targets."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 60, (4, 9), generator=g)
    tgt = torch.randint(4, 60, (4, 8), generator=g)
    tgt[:, 0] = 2  # BOS
    for i, (s, t) in enumerate([(9, 5), (4, 8), (6, 3), (2, 7)]):
        src[i, s - 1], src[i, s:], tgt[i, t:] = EOS_ID, PAD_ID, PAD_ID
    return src, tgt


@pytest.fixture(scope="module")
def without_fast(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    src, tgt = batch()
    run = tmp_path_factory.mktemp("no-fast") / "run"
    fields = {k: getattr(CFG, k) for k in ("N", "d_model", "d_ff", "h", "d_k", "d_v")}
    fields |= {"P_drop": CFG.P_drop, "vocab_size": CFG.vocab_size}
    args = [json.dumps(fields), json.dumps([src.tolist(), tgt.tolist()]), str(small_data), str(run)]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_paper_code_runs_with_fast_blocked(without_fast: dict) -> None:  # type: ignore[type-arg]
    """The child imported no part of `aiayn.fast`, and trained: two finite losses."""
    assert without_fast["fast_imported"] is False
    losses = without_fast["train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_model_search_and_loss_equal_the_fast_paths(without_fast: dict) -> None:  # type: ignore[type-arg]
    assert "accelerate" in speed.IMPLEMENTATIONS  # this process: the speed paths are on
    torch.manual_seed(0)
    fast = accelerate(copy.deepcopy(Transformer(CFG)))
    assert is_accelerated(fast)
    src, tgt = batch()
    fast.eval()
    with torch.no_grad():
        logits = fast(src, tgt)
        real = tgt != PAD_ID
        want = torch.tensor(without_fast["logits"])
        torch.testing.assert_close(logits[real], want[real], rtol=0, atol=1e-5)
        assert greedy_search(fast, src, 1.0, 5) == without_fast["greedy"]
        beams = beam_search(fast, src, beam=3, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=2)
    for hyps, paper in zip(beams, without_fast["beam"], strict=True):
        assert [h.tokens for h in hyps] == [p[0] for p in paper]
        for h, (_, score) in zip(hyps, paper, strict=True):
            assert abs(h.score - score) < 1e-4
    fast.train()
    features = fast(src, tgt[:, :-1], features_only=True)
    loss, nll = generator_loss(features, fast.generator.weight, tgt[:, 1:], 0.1, cpu_kernels=True)
    loss.backward()
    assert loss.item() == pytest.approx(without_fast["loss"], rel=1e-4)
    assert nll.item() == pytest.approx(without_fast["nll"], rel=1e-4)
    grads = {n: p.grad for n, p in fast.named_parameters() if p.grad is not None}
    assert grads.keys() == without_fast["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, torch.tensor(without_fast["grads"][name]), rtol=0, atol=1e-5
        )


def test_bpe_dropout_draws_the_same_without_fast(without_fast: dict, small_data: Path) -> None:  # type: ignore[type-arg]
    assert "bpe_dropout" in speed.IMPLEMENTATIONS
    corpus = load_corpus(small_data, "train")
    epoch = BPEDropout(corpus, load_tokenizer(small_data), 0.1, 256).epoch(42)
    assert [[epoch.src(i), epoch.tgt(i)] for i in range(len(epoch))] == without_fast["bpe_dropout"]
