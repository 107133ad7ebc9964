"""End to end through the `aiayn` command, in-process, on a few hundred Multi30k pairs.

The paper's pipeline (sections 5 and 6.1) in miniature: prepare a shared subword vocabulary,
train, average the last checkpoints, beam-search translate, score with BLEU. Plus the
command-line promises of RELIABILITY.md: bad input is one line on stderr and a non-zero
exit, never a traceback (E1, H1, J1, F12).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.config import get_preset
from aiayn.model import parameter_formula
from helpers import MULTI30K  # noqa: E402

needs_multi30k = pytest.mark.skipif(
    not (MULTI30K / "train.en.gz").is_file(),
    reason=f"Multi30k not found at {MULTI30K} (see shared/data/README.md)",
)

N_TRAIN, N_VALID, N_TRANSLATE = 300, 50, 20
EMPTY_AT = 5  # an empty input line here must give an empty output line here (F2)
# A model small enough to take 40 steps in a few seconds; warmup short enough to learn.
SMALL = [
    "--preset",
    "tiny",
    "--set",
    "N=1",
    "--set",
    "d_model=64",
    "--set",
    "d_ff=128",
    "--set",
    "h=2",
    "--set",
    "d_k=32",
    "--set",
    "d_v=32",
    "--set",
    "warmup_steps=40",
    "--set",
    "log_interval_steps=5",
    "--max-steps",
    "40",
    "--max-tokens",
    "1024",
    "--save-interval-steps",
    "10",
    "--no-progress",
]


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIAYN_NO_MALLOC_TUNING", "1")


def run(*argv: str | Path) -> tuple[int, str, str]:
    """`aiayn ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def ok(*argv: str | Path) -> str:
    code, out, err = run(*argv)
    assert code == 0, f"aiayn {' '.join(map(str, argv))} exited {code}:\n{err}"
    return out


def head(path: Path, start: int, stop: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
        return f.read().split("\n")[start:stop]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@dataclass
class Pipeline:
    root: Path
    run_dir: Path
    averaged: Path
    source: list[str]
    output: list[str]
    nbest: list[list[tuple[int, str, float]]]  # `--nbest 2` of the source, then reversed
    scores: dict[str, object]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """data -> prepare -> train -> average -> translate -> evaluate, once for this module."""
    root = tmp_path_factory.mktemp("cli")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices; and the machine is shared
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AIAYN_NO_MALLOC_TUNING", "1")
            yield _run_pipeline(root)
    finally:
        torch.set_num_threads(threads)


def _run_pipeline(root: Path) -> Pipeline:
    raw = root / "raw"
    ok(
        "data",
        "multi30k",
        "--from",
        MULTI30K,
        "--out",
        raw,
        "--splits",
        "train,val",
        "--langs",
        "en,de",
    )
    small = root / "small"
    small.mkdir()
    for lang in ("en", "de"):
        write_lines(small / f"train.{lang}", head(raw / f"train.{lang}.gz", 0, N_TRAIN))
        write_lines(small / f"valid.{lang}", head(raw / f"val.{lang}.gz", 0, N_VALID))
    ok(
        "prepare",
        "-s",
        "en",
        "-t",
        "de",
        "--trainpref",
        small / "train",
        "--validpref",
        small / "valid",
        "--out",
        root / "prep",
        "--vocab-size",
        "600",
    )
    run_dir = root / "runs" / "small"
    ok("train", root / "prep", "--out", run_dir, *SMALL)
    averaged = run_dir / "averaged.pt"
    ok("average", run_dir, "--last", "3", "--out", averaged)

    # held-out sentences (after the validation lines), with one empty line among them
    source = head(raw / "val.en.gz", N_VALID, N_VALID + N_TRANSLATE)
    reference = head(raw / "val.de.gz", N_VALID, N_VALID + N_TRANSLATE)
    source[EMPTY_AT] = ""
    src = write_lines(root / "source.en", source)
    ok("translate", "--checkpoint", averaged, "--input", src, "--output", root / "hyp.de")
    output = (root / "hyp.de").read_text(encoding="utf-8").split("\n")
    nbest = []
    for name, lines in (("forward", source), ("reversed", source[::-1])):
        ok(
            "translate",
            "--checkpoint",
            averaged,
            "--input",
            write_lines(root / name, lines),
            "--output",
            root / f"{name}.nbest",
            "--nbest",
            "2",
        )
        rows = (root / f"{name}.nbest").read_text(encoding="utf-8").splitlines()
        nbest.append(
            [
                (int(i), text, float(score))
                for i, text, score in (row.split(" ||| ") for row in rows)
            ]
        )
    ref = write_lines(root / "ref.de", reference)
    scores = json.loads(ok("evaluate", "--hyp", root / "hyp.de", "--ref", ref, "--json"))
    return Pipeline(root, run_dir, averaged, source, output, nbest, scores)


@needs_multi30k
def test_training_loss_fell(pipeline: Pipeline) -> None:
    """Section 5: 40 Adam steps with the Eq. 3 schedule reduce the label-smoothed loss."""
    log = [
        json.loads(line)
        for line in (pipeline.run_dir / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    losses = [r["loss"] for r in log if "loss" in r]
    assert [r["step"] for r in log if "loss" in r] == list(range(5, 41, 5))
    assert losses[-1] < losses[0] - 0.5, losses
    assert any("valid_nll" in r for r in log)  # validated once at the end


@needs_multi30k
def test_checkpoints_written_and_averaged(pipeline: Pipeline) -> None:
    """Section 6.1: checkpoints at intervals, averaged; the run's config is saved with them."""
    for step in (10, 20, 30, 40):
        assert (pipeline.run_dir / f"checkpoint_{step}.pt").is_file()
    assert (pipeline.run_dir / "checkpoint_last.pt").is_file()
    config = json.loads((pipeline.run_dir / "config.json").read_text(encoding="utf-8"))
    assert config["model"]["d_model"] == 64 and config["model"]["N"] == 1
    assert pipeline.averaged.is_file()


@pytest.mark.rows("F2", "F3")
@needs_multi30k
def test_translation_has_one_line_per_input_line(pipeline: Pipeline) -> None:
    """RELIABILITY F2, F3: one output line per input line; an empty one stays empty."""
    output = pipeline.output
    assert output[-1] == ""  # the file ends with a newline
    output = output[:-1]
    assert len(output) == len(pipeline.source) == N_TRANSLATE
    assert output[EMPTY_AT] == ""


@pytest.mark.rows("F3")
@needs_multi30k
def test_translation_order_survives_length_sorted_batching(pipeline: Pipeline) -> None:
    """RELIABILITY F3: reversing the input reverses the output, line for line.

    Compared through the n-best scores, which differ from line to line even when an
    undertrained model gives many lines the same text.
    """
    forward, backward = pipeline.nbest
    # "i ||| text ||| score": 2 lines per input line, 1 for the blank one
    for rows, blank in ((forward, EMPTY_AT), (backward, N_TRANSLATE - 1 - EMPTY_AT)):
        assert [i for i, _, _ in rows] == [
            i for i in range(N_TRANSLATE) for _ in range(1 if i == blank else 2)
        ]
        assert [(t, s) for i, t, s in rows if i == blank] == [("", 0.0)]

    def best(rows: list[tuple[int, str, float]]) -> list[tuple[str, float]]:
        firsts = {}
        for i, text, score in rows:
            firsts.setdefault(i, (text, score))
        return [firsts[i] for i in range(N_TRANSLATE)]

    fwd, bwd = best(forward), best(backward)[::-1]
    assert all(score < 0 for i, (_, score) in enumerate(fwd) if i != EMPTY_AT)  # decoded
    assert len({round(score, 3) for _, score in fwd}) > N_TRANSLATE // 2  # the check has teeth
    assert [t for t, _ in bwd] == [t for t, _ in fwd]
    assert [s for _, s in bwd] == pytest.approx([s for _, s in fwd], abs=1e-4)


@needs_multi30k
def test_several_checkpoints_translate_as_an_ensemble(pipeline: Pipeline) -> None:
    """`--checkpoint A B` decodes with the mean of the models' distributions: two copies
    of one model translate as it does; two different checkpoints give every line too."""
    src = pipeline.root / "source.en"
    twice, pair = pipeline.root / "twice.de", pipeline.root / "pair.de"
    ok(
        "translate",
        "--checkpoint",
        pipeline.averaged,
        pipeline.averaged,
        "--input",
        src,
        "--output",
        twice,
    )
    assert twice.read_text(encoding="utf-8").split("\n") == pipeline.output
    ok(
        "translate",
        "--checkpoint",
        pipeline.averaged,
        "--checkpoint",
        pipeline.run_dir / "checkpoint_20.pt",
        "--input",
        src,
        "--output",
        pair,
    )
    lines = pair.read_text(encoding="utf-8").split("\n")
    assert len(lines) == len(pipeline.output) and lines[EMPTY_AT] == ""


@needs_multi30k
def test_workers_default_to_one_process_a_core_with_the_same_outputs(
    pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """translate's default `--workers auto` decodes in one forked one-thread process a core
    (two here, whatever this machine has), says so, and writes what one process writes."""
    from aiayn.decoding import workers

    monkeypatch.setattr(workers, "default_workers", lambda device="cpu": 2)
    src = pipeline.root / "source.en"
    outs = {}
    for flags in ((), ("--workers", "1")):
        out = pipeline.root / f"workers{len(flags)}.de"
        with caplog.at_level("INFO", logger="aiayn"):
            caplog.clear()
            # --max-tokens 40: several batches, so that both processes decode
            ok("translate", "--checkpoint", pipeline.averaged, "--input", src, "--output", out,
               "--max-tokens", "40", *flags)  # fmt: skip
        outs[flags] = out.read_text(encoding="utf-8")
        auto = "in up to 2 worker processes of one thread (--workers auto)"
        assert (auto in caplog.text) == (not flags), caplog.text
    assert outs[()] == outs[("--workers", "1")]
    assert outs[()].split("\n")[:EMPTY_AT] == pipeline.output[:EMPTY_AT]  # real decodes


@pytest.mark.rows("H2")
@needs_multi30k
def test_evaluate_json_has_bleu_with_signature(pipeline: Pipeline) -> None:
    """Section 6.1 / RELIABILITY H2: BLEU and chrF, each with its sacrebleu signature."""
    s = pipeline.scores
    assert s["n_lines"] == N_TRANSLATE
    for key in ("sacrebleu", "tok_bleu", "chrf"):
        assert isinstance(s[key], float) and 0.0 <= s[key] <= 100.0
        assert "version:" in str(s[f"{key}_signature"])
    assert "tok:13a" in str(s["sacrebleu_signature"])


def test_info_prints_the_closed_form_parameter_count() -> None:
    """Table 3: the base model with a shared 37000-token vocabulary has about 65M parameters."""
    out = ok("info", "--preset", "base", "--vocab-size", "37000")
    match = re.search(r"parameters: ([\d,]+)", out)
    assert match, out
    expected = parameter_formula(replace(get_preset("base").model, vocab_size=37000))
    assert int(match.group(1).replace(",", "")) == expected
    assert 60e6 < expected < 66e6


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.rows("J1")
def test_unknown_set_key_names_the_closest_key(tmp_path: Path) -> None:
    """RELIABILITY J1: an unknown key is an error naming the closest valid key; no work."""
    code, _, err = run(
        "train",
        tmp_path / "data",
        "--out",
        tmp_path / "run",
        "--preset",
        "tiny",
        "--set",
        "d_modle=64",
    )
    assert code == 2
    assert_one_line_error(err, "'d_modle'", "'d_model'")
    assert not (tmp_path / "run").exists()


@pytest.mark.rows("E1")
def test_prepare_with_mismatched_line_counts_names_both_files(tmp_path: Path) -> None:
    """RELIABILITY E1: sides of different lengths are refused, naming both files."""
    write_lines(tmp_path / "corpus.en", ["a house", "a dog", "a cat"])
    write_lines(tmp_path / "corpus.de", ["ein Haus", "ein Hund"])
    code, _, err = run(
        "prepare",
        "-s",
        "en",
        "-t",
        "de",
        "--trainpref",
        tmp_path / "corpus",
        "--out",
        tmp_path / "prep",
        "--vocab-size",
        "100",
    )
    assert code == 1
    assert_one_line_error(err, "corpus.en has 3 lines", "corpus.de has 2")
    assert not (tmp_path / "prep").exists()


@pytest.mark.rows("H1")
def test_evaluate_with_mismatched_line_counts_names_both_files(tmp_path: Path) -> None:
    """RELIABILITY H1: BLEU of misaligned files is refused (the sacrebleu API would score it)."""
    hyp = write_lines(tmp_path / "hyp.de", ["ein Haus"])
    ref = write_lines(tmp_path / "ref.de", ["ein Haus", "ein Hund", "eine Katze"])
    code, out, err = run("evaluate", "--hyp", hyp, "--ref", ref)
    assert code == 1 and out == ""
    assert_one_line_error(err, "hyp.de has 1 lines", "ref.de has 3 lines")


@pytest.mark.rows("F12", "J1")
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["translate", "--checkpoint", "{tmp}/missing.pt"], "missing.pt"),
        (
            ["data", "multi30k", "--from", "{tmp}", "--out", "{tmp}/out", "--splits", "trian"],
            "'trian'",
        ),
        (["info", "--preset", "bse"], "'base'"),
    ],
)
def test_bad_arguments_exit_non_zero_with_one_line(
    tmp_path: Path, argv: list[str], fragment: str
) -> None:
    """RELIABILITY F12, J1: a missing file or an unknown name is one line, not a traceback."""
    code, _, err = run(*(a.format(tmp=tmp_path) for a in argv))
    assert code != 0
    assert_one_line_error(err, fragment)


@pytest.mark.rows("J3")
def test_conflicting_flags_are_an_error(tmp_path: Path) -> None:
    """RELIABILITY J3: a preset and an experiment file name two different bases: exit 2
    naming both flags, nothing written."""
    exp = tmp_path / "exp.toml"
    exp.write_text('preset = "tiny"\n[train]\nmax_steps = 5\n', encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        run("train", tmp_path, "--out", tmp_path / "run", "--preset", "base", "--config", exp)
    assert e.value.code == 2
    assert not (tmp_path / "run").exists()


@pytest.mark.rows("J4")
def test_dump_config_shows_file_then_flags(tmp_path: Path) -> None:
    """RELIABILITY J4: --dump-config prints the effective config: the preset, then the
    experiment file, then --set flags (which win); no training is done."""
    exp = tmp_path / "exp.toml"
    exp.write_text(
        'preset = "tiny"\n[model]\nP_drop = 0.3\n[train]\nmax_steps = 5\nwarmup_steps = 77\n',
        encoding="utf-8",
    )
    out = ok(
        "train",
        tmp_path,
        "--out",
        tmp_path / "run",
        "--config",
        exp,
        "--set",
        "max_steps=9",
        "--dump-config",
    )
    cfg = json.loads(out)
    assert cfg["model"]["P_drop"] == 0.3 and cfg["train"]["warmup_steps"] == 77
    assert cfg["train"]["max_steps"] == 9  # the flag beats the file
    assert cfg["model"]["d_model"] == 256  # the preset fills the rest
    assert not (tmp_path / "run").exists()


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`aiayn ... | head`: when the pipe's reader has gone, the command stops with the
    shell's code for it (128 + SIGPIPE) and no traceback, as `cat` would."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "aiayn", "info", "--preset", "base", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
