"""The parsing recipe (section 6.3) end to end on a slice of the treebank sample, and its
configuration."""

from __future__ import annotations

import json
import shutil

import pytest

from aiayn.cli import main
from aiayn.config import ConfigError, get_preset
from aiayn.experiments.recipe import run_recipe
from aiayn.experiments.tasks import load_recipe
from aiayn.experiments.tasks.parsing import _score_all, mix_silver
from aiayn.files import read_lines
from aiayn.scoring.evalb import score_files as score_tree_files
from helpers import ROOT

PTB_SAMPLE = ROOT.parent / "shared" / "data" / "ptb-sample" / "treebank.zip"
EVALB = ROOT.parent / "shared" / "tools" / "EVALB"
CONFIG = ROOT / "configs" / "ptb-sample-parse.toml"

needs_sample = pytest.mark.skipif(
    not PTB_SAMPLE.is_file(), reason="needs ../shared/data/ptb-sample/treebank.zip"
)

# Shrinks the recipe to seconds: the same file and stages, a toy model, short outputs.
SMALL = [
    "recipe.max_train_pairs=200",
    "recipe.max_test_pairs=10",
    "recipe.vocab_size=300",
    "recipe.average_last=2",
    "recipe.tune_beam=1,2",
    "recipe.tune_alpha=0.3,1.0",
    "N=1",
    "d_model=32",
    "d_ff=64",
    "h=2",
    "d_k=16",
    "d_v=16",
    "max_steps=8",
    "save_interval_steps=4",
    "valid_interval_steps=8",
    "log_interval_steps=2",
    "train.max_tokens=1500",
    "dtype=fp32",
    "warmup_steps=4",
    "decode.max_len_a=2",  # an untrained model writes until the cap: keep it short
    "decode.max_len_b=10",
]


def test_the_parse_preset_is_the_papers_parser():
    """Section 6.3: 4 layers, d_model 1024, otherwise the base model; beam 21, alpha 0.3,
    maximum output length input + 300."""
    cfg, base = get_preset("parse"), get_preset("base")
    m = cfg.model
    assert (m.N, m.d_model, m.d_ff, m.h, m.d_k, m.d_v) == (4, 1024, 2048, 8, 128, 128)
    assert m.h * m.d_k == m.d_model and m.P_drop == base.model.P_drop
    d = cfg.decode
    assert (d.beam, d.alpha, d.max_len_a, d.max_len_b) == (21, 0.3, 1.0, 300)
    assert cfg.train.eps_ls == base.train.eps_ls and cfg.train.warmup_steps == 4000


def test_the_wsj_file_is_the_papers_setting():
    """Section 6.3 at full scale: the parse preset, WSJ's standard split, GAFL's target,
    a 16K vocabulary, beam and alpha chosen on section 22, 100K steps of ~25K tokens."""
    cfg, recipe = load_recipe(ROOT / "configs" / "wsj-parse.toml")
    assert cfg.model == get_preset("parse").model and cfg.decode == get_preset("parse").decode
    assert (recipe.treebank_split, recipe.linearization, recipe.vocab_size) == (
        "ldc",
        "gafl",
        16000,
    )
    assert (cfg.train.max_steps, cfg.train.max_tokens, cfg.train.warmup_steps) == (
        100_000,
        25_000,
        4000,
    )
    assert 21 in recipe.tune_beam and 0.3 in recipe.tune_alpha


