"""A careless user's mistakes (issue 53): each one refused before any work, or survived
without loss, with one line naming the file, line or key and an exit code that says which
kind of failure it was (2: a command that cannot be meant; 1: bad input; 4: the system
refused). Each test names its row of docs/reliability.md; negative controls show that the
same commands, given right, still work."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn.checkpoints import CheckpointError, load_checkpoint, save_checkpoint_file, sidecar_path
from aiayn.checkpoints import io as checkpoint_io
from aiayn.experiments.curves import read_log
from aiayn.files import sha256_file
from aiayn.training.trainer import train
from helpers import (
    MULTI30K,
    ROOT,
    SMALL_TRAINING,
    assert_one_line_error,
    cli,
    tiny_config,
)

SMALL = {**SMALL_TRAINING, "max_steps": 10, "save_interval_steps": 5}
ENV = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIAYN_NO_MALLOC_TUNING", "1")


@pytest.fixture(scope="module")
def run_dir(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-step run with checkpoints at steps 5 and 10."""
    run = tmp_path_factory.mktemp("careless") / "run"
    train(tiny_config(SMALL), small_data, run)
    return run


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of a run directory's files (plain copies: no hard link to the fixture's)."""
    to.mkdir()
    for f in run_dir.iterdir():
        if f.is_file():
            (to / f.name).write_bytes(f.read_bytes())
    return to


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.en"
    path.write_text("A man rides a bike .\nTwo dogs play .\n", encoding="utf-8")
    return path


def translate(*argv: str | Path, checkpoint: Path) -> tuple[int, str, str]:
    return cli("translate", "--checkpoint", checkpoint, "--no-progress", "--beam", "1", *argv)


# --------------------------------------------------------------------------- 1: translate
@pytest.mark.rows("F15")
def test_translate_refuses_an_output_that_is_its_input(run_dir: Path, source: Path) -> None:
    before = source.read_bytes()
    code, _, err = translate(
        "--input", source, "--output", source, checkpoint=run_dir / "checkpoint_last.pt"
    )
    assert code == 2
    assert_one_line_error(err, str(source), "also an input")
    assert source.read_bytes() == before


@pytest.mark.rows("F15")
def test_translate_refuses_an_output_that_is_the_checkpoint(
    run_dir: Path, source: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes((run_dir / "checkpoint_last.pt").read_bytes())
    before = sha256_file(ckpt)
    code, _, err = translate("--input", source, "--output", ckpt, checkpoint=ckpt)
    assert code == 2
    assert_one_line_error(err, str(ckpt), "also an input")
    assert sha256_file(ckpt) == before
    # any other checkpoint (a zip archive) is not replaced either, without --force
    other = tmp_path / "other.pt"
    other.write_bytes(ckpt.read_bytes())
    code, _, err = translate("--input", source, "--output", other, checkpoint=ckpt)
    assert code == 2
    assert_one_line_error(err, str(other), "--force")
    # negative control: a new file, and a text file from an earlier run, are written
    for out in (tmp_path / "hyp.de", tmp_path / "hyp.de"):
        code, _, err = translate("--input", source, "--output", out, checkpoint=ckpt)
        assert code == 0, err
        assert len(out.read_text(encoding="utf-8").splitlines()) == 2


@pytest.mark.rows("F16")
@pytest.mark.parametrize(
    "case", ["missing directory", "a directory", "device foo", "no cuda", "int8 bits"]
)
def test_translate_refuses_a_path_or_device_it_cannot_use(
    run_dir: Path, source: Path, tmp_path: Path, case: str, monkeypatch
) -> None:
    """Before loading the model: no traceback, one line naming what is wrong."""
    args: list[str | Path] = ["--input", source, "--output", tmp_path / "hyp.de"]
    name: str | Path = tmp_path / "nowhere"
    if case == "missing directory":
        args[3] = tmp_path / "nowhere" / "hyp.de"
    elif case == "a directory":
        args[3] = name = tmp_path
    elif case == "device foo":
        args += ["--device", "foo"]
        name = "foo"
    elif case == "int8 bits":  # AIAYN_INT8_ACTIVATIONS takes 7 or 8
        monkeypatch.setenv("AIAYN_INT8_ACTIVATIONS", "6")
        args += ["--dtype", "int8"]
        name = "AIAYN_INT8_ACTIVATIONS"
    else:
        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
        args += ["--device", "cuda"]
        name = "cuda"
    code, _, err = translate(*args, checkpoint=run_dir / "checkpoint_last.pt")
    assert code == 2
    assert_one_line_error(err, str(name))


@pytest.mark.rows("F16")
def test_translate_names_a_truncated_gzip_input(run_dir: Path, tmp_path: Path) -> None:
    import gzip

    whole = gzip.compress(("A man rides a bike .\n" * 2000).encode())
    cut = tmp_path / "source.en.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    code, _, err = translate(
        "--input", cut, "--output", tmp_path / "hyp.de", checkpoint=run_dir / "checkpoint_last.pt"
    )
    assert code == 1
    assert_one_line_error(err, str(cut), "truncated or corrupt gzip")
    assert not (tmp_path / "hyp.de").exists()


@pytest.mark.rows("F17")
def test_a_full_disk_while_translating_leaves_no_partial_output(
    run_dir: Path, source: Path, tmp_path: Path
) -> None:
    """The output's temporary file exceeds the file-size limit (a full disk's stand-in):
    exit 4 with one line, no output file, no temporary file left."""
    big = tmp_path / "big.en"
    big.write_text("A man rides a bike down the street .\n" * 400, encoding="utf-8")
    out = tmp_path / "out" / "hyp.de"
    out.parent.mkdir()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "translate",
            "--checkpoint",
            str(run_dir / "checkpoint_last.pt"),
            "--input",
            str(big),
            "--output",
            str(out),
            "--beam",
            "1",
            "--no-progress",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert_one_line_error(proc.stderr, str(out))
    assert list(out.parent.iterdir()) == []


# --------------------------------------------------------------------------- 2, 3: average
@pytest.mark.rows("I7")
def test_average_refuses_to_replace_a_training_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    before = sha256_file(run / "checkpoint_10.pt")
    for force in ((), ("--force",)):  # one of the inputs: never replaced
        code, _, err = cli("average", run, "--last", "2", "--out", run / "checkpoint_10.pt", *force)
        assert code == 2
        assert_one_line_error(err, "checkpoint_10.pt", "also an input")
    code, _, err = cli("average", run / "checkpoint_5.pt", "--out", run / "checkpoint_10.pt")
    assert code == 2  # a training checkpoint that is not an input: never either (B9)
    assert_one_line_error(err, "checkpoint_10.pt", "never the output")
    assert sha256_file(run / "checkpoint_10.pt") == before
    # negative control: a new file, then the same command again over its own average
    for _ in range(2):
        code, _, err = cli("average", run, "--last", "2", "--out", run / "avg.pt")
        assert code == 0, err


@pytest.mark.rows("A13")
def test_resuming_with_a_smaller_keep_last_says_what_it_will_delete(
    run_dir: Path, small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = copy_run(run_dir, tmp_path / "run")
    with caplog.at_level("INFO"):
        train(tiny_config(SMALL, max_steps=15, keep_last=1), small_data, run)
    warning = [r.message for r in caplog.records if "keep_last is 1" in r.getMessage()]
    assert warning and "checkpoint_5.pt, checkpoint_10.pt" in caplog.text
    assert "deleted" in caplog.text and sorted(p.name for p in run.glob("checkpoint_*.pt")) == [
        "checkpoint_15.pt",
        "checkpoint_last.pt",
    ]


@pytest.mark.rows("I3")
def test_average_refuses_independently_trained_models(
    run_dir: Path, small_data: Path, tmp_path: Path
) -> None:
    """Two runs of the same preset with different seeds: their average is no model."""
    other = tmp_path / "seed2"
    train(tiny_config(SMALL, seed=2, max_steps=5), small_data, other)
    a, b = run_dir / "checkpoint_5.pt", other / "checkpoint_5.pt"
    code, _, err = cli("average", a, b, "--out", tmp_path / "avg.pt")
    assert code == 1
    assert_one_line_error(err, "seed", "--force")
    code, _, err = cli("average", a, b, "--out", tmp_path / "avg.pt", "--force")
    assert code == 0, err
    # negative control: two checkpoints of one run average without a word
    code, _, err = cli("average", a, run_dir / "checkpoint_10.pt", "--out", tmp_path / "ok.pt")
    assert code == 0, err


# --------------------------------------------------------------------------- 4, 10: prepare
def _prepare(tmp_path: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return cli(
        "prepare",
        "-s",
        "en",
        "-t",
        "de",
        "--trainpref",
        tmp_path / "train",
        "--out",
        out,
        "--vocab-size",
        "60",
        *extra,
    )


def _corpus(tmp_path: Path, lines: int) -> None:
    for lang, text in (("en", "a man rides a bike"), ("de", "ein mann fährt rad")):
        (tmp_path / f"train.{lang}").write_text(
            "".join(f"{text} {i}\n" for i in range(lines)), encoding="utf-8"
        )


@pytest.mark.rows("E9")
def test_prepare_refuses_to_replace_a_prepared_set(tmp_path: Path) -> None:
    _corpus(tmp_path, 50)
    out = tmp_path / "prep"
    code, _, err = _prepare(tmp_path, out)
    assert code == 0, err
    vocab = sha256_file(out / "spm.model")
    code, _, err = _prepare(tmp_path, out)
    assert code == 2
    assert_one_line_error(err, str(out), "--force")
    assert sha256_file(out / "spm.model") == vocab
    code, _, err = _prepare(tmp_path, out, "--force")  # negative control
    assert code == 0, err


@pytest.mark.rows("E10")
def test_prepare_on_empty_files_names_them(tmp_path: Path) -> None:
    _corpus(tmp_path, 0)
    code, _, err = _prepare(tmp_path, tmp_path / "prep")
    assert code == 1
    assert_one_line_error(err, "train.en", "train.de", "no training text")
    assert not (tmp_path / "prep").exists()


# --------------------------------------------------------------------------- 5: checkpoints
@pytest.mark.rows("B7")
def test_a_flipped_bit_without_a_manifest_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """The checkpoint copied alone (no .sha256 beside it) with one bit flipped inside a
    tensor: refused by the digest the file carries, naming the file; translate exits 1."""
    ckpt = tmp_path / "alone.pt"
    data = bytearray((run_dir / "checkpoint_last.pt").read_bytes())
    assert not sidecar_path(ckpt).exists()
    load_checkpoint(run_dir / "checkpoint_last.pt")  # negative control: the intact copy loads
    data[len(data) // 2] ^= 0x10  # inside the tensor data, not the zip's bookkeeping
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"alone\.pt: .* corrupt"):
        load_checkpoint(ckpt)
    code, _, err = cli("translate", "--checkpoint", ckpt, "--no-progress")
    assert code == 1
    assert_one_line_error(err, str(ckpt), "corrupt")


@pytest.mark.rows("B8")
def test_non_finite_weights_are_refused_at_load(run_dir: Path, tmp_path: Path) -> None:
    """A NaN weight written by something other than aiayn (its save refuses them: C3),
    with a matching digest: refused at load, naming the tensor."""
    ckpt = load_checkpoint(run_dir / "checkpoint_last.pt")
    key = next(iter(ckpt["model"]))
    ckpt["model"][key] = ckpt["model"][key].clone()
    ckpt["model"][key].view(-1)[0] = float("nan")
    ckpt[checkpoint_io.INTEGRITY_KEY] = {"sha256": checkpoint_io.content_digests(ckpt)}
    torch.save(ckpt, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError, match=rf"nan\.pt: model tensor '{key}' holds NaN"):
        load_checkpoint(tmp_path / "nan.pt")


# --------------------------------------------------------------------------- 6, 9: config
@pytest.mark.rows("J5")
@pytest.mark.parametrize("table", ["trian", "Train"])
def test_a_misspelt_table_is_refused(small_data: Path, tmp_path: Path, table: str) -> None:
    config = tmp_path / "x.toml"
    config.write_text(f'preset = "tiny"\n[{table}]\nmax_steps = 5\n', encoding="utf-8")
    code, _, err = cli("train", small_data, "--out", tmp_path / "run", "--config", config)
    assert code == 2
    assert_one_line_error(err, f"'{table}'", "'train'")
    assert not (tmp_path / "run").exists()


@pytest.mark.rows("J6")
@pytest.mark.parametrize("case", ["missing", "directory"])
def test_a_config_path_that_is_no_file_is_refused(tmp_path: Path, case: str) -> None:
    config = tmp_path / "none.toml" if case == "missing" else tmp_path
    code, _, err = cli("train", tmp_path, "--out", tmp_path / "run", "--config", config)
    assert code == 2
    assert_one_line_error(err, str(config))


@pytest.mark.rows("J7")
def test_train_refuses_an_unknown_device(small_data: Path, tmp_path: Path) -> None:
    code, _, err = cli(
        "train", small_data, "--out", tmp_path / "run", "--preset", "tiny", "--device", "foo"
    )
    assert code == 2
    assert_one_line_error(err, "foo")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- 8: evaluate
@pytest.mark.rows("H7")
def test_evaluate_refuses_an_unknown_language(tmp_path: Path) -> None:
    hyp = tmp_path / "hyp"
    hyp.write_text("a b c\n", encoding="utf-8")
    code, _, err = cli("evaluate", "--hyp", hyp, "--ref", hyp, "--lang", "xx")
    assert code == 1
    assert_one_line_error(err, "'xx'", "known:")
    code, out, err = cli("evaluate", "--hyp", hyp, "--ref", hyp, "--lang", "de")  # control
    assert code == 0 and "BLEU" in out, err


# --------------------------------------------------------------------------- 11: recipe
@pytest.mark.rows("A14")
@pytest.mark.skipif(not MULTI30K.is_dir(), reason="needs ../shared/data/multi30k")
def test_sigterm_during_a_recipe_stops_the_recipe(tmp_path: Path) -> None:
    """Training saves and stops on SIGTERM; the recipe then stops too (exit 143), with no
    average, decoding or results of an unfinished model; the same command resumes."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "aiayn",
        "recipe",
        str(ROOT / "configs" / "multi30k-en-de.toml"),
        "--data",
        str(MULTI30K),
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "recipe.max_train_pairs=300",
        "--set",
        "recipe.max_test_pairs=20",
        "--set",
        "recipe.tune_alpha=0.6",
        "--set",
        "max_steps=6",
        "--set",
        "save_interval_steps=3",
        "--set",
        "N=1",
        "--set",
        "d_model=32",
        "--set",
        "d_ff=64",
        "--set",
        "h=2",
        "--set",
        "d_k=16",
        "--set",
        "d_v=16",
        "--set",
        "dtype=fp32",
    ]
    env = {**ENV, "AIAYN_FAULTS": "term_at_step=4"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "rerun the same command" in proc.stderr
    assert (out / "checkpoint_4.pt").exists()
    assert not (out / "checkpoint_avg.pt").exists() and not (out / "results.json").exists()
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=600)
    results = json.loads((out / "results.json").read_text())
    # done: 0, or 3 where six steps left the model unusable (results.json says so)
    assert proc.returncode == (3 if "not_trained_enough" in results else 0), proc.stderr[-3000:]
    assert results["train"]["steps"] == 6


