"""`aiayn plot RUN [RUN2 ...]`: train_log.jsonl's curves as a PNG, and its errors.

The logs are written here by hand in the trainer's record format (a training record per
step, a validation record every 10, events), so that these tests train nothing.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from aiayn.cli import flags_plot
from aiayn.experiments.curves import PLOT_METRICS, plot_runs, read_run, run_labels
from aiayn.files import InputError
from helpers import assert_one_line_error, cli

pytest.importorskip("matplotlib")


def write_log(run: Path, steps: int = 40, bleu: bool = True, scale: float = 1.0) -> Path:
    """A run directory whose log has `steps` training records and a validation every 10."""
    run.mkdir(parents=True)
    records: list[dict[str, Any]] = [{"step": 0, "event": "batch", "ranks": 1}]
    for s in range(1, steps + 1):
        records.append(
            {
                "step": s,
                "time": 0.1 * s,
                "epoch": 0,
                "loss": scale * (5 - math.log(s)),
                "nll": 4 - math.log(s),
                "lr": 1e-3 * min(s / 10, (10 / s) ** 0.5),
                "gnorm": 1.0 / s,
                "src_tokens": 100,
                "tgt_tokens": 110,
                "tokens_per_s": 2000.0,
            }
        )
        if s % 10 == 0:
            valid = {"step": s, "time": 0.1 * s, "valid_nll": 3 / s, "valid_ppl": math.exp(3 / s)}
            if bleu:
                valid |= {"valid_bleu": float(s), "valid_bleu_ref": "raw"}
            records.append(valid)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "train_log.jsonl").write_text(text, encoding="utf-8")
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_of_every_panel(tmp_path: Path) -> None:
    run = write_log(tmp_path / "base")
    code, out, err = cli("plot", run)
    png = run / "curves.png"
    assert code == 0, err
    assert f"wrote {png}" in out
    assert png_size(png) == (1100, 720)  # 2 x 2 panels of 5.5 x 3.6 inches at 100 dpi
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    assert pixels.std() > 0.05  # not a blank image


def test_several_runs_are_overlaid_with_their_names(tmp_path: Path) -> None:
    a = write_log(tmp_path / "a" / "seed1", steps=40)
    b = write_log(tmp_path / "b" / "seed1", steps=30, bleu=False, scale=2)
    c = write_log(tmp_path / "c", steps=20)
    labels = run_labels([a, b, c])
    assert list(labels) == [str(a), str(b), "c"]  # equal names: the paths as given
    drawn = plot_runs(labels, tmp_path / "out" / "x.png")
    assert drawn == {
        "loss": {str(a): 40, str(b): 30, "c": 20},
        "valid_ppl": {str(a): 4, str(b): 3, "c": 2},
        "valid_bleu": {str(a): 4, str(b): 0, "c": 2},  # b logged no BLEU: a note instead
        "lr": {str(a): 40, str(b): 30, "c": 20},
    }
    assert png_size(tmp_path / "out" / "x.png")[0] > 0
    code, out, _ = cli("plot", a, b, "--out", tmp_path / "y.png", "--metrics", "valid_bleu")
    assert code == 0 and f"no valid_bleu in the log of {b}" in out
    assert png_size(tmp_path / "y.png") == (550, 360)


def test_a_resumed_run_is_drawn_as_it_finally_went(tmp_path: Path) -> None:
    run = write_log(tmp_path / "r", steps=20)
    with open(run / "train_log.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 10, "event": "resumed", "checkpoint": "x"}) + "\n")
        for s in range(11, 21):
            f.write(json.dumps({"step": s, "loss": 0.5, "lr": 1e-3}) + "\n")
    records = read_run(run)
    assert [r["loss"] for r in records if "loss" in r and r["step"] > 10] == [0.5] * 10
    assert plot_runs({"r": run}, tmp_path / "r.png", ("loss",))["loss"]["r"] == 20


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (None, ["train_log.jsonl: missing"]),
        ("", ["train_log.jsonl: no training or validation records yet"]),
        ('{"step": 0, "event": "batch"}\n', ["no training or validation records yet"]),
        ('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n', [":2:"]),
        ('{"step": 1, "loss": 2.0}\n[1, 2]\n{"step": 3, "loss": 1.0}\n', [":2:", "object"]),
    ],
)
def test_a_bad_log_is_a_one_line_error_naming_the_file_and_line(
    tmp_path: Path, content: str | None, fragments: list[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "train_log.jsonl").write_text(content, encoding="utf-8")
    code, _, err = cli("plot", run, "--out", tmp_path / "x.png")
    assert code == 1
    assert_one_line_error(err, str(run), *fragments)
    assert not (tmp_path / "x.png").exists()


def test_a_cut_last_line_is_left_out(tmp_path: Path) -> None:
    """A kill while writing leaves a partial last line: not an error."""
    run = write_log(tmp_path / "run", steps=10)
    with open(run / "train_log.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 11, "lo')
    assert plot_runs({"run": run}, tmp_path / "x.png", ("loss",))["loss"]["run"] == 10


def test_usage_errors(tmp_path: Path) -> None:
    run = write_log(tmp_path / "run")
    code, _, err = cli("plot", tmp_path / "nope", "--out", tmp_path / "x.png")
    assert code == 1
    assert_one_line_error(err, str(tmp_path / "nope"), "no such run directory")
    code, _, err = cli("plot", run, "--metrics", "loss,bleu")
    assert code == 2
    assert_one_line_error(err, "--metrics", "bleu", "valid_bleu")
    code, _, err = cli("plot", run, "--out", tmp_path / "x.pdf")
    assert code == 2
    assert_one_line_error(err, "x.pdf", ".png")
    code, _, err = cli("plot", run, run, "--out", tmp_path / "x.png")
    assert code == 1
    assert_one_line_error(err, "given twice")
    with pytest.raises(InputError, match="no such run directory"):
        read_run(tmp_path / "missing")


def test_without_matplotlib_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run = write_log(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = cli("plot", run)
    assert code == 2
    assert_one_line_error(err, "matplotlib", "pip install 'aiayn[plot]'")


def test_the_parser_lists_the_metrics_plot_runs_draws() -> None:
    assert flags_plot.METRICS.split(",") == list(PLOT_METRICS)
    assert set(flags_plot.DEFAULT_METRICS.split(",")) <= set(PLOT_METRICS)


def test_help_explains_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    from aiayn.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plot", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "examples:" in out and "aiayn plot runs/base runs/big --out base-vs-big.png" in out
    assert "(default: loss,valid_ppl,valid_bleu,lr)" in out
