"""The training loop's log: each logged loss is the token-weighted mean of its interval."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from aiayn.config import apply_overrides, get_preset
from aiayn.data import prepare
from aiayn.files import read_lines
from aiayn.train import train

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="needs ../shared/data/multi30k")
def test_logged_loss_is_the_interval_mean(tmp_path: Path):
    for lang in ("en", "de"):
        lines = list(islice(read_lines(MULTI30K / f"train.{lang}.gz"), 150))
        (tmp_path / f"train.{lang}").write_text("".join(f"{x}\n" for x in lines))
    prepare("en", "de", tmp_path / "train", None, None, tmp_path / "prep", vocab_size=200)
    cfg = apply_overrides(get_preset("tiny"), {
        "N": 1, "d_model": 32, "d_ff": 64, "h": 2, "d_k": 16, "d_v": 16,
        "train.max_tokens": 300, "max_steps": 6, "log_interval_steps": 3,
        "save_interval_steps": 6})
    result = train(cfg, tmp_path / "prep", tmp_path / "run")
    logged = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text()
              .splitlines() if '"loss"' in x]
    assert [r["step"] for r in logged] == [3, 6]
    for record, steps in zip(logged, (result.history[:3], result.history[3:]), strict=True):
        tokens = sum(h["tgt_tokens"] for h in steps)
        mean = sum(h["loss"] * h["tgt_tokens"] for h in steps) / tokens
        assert record["loss"] == pytest.approx(mean, rel=1e-12)
        assert record["tgt_tokens"] == steps[-1]["tgt_tokens"]  # the rest is the step's own
