"""Adding a task is one module plus its scorer (issue 69): a toy task, "reverse" (write a
sentence's words in reverse order), defined here in full, runs through `aiayn recipe`'s one
pipeline (data, train, average, tune, test, results.json, the terminal summary) without a
line of aiayn changed. docs/reference.md#adding-a-task walks through this file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from aiayn.cli import main
from aiayn.config import Config, ConfigError, DecodeConfig
from aiayn.experiments.recipe_config import RecipeConfig
from aiayn.experiments.stages import Trained
from aiayn.experiments.tasks import (
    TASKS,
    Outcome,
    RunContext,
    Scored,
    Task,
    TaskData,
    load_recipe,
)
from aiayn.files import read_lines, write_text_atomic
from helpers import ROOT

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def exact_match(hyps: list[str], refs: list[str]) -> float:
    """The task's scorer: the percentage of outputs equal to their reference."""
    return 100.0 * sum(h == r for h, r in zip(hyps, refs, strict=True)) / max(len(refs), 1)


class Reverse:
    """Source: an English sentence of Multi30k; target: its words in reverse order."""

    name: str = "reverse"
    datasets: tuple[str, ...] = ("multi30k",)
    tuning_key: str = "tuning"
    own_fields: frozenset[str] = frozenset()
    distributed: bool = False
    score_options: frozenset[str] = frozenset()

    def check(self, recipe: RecipeConfig, where: str) -> None:
        if recipe.max_train_pairs == 0:
            raise ConfigError(f"{where}: the reverse task wants recipe.max_train_pairs > 0")

    def prepare(
        self, recipe: RecipeConfig, cfg: Config, out: Path, data: str | Path | None
    ) -> TaskData:
        from aiayn.data.download import download_multi30k
        from aiayn.data.prepare import find_input, prepare

        raw = out / "data" / "raw"
        splits = {"train": recipe.max_train_pairs, "val": 20, "test_2016_flickr": 20}
        download_multi30k(raw, data, splits=list(splits), langs=["en"])
        for split, n in splits.items():
            lines = list(read_lines(find_input(raw / split, "en")))[:n]
            for side, text in (("src", lines), ("rev", [" ".join(x.split()[::-1]) for x in lines])):
                write_text_atomic(out / "data" / f"{split}.{side}", "".join(f"{x}\n" for x in text))
        prepared = out / "data" / "prepared"
        manifest = prepare(
            "src",
            "rev",
            out / "data" / "train",
            out / "data" / "val",
            None,
            prepared,
            vocab_size=recipe.vocab_size,
            max_len=cfg.train.max_len,
        )
        return TaskData(prepared, manifest, files={"test": out / "data" / "test_2016_flickr"})

    def tune(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> tuple[DecodeConfig, dict[str, Any] | None]:
        return replace(decode, beam=1), {"chosen": "greedy: one right answer"}

    def test(
        self, trained: Trained, data: TaskData, decode: DecodeConfig, ctx: RunContext
    ) -> Outcome:
        from aiayn.decoding.translate import translate_file

        test, hyp = data.files["test"], ctx.out / "test.rev"
        src = Path(f"{test}.src")
        translate_file(trained.model, trained.tokenizer, src, hyp, decode, device=ctx.device)
        hyps, refs = list(read_lines(hyp)), list(read_lines(Path(f"{test}.rev")))
        return Outcome({"exact_match": exact_match(hyps, refs), "n_lines": len(refs)})

    def score_files(self, hyp: Path, ref: Path, options: dict[str, Any]) -> Scored:
        score = exact_match(list(read_lines(hyp)), list(read_lines(ref)))
        return Scored({"exact_match": score}, f"exact match {score:.1f}%")

    def test_split(self, recipe: RecipeConfig) -> str:
        return "test_2016_flickr"

    def label(self, recipe: RecipeConfig) -> str:
        return "reverse"

    def format(self, results: dict[str, Any]) -> str:
        s = results["scores"]
        return f"reverse: exact match {s['exact_match']:.1f}% of {s['n_lines']} sentences"


REVERSE: Task = Reverse()  # `MYPYPATH=tests mypy` on this file checks it against the protocol

SMALL = [
    "recipe.max_train_pairs=200",
    "recipe.vocab_size=200",
    "recipe.average_last=2",
    "N=1",
    "d_model=32",
    "d_ff=64",
    "h=2",
    "d_k=16",
    "d_v=16",
    "max_steps=6",
    "save_interval_steps=3",
    "valid_interval_steps=6",
    "train.max_tokens=600",
    "dtype=fp32",
    "warmup_steps=4",
    "decode.max_len_b=10",
]


def recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "reverse.toml"
    path.write_text('preset = "tiny"\n\n[recipe]\ntask = "reverse"\ndataset = "multi30k"\n')
    return path


def test_the_scorer_counts_exact_matches():
    assert exact_match(["a b", "c"], ["a b", "d"]) == 50.0


def test_an_unknown_task_is_refused_until_it_is_in_the_mapping(tmp_path, monkeypatch):
    path = recipe_file(tmp_path)
    with pytest.raises(ConfigError, match="recipe.task must be one of 'translate', 'parse'"):
        load_recipe(path)
    monkeypatch.setitem(TASKS, "reverse", REVERSE)
    with pytest.raises(ConfigError, match="wants recipe.max_train_pairs > 0"):  # its check
        load_recipe(path)
    assert load_recipe(path, {"recipe.max_train_pairs": "5"})[1].task == "reverse"


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="needs ../shared/data/multi30k")
def test_a_new_task_runs_through_the_one_pipeline(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TASKS, "reverse", REVERSE)
    out = tmp_path / "run"
    argv = ["recipe", str(recipe_file(tmp_path)), "--data", str(MULTI30K), "--out", str(out)]
    for s in SMALL:
        argv += ["--set", s]
    assert main([*argv, "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "reverse" and results["test_split"] == "test_2016_flickr"
    assert results["scores"]["n_lines"] == 20 and 0 <= results["scores"]["exact_match"] <= 100
    assert results["tuning"] == {"chosen": "greedy: one right answer"}
    assert results["config"]["decode"]["beam"] == 1  # the tuned settings decoded the test set
    assert results["train"]["steps"] == 6 and len(results["averaged"]) == 2
    assert (out / "checkpoint_avg.pt").is_file() and len(list(read_lines(out / "test.rev"))) == 20
    assert "reverse: exact match" in capsys.readouterr().out


def test_evaluate_scores_with_the_tasks_scorer_and_refuses_another_tasks_options(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("ein Hund läuft .\n")
    ref.write_text("ein Hund läuft .\n")
    assert main(["evaluate", "--hyp", str(hyp), "--ref", str(ref), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sacrebleu"] == pytest.approx(100.0)
    assert main(["evaluate", "--hyp", str(hyp), "--ref", str(ref), "--report"]) == 2
    assert "--report is for --task parse" in capsys.readouterr().err


class ToyData:
    """A task that only fetches: what `aiayn data` asks of a task."""

    name: str = "toy"
    datasets: tuple[str, ...] = ("toyset",)

    def __init__(self) -> None:
        self.calls: list[tuple[str, Path, Path | None, dict[str, Any]]] = []

    def fetch(
        self, dataset: str, out: Path, source: Path | None, options: dict[str, Any]
    ) -> list[str]:
        self.calls.append((dataset, out, source, options))
        return [f"{dataset} fetched into {out}"]


def test_data_fetches_through_the_task_that_reads_the_dataset(tmp_path, monkeypatch, capsys):
    """`aiayn data NAME` asks the task whose `datasets` hold NAME (no dataset names in the
    CLI): a new dataset is one `fetch` away, offered by `aiayn data` as soon as its task is
    in the mapping."""
    toy = ToyData()
    monkeypatch.setitem(TASKS, "toy", toy)
    out = tmp_path / "out"
    assert main(["data", "toyset", "--out", str(out), "--from", str(tmp_path)]) == 0
    options = dict.fromkeys(("splits", "langs", "pair", "split", "train", "dev", "test"))
    assert toy.calls == [("toyset", out, tmp_path, options)]
    assert f"toyset fetched into {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["multi30k", "--pair", "en-de"], "--pair is not an option of multi30k"),
        (["ptb", "--langs", "en"], "--langs is not an option of ptb; ptb takes --split"),
        (["wmt14", "--split", "ldc"], "--split is not an option of wmt14; wmt14 takes --pair"),
        (["wmt14"], "wmt14 needs --pair en-de or --pair en-fr"),
    ],
)
def test_a_flag_of_another_dataset_is_refused_by_name(tmp_path, capsys, argv, message):
    assert main(["data", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work