def test_the_recipe_file_keeps_the_papers_decoding_and_layers():
    cfg, recipe = load_recipe(CONFIG)
    assert recipe.dataset == "ptb" and cfg.model.N == 4 and recipe.linearization == "words"
    assert (cfg.decode.beam, cfg.decode.alpha, cfg.decode.max_len_b) == (21, 0.3, 300)
    assert 21 in recipe.tune_beam and 0.3 in recipe.tune_alpha


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("recipe.dataset", "wsj", "task 'parse' reads recipe.dataset 'ptb', not 'wsj'"),
        ("recipe.tune_beam", "4,x", "comma-separated integers"),
        ("recipe.silver_ratio", "0", "silver_ratio must be > 0"),
        ("recipe.treebank_split", "mine", "treebank_split must be"),
        ("recipe.linearization", "xx", "linearization must be 'gafl' or 'words'"),
    ],
)
def test_bad_parse_recipe_settings_are_refused_by_name(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(CONFIG, {key: value})


def test_parse_only_keys_are_refused_for_translation(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('preset = "tiny"\n[recipe]\ndataset = "multi30k"\ntune_beam = [4]\n')
    with pytest.raises(ConfigError, match="recipe.tune_beam is for task = 'parse' only"):
        load_recipe(path)
    path.write_text(
        'preset = "tiny"\n[recipe]\ntask = "parse"\ndataset = "ptb"\nlowercase = true\n'
    )
    with pytest.raises(ConfigError, match="recipe.lowercase is for task = 'translate' only"):
        load_recipe(path)


def test_the_task_not_the_dataset_chooses_the_pipeline(tmp_path):
    """A treebank under the translation task is refused with the way out, and so is an
    unknown task (with the closest name)."""
    path = tmp_path / "t.toml"
    path.write_text('preset = "tiny"\n[recipe]\ndataset = "ptb"\n')
    with pytest.raises(ConfigError, match="not 'ptb': set recipe.task = 'parse'"):
        load_recipe(path)
    path.write_text('preset = "tiny"\n[recipe]\ntask = "pasre"\ndataset = "ptb"\n')
    with pytest.raises(ConfigError, match="did you mean 'parse'"):
        load_recipe(path)
    path.write_text('preset = "tiny"\n[recipe]\ntask = "parse"\ndataset = "wmt14"\n')
    with pytest.raises(ConfigError, match="task 'parse' reads recipe.dataset 'ptb'"):
        load_recipe(path)


def test_silver_mixing_reaches_the_ratio_by_repeating_gold(tmp_path):
    for name, n in (("gold", 3), ("silver", 12)):
        (tmp_path / f"{name}.words").write_text("".join(f"{name}{i}\n" for i in range(n)))
        (tmp_path / f"{name}.lin").write_text("".join(f"(S XX )S {i}\n" for i in range(n)))
    counts = mix_silver(tmp_path / "gold", tmp_path / "silver", 2.0, tmp_path / "mixed")
    # 12 silver at 2 silver a gold: the 3 gold trees twice, then every silver tree
    assert counts == {"gold": 3, "silver": 12, "gold_copies": 2, "silver_per_gold": 2.0}
    words = list(read_lines(tmp_path / "mixed.words"))
    assert words == [f"gold{i}" for i in range(3)] * 2 + [f"silver{i}" for i in range(12)]
    assert len(list(read_lines(tmp_path / "mixed.lin"))) == len(words)
    # fewer silver trees than the ratio asks: gold once, all silver
    counts = mix_silver(tmp_path / "gold", tmp_path / "silver", 10.0, tmp_path / "m2")
    assert counts["gold_copies"] == 1 and counts["silver_per_gold"] == 4.0


@needs_sample
@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
def test_parse_recipe_runs_end_to_end_and_both_scorers_agree(tmp_path, monkeypatch, capsys):
    """A fresh run: treebank -> train -> average -> tune beam and alpha on dev -> parse test
    -> F1 from aiayn's scorer and from EVALB, equal; a rerun resumes."""
    monkeypatch.setenv("AIAYN_NO_MALLOC_TUNING", "1")
    out = tmp_path / "run"
    # the semi-supervised setting on small data: 30 silver trees as a parser writes them
    silver = tmp_path / "silver.trees"
    silver.write_text(
        "".join(
            f"(TOP (S (NP-SBJ (DT the) (NN cat{i})) (VP (VBD sat) (PP (IN on) (NP (NN mat))))"
            " (. .)))\n"
            for i in range(30)
        )
    )
    args = ["recipe", str(CONFIG), "--data", str(PTB_SAMPLE), "--out", str(out), "--no-progress"]
    for item in [
        *SMALL,
        f"recipe.evalb={EVALB}",
        f"recipe.silver={silver}",
        "recipe.silver_ratio=0.1",
    ]:
        args += ["--set", item]
    assert main(args) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "parse" and results["train"]["steps"] == 8
    # 200 gold trees repeated round(30 / (0.1 x 200)) = 2 times, then the 30 silver ones
    assert results["data"]["silver"] == {
        "gold": 200,
        "silver": 30,
        "gold_copies": 2,
        "silver_per_gold": 0.075,
    }
    mixed = list(read_lines(out / "data" / "train.mixed.linw"))  # the file's "words" target
    assert len(mixed) == 430
    assert mixed[-1] == "(S (NP the cat29 )NP (VP sat (PP on (NP mat )NP )PP )VP . )S"
    manifest = json.loads((out / "data" / "prepared" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["lines"] == 430
    assert results["averaged"] == ["checkpoint_4.pt", "checkpoint_8.pt"]
    scores = results["scores"]
    for system in (
        "model",
        "model_unconstrained",
        "model_without_repairs",
        "right_branching",
        "pcfg",
    ):
        assert scores[system]["reports_equal"], system
        ours, evalb = scores[system]["aiayn"], scores[system]["evalb"]
        for key in ("f1", "precision", "recall", "gold_brackets", "test_brackets"):
            assert ours[key] == evalb[key], (system, key)
    # every test sentence got a tree, over its own words
    trees = list(read_lines(out / "test.trees"))
    assert len(trees) == 10 == results["parse"]["sentences"]
    assert scores["model"]["aiayn"]["error_sentences"] == 0
    # constrained: every raw output a tree over its words; the PCFG parses the same words
    assert results["parse"]["ill_formed"] == 0 and results["parse"]["constrained"]
    assert scores["pcfg"]["aiayn"]["f1"] > scores["right_branching"]["aiayn"]["f1"]
    # a right-branching tree has brackets, the unrepaired ill-formed outputs have none
    assert scores["right_branching"]["aiayn"]["test_brackets"] > 0
    rescored = score_tree_files(out / "data" / "test.first10.trees", out / "test.trees")
    assert rescored.all.f1 == scores["model"]["aiayn"]["f1"]
    tuning = results["tuning"]
    assert [(r["beam"], r["alpha"]) for r in tuning["tried"]] == [
        (1, 0.3),
        (1, 1.0),
        (2, 0.3),
        (2, 1.0),
    ]
    best = max(r["f1"] for r in tuning["tried"])
    chosen = next(r for r in tuning["tried"] if r["f1"] == best)
    assert tuning["chosen"] == {"beam": chosen["beam"], "alpha": chosen["alpha"]}
    assert results["config"]["decode"]["beam"] == chosen["beam"]
    assert "EVALB F1" in printed and "right-branching" in printed and "PCFG" in printed
    assert main(args) == 0  # rerun: training done, the later stages redone, same scores
    again = json.loads((out / "results.json").read_text())
    assert again["scores"] == scores and again["train"]["steps"] == 8
    # `aiayn parse` on the run's model: constrained within the limits given, and free
    words = out / "data" / "test.first10.words"
    ckpt = str(out / "checkpoint_avg.pt")
    tight = out / "tight.lin"
    base = ["parse", "--checkpoint", ckpt, "--input", str(words), "--no-progress"]
    extra = ["--beam", "2", "--max-len-b", "10"]
    limits = ["--limits-from", str(out / "data" / "train.mixed.linw"), "--max-depth", "2"]
    assert main([*base, *extra, *limits, "--output", str(out / "tight.trees"),
                 "--raw-output", str(tight)]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["constrained"] and summary["ill_formed"] == 0
    for raw in read_lines(tight):
        depth = deepest = 0
        for tok in raw.split():
            depth += tok[0] == "(" and len(tok) > 1
            depth -= tok[0] == ")" and len(tok) > 1
            deepest = max(deepest, depth)
        assert 1 <= deepest <= 2
    assert main([*base, *extra, "--no-constrained", "--output", str(out / "free.trees")]) == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert not summary["constrained"] and summary["sentences"] == 10


def test_a_missing_evalb_source_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="holds no evalb.c"):
        run_recipe(CONFIG, tmp_path / "run", overrides={"recipe.evalb": str(tmp_path / "nothere")})
    assert not (tmp_path / "run").exists()


def test_where_evalb_would_stop_the_scores_say_so(tmp_path):
    """COLLINS.prm stops after 10 sentences of unequal length; the recipe's scoring then
    scores every sentence, marks it, and does not ask EVALB (which prints no summary)."""
    gold = tmp_path / "gold.trees"
    gold.write_text("(S (NP (DT a) (NN b)) (, ,) (VP (VB c)))\n" * 12)
    test = tmp_path / "test.trees"  # the comma tagged XX: kept, so the lengths differ
    test.write_text("(S (NP (XX a) (XX b)) (XX ,) (VP (XX c)))\n" * 12)
    fine = tmp_path / "fine.trees"
    fine.write_text("(S (NP (XX a) (XX b)) (, ,) (VP (XX c)))\n" * 12)
    scores = _score_all(gold, {"bad": test, "good": fine}, "", tmp_path / "evalb")
    assert scores["bad"]["evalb_stops"] and scores["bad"]["aiayn"]["error_sentences"] == 12
    assert not scores["good"]["evalb_stops"] and scores["good"]["aiayn"]["f1"] == 100.0


needs_cc = pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)


@needs_cc
@pytest.mark.parametrize(
    ("body", "said"), [("raise(SIGSEGV);", "-11"), ('fputs("no", stderr); return 3;', "3")]
)
def test_a_failing_evalb_is_reported_beside_aiaynss_scores_not_raised(tmp_path, body, said):
    """EVALB that segfaults (as it did on an undertrained model's very long trees) or
    exits non-zero: the scores of aiayn's EVALB stand, and the failure is recorded."""
    fake = tmp_path / "EVALB"
    fake.mkdir()
    (fake / "evalb.c").write_text(
        "#include <signal.h>\n#include <stdio.h>\nint main(void) { " + body + " return 0; }\n"
    )
    (fake / "COLLINS.prm").write_text((EVALB / "COLLINS.prm").read_text())
    gold = tmp_path / "gold.trees"
    gold.write_text("(S (NP (DT a) (NN b)) (VP (VB c)))\n")
    scores = _score_all(gold, {"model": gold}, str(fake), tmp_path / "work")
    assert scores["model"]["aiayn"]["f1"] == 100.0
    assert "evalb" not in scores["model"] and said in scores["model"]["evalb_error"]


def test_an_unbuildable_evalb_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))
    fake = tmp_path / "EVALB"
    fake.mkdir()
    (fake / "evalb.c").write_text("int main(void) { return 0; }\n")
    gold = tmp_path / "gold.trees"
    gold.write_text("(S (NP (DT a) (NN b)) (VP (VB c)))\n")
    scores = _score_all(gold, {"model": gold}, str(fake), tmp_path / "work")
    assert scores["model"]["aiayn"]["f1"] == 100.0 and "evalb_error" in scores["model"]