# --------------------------------------------------------------------------- 12: the log
@pytest.mark.rows("A15")
def test_a_resumed_runs_log_marks_the_resume_and_keeps_the_last_validation(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash at step 8 and a resume from step 5: train_log.jsonl says so, `read_log`
    gives each step once (its second pass), and the run's last validation (step 12, not a
    multiple of the interval) is in its last checkpoint."""
    cfg = tiny_config(SMALL, max_steps=12, valid_interval_steps=10)
    run = tmp_path / "run"
    monkeypatch.setenv("AIAYN_FAULTS", "raise_at_step=8")
    with pytest.raises(RuntimeError, match="injected fault"):
        train(cfg, small_data, run)
    monkeypatch.delenv("AIAYN_FAULTS")
    train(cfg, small_data, run)
    raw = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw if r.get("event") == "resumed"] == [5]
    steps = [r["step"] for r in read_log(run) if "loss" in r and "event" not in r]
    assert steps == list(range(1, 13))  # steps 6 and 7 were logged twice in the raw file
    last_valid = [r for r in read_log(run) if "valid_nll" in r][-1]
    assert last_valid["step"] == 12
    state = load_checkpoint(run / "checkpoint_last.pt")["train_state"]
    assert state["best_valid_nll"] == min(r["valid_nll"] for r in read_log(run) if "valid_nll" in r)


def test_the_digest_is_checked_only_where_the_file_carries_one(tmp_path: Path) -> None:
    """A checkpoint saved by aiayn carries its digest; save_checkpoint_file of a loaded
    checkpoint writes a fresh one (loading hands back the content without it)."""
    ckpt = {
        "format": checkpoint_io.FORMAT,
        "config": {},
        "vocab_sha256": "",
        "step": 1,
        "model": {"w": torch.ones(3)},
    }
    save_checkpoint_file(tmp_path / "a.pt", ckpt)
    raw = torch.load(tmp_path / "a.pt", weights_only=True)
    assert checkpoint_io.INTEGRITY_KEY in raw
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert checkpoint_io.INTEGRITY_KEY not in loaded
    save_checkpoint_file(tmp_path / "b.pt", loaded)
    assert load_checkpoint(tmp_path / "b.pt")["step"] == 1


# ------------------------------------------------- found by scripts/hostile_inputs.py
@pytest.mark.rows("E11")
@pytest.mark.parametrize("case", ["a file", "an empty directory"])
def test_data_from_a_place_without_the_corpus_is_an_error(
    tmp_path: Path, source: Path, case: str
) -> None:
    """Before: every file "not found, skipped" and exit 0 with nothing copied."""
    where = source if case == "a file" else tmp_path / "empty"
    if case != "a file":
        where.mkdir()
    code, _, err = cli("data", "multi30k", "--from", where, "--out", tmp_path / "d")
    assert code == 1
    assert_one_line_error(err, str(where))


@pytest.mark.rows("J8")
@pytest.mark.parametrize(
    "argv",
    [
        ("train", "--steps", "0"),
        ("train", "--batch-sentences", "0"),
        ("decode", "--sentences", "0"),
        ("decode", "--out-len", "0"),
    ],
)
def test_bench_refuses_counts_below_one(argv: tuple[str, ...]) -> None:
    """Before: exit 0 with nothing measured, or "no median for empty data"."""
    code, _, err = cli("bench", argv[0], "--preset", "tiny", *argv[1:])
    assert code == 2
    assert_one_line_error(err, argv[1], ">= 1")


# --------------------------------------------------------------------------- parsing (issue 54)
GOLD = "(S (NP (DT a)) (VP (VB b)))\n"


def test_a_treebank_with_an_unbalanced_tree_is_named_by_member_and_line(tmp_path: Path) -> None:
    import zipfile

    bad = tmp_path / "treebank.zip"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(
            "treebank/combined/wsj_0001.mrg",
            "( (S (NP (DT a)) (VP (VB b))) )\n\n( (S (NP (DT a)\n  (VP (VB b))) \n",
        )
    code, _, err = cli("data", "ptb", "--from", bad, "--out", tmp_path / "out")
    assert code == 1
    assert_one_line_error(err, f"{bad}/treebank/combined/wsj_0001.mrg:3", "unbalanced bracket")
    assert not (tmp_path / "out" / "train.trees").exists()
    code, _, err = cli("data", "ptb", "--from", tmp_path / "nothere", "--out", tmp_path / "o")
    assert code == 2
    assert_one_line_error(err, "nothere", "no such file")


def test_tree_files_that_do_not_align_are_refused_naming_both(tmp_path: Path) -> None:
    gold, hyp = tmp_path / "gold.trees", tmp_path / "hyp.trees"
    gold.write_text(GOLD * 2)
    hyp.write_text(GOLD)  # a line missing
    code, _, err = cli("evaluate", "--task", "parse", "--hyp", hyp, "--ref", gold)
    assert code == 1
    assert_one_line_error(err, "gold.trees has 2 lines", "hyp.trees has 1")
    hyp.write_text(GOLD * 2)  # negative control
    code, out, _ = cli("evaluate", "--task", "parse", "--hyp", hyp, "--ref", gold)
    assert code == 0 and "F1 100.00" in out


def test_parse_refuses_an_empty_sentence_naming_its_line(run_dir: Path, tmp_path: Path) -> None:
    words = tmp_path / "in.words"
    words.write_text("a b\n\nc d\n")
    out = tmp_path / "out.trees"
    args = ["parse", "--checkpoint", run_dir / "checkpoint_10.pt", "--no-progress"]
    code, _, err = cli(*args, "--input", words, "--output", out, "--beam", "1")
    assert code == 1
    assert_one_line_error(err, f"{words}:2: empty sentence")
    assert not out.exists()
    code, _, err = cli(*args, "--input", words, "--output", words)
    assert code == 2  # an output over its input, refused before loading anything
    code, _, err = cli(*args, "--input", words, "--max-depth", "0")
    assert code == 2
    assert_one_line_error(err, "--max-depth must be >= 1, got 0")
    code, _, err = cli(*args, "--input", words, "--limits-from", tmp_path / "none.linw")
    assert code == 1
    assert_one_line_error(err, "none.linw: no such file")


def test_new_commands_refuse_bad_paths_and_numbers_in_one_line(tmp_path: Path) -> None:
    """What scripts/hostile_inputs.py found in serve, table1 and table3: each now one line."""
    a_file = tmp_path / "a.txt"
    a_file.write_text("x\n", encoding="utf-8")
    code, _, err = cli("serve", "--checkpoint", tmp_path / "c.pt", "--port", "70000")
    assert code == 2
    assert_one_line_error(err, "--port 70000")
    code, _, err = cli("table1", "--n-max", "32", "--out", a_file)
    assert code == 2
    assert_one_line_error(err, "a.txt", "is a file")
    code, _, err = cli("table3", "--csv", tmp_path / "no.csv", "--markdown")
    assert code == 2
    assert_one_line_error(err, "no.csv")
    (tmp_path / "bin.csv").write_bytes(b"\xff\xfe\x00binary")
    code, _, err = cli("table3", "--csv", tmp_path / "bin.csv", "--markdown")
    assert code == 1
    assert_one_line_error(err, "bin.csv", "not UTF-8")
