"""The WMT14 recipes (Table 2 at full scale): each config holds the paper's numbers, each
starts and runs to its scores on the CPU with a micro override (synthetic WMT-like text in
place of the corpus), and `aiayn recipe` under torchrun prepares once, trains on every rank
and reports once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aiayn.data.synthetic import write_corpus
from aiayn.experiments.recipe import run_recipe
from aiayn.experiments.tasks import load_recipe
from helpers import ROOT

CONFIGS = {
    "wmt14-en-de-base.toml": ("de", "base"),
    "wmt14-en-de-big.toml": ("de", "big"),
    "wmt14-en-fr-big.toml": ("fr", "big"),
}

# A one-layer d_model 32 model, 4 steps of a global batch of 800 tokens a side cut into
# per-rank batches of at most 400 (so accumulation 2 on one rank), a checkpoint every 2
# steps, validation (PPL and greedy BLEU on 10 sentences) every 2, outputs <= input + 5.
MICRO: dict[str, Any] = {
    "model.N": 1,
    "model.d_model": 32,
    "model.d_ff": 64,
    "model.h": 2,
    "model.d_k": 16,
    "model.d_v": 16,
    "train.max_steps": 4,
    "train.warmup_steps": 2,
    "train.global_batch_tokens": 800,
    "train.max_tokens": 400,
    "train.save_interval_steps": 2,
    "train.save_interval_minutes": 0,
    "train.valid_interval_steps": 2,
    "train.valid_bleu_interval_steps": 2,
    "train.valid_bleu_sentences": 10,
    "train.log_interval_steps": 1,
    "train.preflight": False,
    "train.tensorboard": False,
    "decode.max_len_b": 5,
    "recipe.vocab_size": 300,
}


def wmt_like_text(root: Path, lang: str) -> Path:
    """train (1,500 pairs), valid and test (30 each) of synthetic WMT-like text, named as
    `aiayn data wmt14` names its output."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 1500, 0), ("valid", 30, 1), ("test", 30, 2)):
        write_corpus(root / split, n, source_lang="en", target_lang=lang, seed=seed, gz=False)
    return root


@pytest.mark.parametrize("name", CONFIGS)
def test_each_wmt14_config_holds_the_papers_numbers(name):
    lang, size = CONFIGS[name]
    cfg, recipe = load_recipe(ROOT / "configs" / name)
    m, t, d = cfg.model, cfg.train, cfg.decode
    assert (m.N, m.d_k, m.d_v) == (6, 64, 64)
    if size == "base":  # Table 3's base row
        assert (m.d_model, m.d_ff, m.h, m.P_drop) == (512, 2048, 8, 0.1)
        assert (t.max_steps, recipe.average_last) == (100_000, 5)
    else:  # Table 3's big row; section 6.1: P_drop 0.1 for En-Fr
        assert (m.d_model, m.d_ff, m.h) == (1024, 4096, 16)
        assert m.P_drop == (0.1 if lang == "fr" else 0.3)
        assert (t.max_steps, recipe.average_last) == (300_000, 20)
    assert t.keep_last >= recipe.average_last
    # section 5: ~25,000 tokens a side a step, warmup 4000, eps_ls 0.1, checkpoints every 10
    # minutes; Adam's betas and epsilon
    assert (t.global_batch_tokens, t.warmup_steps, t.eps_ls) == (25000, 4000, 0.1)
    assert (t.save_interval_minutes, t.save_interval_steps) == (10, 0)
    assert (t.beta1, t.beta2, t.adam_eps, t.lr_scale) == (0.9, 0.98, 1e-9, 1.0)
    assert t.dtype == "auto"
    # section 6.1: beam 4, alpha 0.6, output length <= input + 50
    assert (d.beam, d.alpha, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)
    assert (recipe.dataset, recipe.source_lang, recipe.target_lang) == ("wmt14", "en", lang)
    assert (recipe.vocab_size, recipe.vocab_model) == (
        (37000, "bpe") if lang == "de" else (32000, "unigram")
    )
    assert (recipe.valid_split, recipe.test_split, recipe.tune_alpha) == ("valid", "test", ())


@pytest.mark.parametrize("name", CONFIGS)
def test_each_wmt14_config_runs_to_its_scores_with_a_micro_override(tmp_path, name):
    lang, _ = CONFIGS[name]
    text = wmt_like_text(tmp_path / "text", lang)
    out = tmp_path / "run"
    results = run_recipe(ROOT / "configs" / name, out, data=text, overrides=dict(MICRO))
    assert results["train"]["steps"] == 4 and results["pair"] == f"en-{lang}"
    scores = results["scores"]
    assert scores["n_lines"] == 30 and 0 <= scores["paper_bleu"] <= 100
    manifest = json.loads((out / "data" / "prepared" / "manifest.json").read_text())
    assert manifest["format"] == 2  # the streaming prepare's memory-mapped arrays
    # the text was read in place: nothing downloaded or copied
    assert not (out / "data" / "raw").exists()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    batch = next(r for r in log if r.get("event") == "batch")
    assert (batch["global_batch_tokens"], batch["ranks"], batch["accumulation"]) == (800, 1, 2)
    assert any("valid_bleu" in r for r in log)
    assert (out / "checkpoint_best.pt").is_file()
    # a rerun reuses the prepared data and the finished training
    stamp = (out / "data" / "prepared" / "manifest.json").stat().st_mtime_ns
    run_recipe(ROOT / "configs" / name, out, data=text, overrides=dict(MICRO))
    assert (out / "data" / "prepared" / "manifest.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_the_recipe_under_torchrun_prepares_once_trains_on_every_rank_reports_once(
    tmp_path, torchrun
):
    text = wmt_like_text(tmp_path / "text", "de")
    out = tmp_path / "run"
    sets = [arg for k, v in MICRO.items() for arg in ("--set", f"{k}={v}")]
    env = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun, "--nproc-per-node=2", "-m", "aiayn", "recipe"]
    cmd += [str(ROOT / "configs" / "wmt14-en-de-base.toml"), "--data", str(text)]
    cmd += ["--out", str(out), "--no-progress", *sets]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("results: ") == 1  # rank 0 alone reports
    assert done.stderr.count("encoded in ") == 1  # rank 0 alone prepared the data
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    batch = next(r for r in log if r.get("event") == "batch")
    # the same global batch on 2 ranks: 2 ranks x 1 accumulation (one rank took 2 above)
    assert (batch["global_batch_tokens"], batch["ranks"], batch["accumulation"]) == (800, 2, 1)
    results = json.loads((out / "results.json").read_text())
    assert results["train"]["steps"] == 4 and results["scores"]["n_lines"] == 30
