"""Watching a long run (aiayn.training.watch): valid BLEU every N steps, checkpoint_best.pt,
TensorBoard event files.

The task: a copy task over 15 distinct "sentences" of 3-7 words from a ten-word
dictionary; training draws 600 pairs from them, the validation set holds all 15 after one
more pair whose target has a character training never saw (so that the raw reference and
the decoded reference subwords differ). A one-layer model memorises the pairs fast enough
for valid BLEU to move from 0 to several points, and not monotonically, in 80 steps
(about 6 s on one thread).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sacrebleu.metrics import BLEU

from aiayn.checkpoints import BEST_NAME, list_checkpoints, load_checkpoint, load_model
from aiayn.config import ConfigError, DecodeConfig
from aiayn.data.corpus import load_corpus, load_manifest
from aiayn.data.prepare import prepare
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.translate import translate_lines
from aiayn.experiments.curves import read_log
from aiayn.training.trainer import train
from aiayn.training.watch import (
    TB_TAGS,
    Board,
    best_metric_name,
    bleu_subset,
    is_better,
)
from helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

EN = ["haus", "baum", "katze", "hund", "ball", "auto", "rot", "blau", "gross", "klein"]
DE = {w: w for w in EN}  # a copy task: learnt in tens of steps
SPECIAL = ("rot auto", "rot auto ü")  # "ü" is in no training sentence: <unk> once prepared
K = 12  # valid_bleu_sentences: the first 12 of the 16 validation pairs
WATCH: dict[str, Any] = {
    "N": 1,
    "d_model": 64,
    "d_ff": 128,
    "h": 2,
    "d_k": 16,
    "d_v": 16,
    "P_drop": 0.0,
    "train.max_tokens": 300,
    "warmup_steps": 30,
    "max_steps": 80,
    "save_interval_steps": 10,
    "keep_last": 20,
    "log_interval_steps": 1,
    "valid_interval_steps": 10,
    "valid_bleu_interval_steps": 10,
    "valid_bleu_sentences": K,
    "dtype": "fp32",
}


@pytest.fixture(scope="module")
def memo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Raw text files and the prepared directory (prep/) of the task above."""
    root = tmp_path_factory.mktemp("memo")
    rng = random.Random(0)
    base = [" ".join(rng.choice(EN) for _ in range(rng.randint(3, 7))) for _ in range(15)]
    pairs = [(s, " ".join(DE[w] for w in s.split())) for s in base]
    splits = {"train": [rng.choice(pairs) for _ in range(600)], "valid": [SPECIAL, *pairs]}
    for split, rows in splits.items():
        for side, lang in enumerate(("en", "de")):
            text = "".join(row[side] + "\n" for row in rows)
            (root / f"{split}.{lang}").write_text(text, encoding="utf-8")
    prepare("en", "de", root / "train", root / "valid", None, root / "prep", vocab_size=40)
    return root


