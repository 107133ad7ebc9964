"""`aiayn export`: what it refuses before any work, and what it writes.

`trained_translator` is the deploy tests' model (test_export.py and test_marian.py import
it): trained once per session on the `small_data` pairs, so that its outputs depend on
the input, end at different lengths and are often wrong, which tests the mapping of
every weight and token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import pytest
import torch

from aiayn.files import read_lines
from helpers import MULTI30K, SMALL_TRAINING, assert_one_line_error, cli, tiny_config

#: 300 steps of a one-layer d_model 64 model (about 8 s on one core): its 40 greedy
#: outputs of the held-out lines all differ, are 5 to 58 subwords long and often stutter
#: (as a weakly trained model's do); on some machines one loops to its length cap (the
#: training's arithmetic differs between CPUs), which the tests allow for.
TRAINED = {
    **SMALL_TRAINING,
    "d_model": 64,
    "d_ff": 128,
    "h": 4,
    "d_k": 16,
    "d_v": 16,
    "P_drop": 0.0,
    "max_steps": 300,
    "warmup_steps": 100,
    "lr_scale": 0.3,
    "save_interval_steps": 300,
    "valid_interval_steps": 300,
    "log_interval_steps": 50,
}

#: Held-out sentences: the first of Multi30k's validation set (not in the 200 trained on).
HELD_OUT = 40


def trained_translator(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of `TRAINED` on `small_data`, trained once per session (the first
    module that asks trains it; later ones find it)."""
    from aiayn.training.trainer import train

    run = tmp_path_factory.getbasetemp() / "deploy-translator"
    checkpoint = run / "checkpoint_last.pt"
    if not checkpoint.is_file():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: more threads only wait for each other
        try:
            train(tiny_config(TRAINED), small_data, run)
        finally:
            torch.set_num_threads(threads)
    return checkpoint


@dataclass(frozen=True)
class Reference:
    """What aiayn itself makes of the held-out lines (fp32, the checkpoint's length cap)."""

    lines: list[str]
    greedy_text: list[str]  # `translate_lines` with beam 1, as `aiayn translate --beam 1`
    greedy: list[list[int]]  # its token ids
    beam4: list[list[int]]  # beam 4, alpha 0.6 (the paper's)
    beam4_alpha0: list[list[int]]  # beam 4, alpha 0: log P alone
    caps: list[int]  # each line's output length cap


def aiayn_reference(checkpoint: Path) -> Reference:
    from aiayn.checkpoints import load_model
    from aiayn.decoding.search import beam_search, output_caps
    from aiayn.decoding.translate import (
        TranslateStats,
        encode_sources,
        pad_batch,
        translate_lines,
    )

    model, tokenizer, cfg = load_model(checkpoint)
    d = cfg.decode
    lines = list(islice(read_lines(MULTI30K / "val.en.gz"), HELD_OUT))
    sources = encode_sources(tokenizer, lines, d.max_input_len, TranslateStats())
    src = pad_batch([s for s in sources if s is not None], "cpu")  # no blank line here

    def search(beam: int, alpha: float) -> list[list[int]]:
        hyps = beam_search(model, src, beam, alpha, d.max_len_a, d.max_len_b)
        return [h[0].tokens for h in hyps]

    return Reference(
        lines=lines,
        greedy_text=translate_lines(model, tokenizer, lines, replace(d, beam=1)),
        greedy=search(1, 0.0),
        beam4=search(4, 0.6),
        beam4_alpha0=search(4, 0.0),
        caps=output_caps(model, src, d.max_len_a, d.max_len_b),
    )


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(ours, theirs, strict=True))


@pytest.fixture
def fake_checkpoint(tmp_path: Path) -> Path:
    """A file where a checkpoint is expected: the path checks come before loading it."""
    path = tmp_path / "model.pt"
    path.write_bytes(b"not read")
    return path


def test_export_refuses_a_missing_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    code, _, err = cli(
        "export", "--checkpoint", missing, "--to", "ctranslate2", "--out", tmp_path / "o"
    )
    assert code == 2
    assert_one_line_error(err, str(missing), "no such file")
    assert not (tmp_path / "o").exists()


def test_export_refuses_an_out_dir_that_holds_files(tmp_path: Path, fake_checkpoint: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    for to in ("ctranslate2", "marian"):
        code, _, err = cli("export", "--checkpoint", fake_checkpoint, "--to", to, "--out", out)
        assert code == 2
        assert_one_line_error(err, str(out), "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine\n"


def test_export_refuses_an_out_that_is_a_file(tmp_path: Path, fake_checkpoint: Path) -> None:
    out = tmp_path / "out"
    out.write_text("x")
    code, _, err = cli("export", "--checkpoint", fake_checkpoint, "--to", "marian", "--out", out)
    assert code == 2
    assert_one_line_error(err, str(out), "is a file")


def test_export_refuses_quantization_for_marian(tmp_path: Path, fake_checkpoint: Path) -> None:
    code, _, err = cli(
        "export", "--checkpoint", fake_checkpoint, "--to", "marian", "--quantization", "int8",
        "--out", tmp_path / "o",
    )  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "--quantization", "ctranslate2")


def test_export_of_a_file_that_is_no_checkpoint_is_one_line(
    tmp_path: Path, fake_checkpoint: Path
) -> None:
    out = tmp_path / "o"
    code, _, err = cli(
        "export", "--checkpoint", fake_checkpoint, "--to", "ctranslate2", "--out", out
    )
    assert code == 1
    assert_one_line_error(err, str(fake_checkpoint))
    assert not out.exists()  # nothing half-written
    assert [p.name for p in tmp_path.iterdir()] == [fake_checkpoint.name]  # no temp folder


def test_export_with_force_writes_into_a_directory_and_keeps_other_files(
    small_data: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    pytest.importorskip("ctranslate2")
    checkpoint = trained_translator(small_data, tmp_path_factory)
    out = tmp_path / "ct2"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    code, stdout, err = cli(
        "export", "--checkpoint", checkpoint, "--to", "ctranslate2", "--out", out, "--force"
    )
    assert code == 0, err
    assert "README.md" in stdout
    names = {p.name for p in out.iterdir()}
    assert {"model.bin", "config.json", "sentencepiece.model", "README.md"} <= names
    assert (out / "notes.txt").read_text() == "mine\n"
    info = json.loads((out / "aiayn_export.json").read_text())
    assert info["engine"] == "ctranslate2" and info["decode"]["beam"] == 4
    assert json.loads((out / "config.json").read_text())["add_source_eos"] is True


def test_export_help_gives_every_flag_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    from aiayn.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--checkpoint", "--to", "--out", "--quantization", "--force", "examples:"):
        assert flag in out


def test_the_parser_lists_ctranslate2_quantizations_as_the_exporter_accepts() -> None:
    """flags_deploy keeps its own copy (building the parser imports no torch): they agree."""
    from aiayn.cli.flags_deploy import QUANTIZATIONS
    from aiayn.deploy.export import CT2_QUANTIZATIONS

    assert tuple(QUANTIZATIONS) == tuple(CT2_QUANTIZATIONS)
