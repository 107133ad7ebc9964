"""The public Python API (aiayn.api, docs/api.md): each call equals what the command
line gives for the same checkpoint and options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import aiayn
from aiayn.checkpoints import CheckpointError
from aiayn.files import InputError
from helpers import assert_one_line_error, cli, random_checkpoint, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCES = ["abc de fgh", "", "ij a bcd e"]
REFS = ["fgh de", "a", "bcd"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("api") / "model.pt")


def test_the_public_names_and_nothing_else() -> None:
    assert set(aiayn.__all__) == {
        "__version__",
        "Parser",
        "PairScore",
        "TrainResult",
        "Translation",
        "Translator",
        "train",
    }
    with pytest.raises(AttributeError, match="no attribute 'translate_lines'"):
        aiayn.translate_lines  # noqa: B018


def test_the_library_runs_with_the_speed_paths_on() -> None:
    """A program that only uses the public API gets what the command line gets: the speed
    paths registered (`aiayn.speed`), without importing `aiayn.fast` itself; a bare
    `import aiayn` stays light (no torch)."""
    code = (
        "import sys, aiayn; light = 'torch' not in sys.modules; aiayn.train; "
        "from aiayn import speed; print(light, sorted(speed.IMPLEMENTATIONS) != [])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True", "True"]


def test_translate_equals_the_command(ckpt: Path, tmp_path: Path) -> None:
    t = aiayn.Translator.load(ckpt, dtype="fp32")
    src = tmp_path / "src.txt"
    src.write_text("".join(f"{x}\n" for x in SOURCES))
    for flags, kwargs in (([], {}), (["--beam", "2"], {"beam": 2})):
        code, out, err = cli(
            "translate", "--checkpoint", ckpt, "--input", src, "--dtype", "fp32", *flags
        )
        assert code == 0, err
        assert t.translate(SOURCES, **kwargs) == out.splitlines()
    nbest = t.translate(SOURCES, beam=4, nbest=2)
    assert [len(x) for x in nbest] == [2, 0, 2]
    assert nbest[0][0].score >= nbest[0][1].score
    assert nbest[0][0].text == t.translate(SOURCES, beam=4)[0]


def test_sample_is_reproducible_and_equals_the_command(ckpt: Path, tmp_path: Path) -> None:
    t = aiayn.Translator.load(ckpt, dtype="fp32")
    a = t.sample(SOURCES, n=3, top_k=5, seed=4)
    assert a == t.sample(SOURCES, n=3, top_k=5, seed=4)
    assert [len(x) for x in a] == [3, 0, 3]
    src = tmp_path / "src.txt"
    src.write_text("".join(f"{x}\n" for x in SOURCES))
    code, out, err = cli(
        "translate",
        "--checkpoint",
        ckpt,
        "--input",
        src,
        "--dtype",
        "fp32",
        "--sampling",
        "--nbest",
        "3",
        "--top-k",
        "5",
        "--seed",
        "4",
    )
    assert code == 0, err
    want = [f"{i} ||| {s.text} ||| {s.score:.6f}" for i, x in enumerate(a) for s in x]
    assert [line for line in out.splitlines() if not line.startswith("1 |||")] == want


def test_score_equals_the_command_and_the_beam_scores(ckpt: Path, tmp_path: Path) -> None:
    t = aiayn.Translator.load(ckpt, dtype="fp32")
    scores = t.score(SOURCES, REFS)
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(f"{x}\n" for x in SOURCES))
    ref.write_text("".join(f"{x}\n" for x in REFS))
    code, out, err = cli("score", "--checkpoint", ckpt, "--src", src, "--ref", ref, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["total"] for r in rows] == pytest.approx([s.total for s in scores])
    assert [r["tokens"] for r in rows] == [s.tokens for s in scores]
    summary = json.loads(err.strip().splitlines()[-1])
    assert summary["pairs"] == 3
    # (that a search's own output scores back to its score: tests/decoding/test_score.py)


def test_score_refuses_files_of_different_lengths(ckpt: Path, tmp_path: Path) -> None:
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("a\nb\n")
    ref.write_text("a\n")
    code, _, err = cli("score", "--checkpoint", ckpt, "--src", src, "--ref", ref)
    assert code == 2
    assert_one_line_error(err, str(src), "2 lines", "1")


def test_a_lone_string_and_a_missing_file_are_refused_clearly(ckpt: Path, tmp_path: Path) -> None:
    t = aiayn.Translator.load(ckpt, dtype="fp32")
    with pytest.raises(TypeError, match="list of lines"):
        t.translate("abc")
    with pytest.raises(ValueError, match="nbest 3 > beam 2"):
        t.translate(["abc"], beam=2, nbest=3)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        aiayn.Translator.load(tmp_path / "missing.pt")


def test_parse_returns_a_tree_over_the_words(ckpt: Path) -> None:
    """A translation model parses badly, but the tree is well-formed over the words (freely
    decoded and repaired: its vocabulary has no bracket pieces, which the constrained
    default refuses by name)."""
    p = aiayn.Parser.load(ckpt, dtype="fp32")
    with pytest.raises(InputError, match="no bracket pieces"):
        p.parse(["abc de"], beam=2)
    trees = p.parse(["abc de", ["fgh", "ij", "a"]], beam=2, constrained=False)
    assert len(trees) == 2
    for tree, words in zip(trees, (["abc", "de"], ["fgh", "ij", "a"]), strict=True):
        assert tree.startswith("(") and tree.endswith(")")
        assert [w for w in words if f" {w})" in tree or f" {w} " in tree] == words


def test_train_runs_what_the_command_runs(small_data: Path, tmp_path: Path) -> None:
    cfg = tiny_config({"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "d_k": 16, "d_v": 16})
    result = aiayn.train(
        cfg,
        small_data,
        tmp_path / "run",
        overrides={"train.max_steps": 3, "train.save_interval_steps": 3, "train.dtype": "fp32"},
    )
    assert result.state.step == 3 and result.last_checkpoint is not None
    assert result.last_checkpoint.is_file()
    t = aiayn.Translator.load(result.last_checkpoint, dtype="fp32")
    assert len(t.translate(["A man rides a bike."], max_len_b=3)) == 1


def test_sampling_flags_are_checked_before_any_work(ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src.txt"
    src.write_text("abc\n")
    base = ("translate", "--checkpoint", ckpt, "--input", src)
    for flags, fragment in (
        (("--top-k", "5"), "--top-k need --sampling"),
        (("--sampling", "--beam", "2"), "--beam is for beam search"),
        (("--sampling", "--top-p", "0"), "top_p must be in (0, 1]"),
        (("--sampling", "--nbest", "2", "--samples", "3"), "give one"),
    ):
        code, _, err = cli(*base, *flags)
        assert code == 2, (flags, err)
        assert_one_line_error(err, fragment)
    code, out, err = cli(*base, "--dtype", "fp32", "--sampling", "--samples", "2", "--seed", "3")
    assert code == 0, err
    assert [line.split(" ||| ")[0] for line in out.splitlines()] == ["0", "0"]