@pytest.fixture(scope="module")
def watched(memo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 steps, validated (PPL and BLEU) and saved every 10."""
    run = tmp_path_factory.mktemp("watched") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures come before the one_thread fixture
    try:
        train(tiny_config(WATCH), memo_data / "prep", run)
    finally:
        torch.set_num_threads(threads)
    return run


def valid_records(run: Path) -> list[dict[str, Any]]:
    return [r for r in read_log(run) if "valid_nll" in r]


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# --------------------------------------------------------------------------- valid BLEU
def test_logged_bleu_is_sacrebleu_of_the_first_k_pairs_decoded_independently(
    watched: Path, memo_data: Path
) -> None:
    """At every validation: the logged BLEU = sacreBLEU of `aiayn translate`'s greedy
    output (from the raw source text, through the checkpoint of that step) for the first
    K validation lines against their raw references."""
    sources, refs = lines(memo_data / "valid.en")[:K], lines(memo_data / "valid.de")[:K]
    records = valid_records(watched)
    assert [r["step"] for r in records] == list(range(10, 81, 10))
    for r in records:
        model, tokenizer, _ = load_model(watched / f"checkpoint_{r['step']}.pt")
        hyps = translate_lines(model, tokenizer, sources, DecodeConfig(beam=1))
        expected = BLEU().corpus_score(hyps, [refs]).score
        assert r["valid_bleu"] == pytest.approx(expected, abs=1e-9), r["step"]
        assert r["valid_bleu_ref"] == "raw"
    scores = [r["valid_bleu"] for r in records]
    assert max(scores) > 1 and len(set(scores)) >= 3  # the check is not vacuous
    (event,) = [r for r in read_log(watched) if r.get("event") == "valid_bleu"]
    assert event["sentences"] == K and event["beam"] == 1 and event["reference"] == "raw"
    assert event["reference_source"] == str((memo_data / "valid.de").resolve())
    assert event["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")


def test_the_subset_is_the_first_k_pairs_and_falls_back_to_subwords(
    memo_data: Path, tmp_path: Path
) -> None:
    prep = memo_data / "prep"
    corpus, tok = load_corpus(prep, "valid"), Tokenizer.load(prep / "spm.model")
    manifest = load_manifest(prep)
    a = bleu_subset(corpus, tok, manifest, K, 1000)
    assert a == bleu_subset(corpus, tok, manifest, K, 1000)  # the same every time
    assert a.references == lines(memo_data / "valid.de")[:K] and a.reference_kind == "raw"
    assert [s[:-1] for s in a.sources] == [tok.encode(x) for x in lines(memo_data / "valid.en")[:K]]
    assert all(s[-1] == 3 for s in a.sources)  # EOS
    assert len(bleu_subset(corpus, tok, manifest, 0, 1000).sources) == 16  # 0 = all
    assert bleu_subset(corpus, tok, manifest, K, 2).sources[1] == [*a.sources[1][:2], 3]
    # the raw reference file changed: the decoded subwords, which render "ü" as " ⁇ "
    moved = json.loads(json.dumps(manifest))
    changed = tmp_path / "valid.de"
    changed.write_text("something else\n", encoding="utf-8")
    moved["inputs"]["valid"]["tgt"]["path"] = str(changed)
    b = bleu_subset(corpus, tok, moved, K, 1000)
    assert b.reference_kind == "subwords" and "changed since prepare" in b.reference_source
    assert a.references[0] == SPECIAL[1] and b.references[0].split() == ["rot", "auto", "⁇"]
    assert b.references[1:] == a.references[1:]


def test_valid_bleu_changes_nothing_in_training(memo_data: Path, tmp_path: Path) -> None:
    """Decoding (eval mode, no_grad) leaves train mode and the dropout draws as they were:
    the same losses and weights with valid BLEU on and off, dropout on."""
    runs = {}
    for every in (0, 10):
        runs[every] = tmp_path / f"bleu{every}"
        over = {"max_steps": 20, "P_drop": 0.1, "valid_bleu_interval_steps": every}
        train(tiny_config(WATCH, **over), memo_data / "prep", runs[every])
    off, on = runs[0], runs[10]
    assert [r["step"] for r in read_log(on) if "valid_bleu" in r] == [10, 20]
    assert all("valid_bleu" not in r for r in read_log(off))
    assert [r["loss"] for r in read_log(off) if "loss" in r] == [
        r["loss"] for r in read_log(on) if "loss" in r
    ]
    a = load_checkpoint(off / "checkpoint_20.pt")["model"]
    b = load_checkpoint(on / "checkpoint_20.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (off / BEST_NAME).exists()  # best_metric "auto" without BLEU: no best file


# --------------------------------------------------------------------------- best checkpoint
def _first_best(records: list[dict[str, Any]], key: str, higher: bool) -> dict[str, Any]:
    sign = -1 if higher else 1
    return min(records, key=lambda r: (sign * r[key], r["step"]))


def test_best_checkpoint_is_the_step_with_the_best_logged_bleu(watched: Path) -> None:
    records = valid_records(watched)
    best = _first_best(records, "valid_bleu", higher=True)
    assert best["step"] != records[-1]["step"]  # the best is not simply the last
    saved = load_checkpoint(watched / BEST_NAME)
    assert saved["step"] == best["step"]
    numbered = load_checkpoint(watched / f"checkpoint_{best['step']}.pt")["model"]
    assert saved["model"].keys() == numbered.keys()
    assert all(torch.equal(saved["model"][k], numbered[k]) for k in numbered)
    state = load_checkpoint(watched / "checkpoint_last.pt")["train_state"]
    assert state["best_checkpoint_step"] == best["step"]
    assert state["best_checkpoint_metric"] == "valid_bleu"
    assert state["best_checkpoint_value"] == best["valid_bleu"]
    # "best" marks exactly the validations that beat every earlier one
    running, flagged = -math.inf, []
    for r in records:
        if r["valid_bleu"] > running:
            running = r["valid_bleu"]
            flagged.append(r["step"])
    assert [r["step"] for r in records if r.get("best")] == flagged


def remove_checkpoints_after(run: Path, step: int) -> None:
    """As if the run had been killed right after saving checkpoint_<step>.pt."""
    for p in list_checkpoints(run):
        if int(p.stem.split("_")[1]) > step:
            p.unlink()
            p.with_name(p.name + ".sha256").unlink()
    (run / "checkpoint_last.pt").unlink()


def test_best_survives_keep_last_and_resume(watched: Path, memo_data: Path, tmp_path: Path):
    """Killed right after the best step's checkpoint and resumed with keep_last 1: the
    validations redone after it are no better (the best is the first best of the whole
    run), and each is compared with the best value the checkpoint's state carried, so
    checkpoint_best.pt stays as it was, while the numbered checkpoint of its step goes."""
    best = _first_best(valid_records(watched), "valid_bleu", higher=True)
    run = tmp_path / "run"
    shutil.copytree(watched, run)
    remove_checkpoints_after(run, best["step"])
    train(tiny_config(WATCH, keep_last=1), memo_data / "prep", run)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint_80.pt"]
    redone = [r for r in valid_records(run) if r["step"] > best["step"]]
    assert redone and any(r["valid_bleu"] < best["valid_bleu"] for r in redone)
    assert not any(r.get("best") for r in redone)
    assert load_checkpoint(run / BEST_NAME)["step"] == best["step"]
    assert (run / BEST_NAME).read_bytes() == (watched / BEST_NAME).read_bytes()
    state = load_checkpoint(run / "checkpoint_80.pt")["train_state"]
    assert state["best_checkpoint_step"] == best["step"]


def test_best_by_perplexity(memo_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "ppl"
    over = {"max_steps": 30, "valid_bleu_interval_steps": 0, "best_metric": "ppl"}
    train(tiny_config(WATCH, **over), memo_data / "prep", run)
    records = valid_records(run)
    best = _first_best(records, "valid_ppl", higher=False)
    assert load_checkpoint(run / BEST_NAME)["step"] == best["step"]
    assert load_checkpoint(run / BEST_NAME)["train_state"]["best_checkpoint_metric"] == "valid_ppl"


def test_is_better_and_the_metric_chosen() -> None:
    assert is_better("valid_bleu", 0.0, "", 0.0)  # the first one always
    assert not is_better("valid_bleu", 5.0, "valid_bleu", 5.0)  # a tie keeps the earlier
    assert is_better("valid_bleu", 5.1, "valid_bleu", 5.0)
    assert is_better("valid_ppl", 9.0, "valid_ppl", 10.0)
    assert not is_better("valid_ppl", 11.0, "valid_ppl", 10.0)
    assert is_better("valid_ppl", 11.0, "valid_bleu", 30.0)  # another metric's best
    assert not is_better("valid_ppl", math.nan, "", 0.0)
    t = tiny_config(WATCH).train
    assert best_metric_name(t) == "valid_bleu"
    assert best_metric_name(tiny_config(WATCH, valid_bleu_interval_steps=0).train) is None
    assert best_metric_name(tiny_config(WATCH, best_metric="ppl").train) == "valid_ppl"
    assert best_metric_name(tiny_config(WATCH, best_metric="none").train) is None


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"valid_bleu_interval_steps": 15}, "must be a multiple of train.valid_interval_steps"),
        ({"valid_bleu_beam": 0}, "valid_bleu_beam must be >= 1"),
        ({"valid_bleu_sentences": -1}, "valid_bleu_sentences must be >= 0"),
        ({"best_metric": "bleu", "valid_bleu_interval_steps": 0}, "valid BLEU is off"),
        ({"best_metric": "loss"}, "'auto', 'bleu', 'ppl' or 'none'"),
    ],
)
def test_bad_watch_settings_are_refused(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(WATCH, **over)


# --------------------------------------------------------------------------- TensorBoard
def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def jsonl_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_log(run):  # a resumed run: the later pass of redone steps
        if "event" in r:
            continue
        for key, tag in TB_TAGS.items():
            if key in r:
                out.setdefault(tag, []).append((r["step"], float(r[key])))
    return out


def assert_same_scalars(run: Path) -> None:
    tb, js = tensorboard_scalars(run), jsonl_scalars(run)
    assert set(tb) == set(js)
    for tag in js:
        assert [s for s, _ in tb[tag]] == [s for s, _ in js[tag]], tag
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in js[tag]], rel=1e-6), tag


def test_tensorboard_holds_the_logged_numbers(watched: Path) -> None:
    assert_same_scalars(watched)
    tags = set(tensorboard_scalars(watched))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= tags
    assert {"valid/ppl", "valid/nll", "valid/bleu"} <= tags


def test_tensorboard_after_a_resume_keeps_the_later_pass(
    watched: Path, memo_data: Path, tmp_path: Path
) -> None:
    """Resumed from step 40 (the checkpoints after it removed), steps 41-80 are done
    twice: the event files show each step once, as train_log.jsonl's readers do."""
    run = tmp_path / "run"
    shutil.copytree(watched, run)
    remove_checkpoints_after(run, 40)
    train(tiny_config(WATCH), memo_data / "prep", run)
    assert len(list((run / "tensorboard").iterdir())) == 2  # one event file per process
    assert_same_scalars(run)
    steps = [s for s, _ in tensorboard_scalars(run)["train/loss"]]
    assert steps == list(range(1, 81))


def test_without_tensorboard_a_one_line_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    board = Board(tmp_path / "tb", enabled=True)
    with caplog.at_level(logging.WARNING, logger="aiayn.training.watch"):
        board.write({"step": 1, "loss": 2.0})
        board.write({"step": 2, "loss": 1.0})
        board.flush()
        board.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert "pip install 'aiayn[watch]'" in warnings[0].getMessage()
    assert not (tmp_path / "tb").exists()


def test_tensorboard_off(memo_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = {"max_steps": 10, "valid_bleu_interval_steps": 0, "tensorboard": False}
    train(tiny_config(WATCH, **over), memo_data / "prep", run)
    assert not (run / "tensorboard").exists() and (run / "train_log.jsonl").is_file()


# --------------------------------------------------------------------------- two ranks
@pytest.mark.slow
def test_two_ranks_only_rank_0_decodes(memo_data: Path, tmp_path: Path, torchrun: list[str]):
    """Under torchrun (gloo): rank 0 decodes while rank 1 waits at the barrier; one log,
    one event file, one best checkpoint, the same BLEU as the decoded checkpoint gives."""
    import os

    run = tmp_path / "ddp"
    over = {**WATCH, "max_steps": 20}
    sets = [arg for k, v in over.items() for arg in ("--set", f"{k}={v}")]
    env = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun, "--nproc-per-node=2", "-m", "aiayn", "train", str(memo_data / "prep")]
    proc = subprocess.run(
        [*cmd, "--out", str(run), "--preset", "tiny", "--no-progress", *sets],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = valid_records(run)
    assert [r["step"] for r in records] == [10, 20]  # logged once, by rank 0
    assert len(list((run / "tensorboard").iterdir())) == 1
    sources, refs = lines(memo_data / "valid.en")[:K], lines(memo_data / "valid.de")[:K]
    for r in records:
        model, tokenizer, _ = load_model(run / f"checkpoint_{r['step']}.pt")
        hyps = translate_lines(model, tokenizer, sources, DecodeConfig(beam=1))
        assert r["valid_bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
    best = _first_best(records, "valid_bleu", higher=True)
    assert load_checkpoint(run / BEST_NAME)["step"] == best["step"]
