"""`aiayn table3`: Table 3's rows trained on a micro grid (resume after an interruption, a
changed row refused, rescoring alone), the paper's numbers, the directions against
hand-made numbers, the CSV's round trip to markdown, and the probes as rows."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest

from aiayn.config import ConfigError, get_preset
from aiayn.experiments import stages
from aiayn.experiments import table3 as t3
from aiayn.experiments.manifest import machine_name
from aiayn.experiments.stages import RecipeStoppedError
from aiayn.experiments.table3.row import _valid_text
from aiayn.experiments.tasks import load_recipe
from aiayn.files import InputError
from aiayn.training.trainer import Hooks
from helpers import ROOT, cli

CONFIG = ROOT / "configs" / "table3-multi30k.toml"
PROBES = ROOT / "docs" / "m30k-en-de-probes.csv"

# A micro recipe in the style of helpers.SMALL_TRAINING: a one-layer d_model 32 model, a
# checkpoint every 3 of 6 steps, the last two averaged, outputs of at most input + 5 tokens.
MICRO_RECIPE = """\
preset = "tiny"
[model]
N = 1
d_model = 32
d_ff = 64
h = 2
d_k = 16
d_v = 16
P_drop = 0.1
[train]
max_tokens = 400
max_steps = 6
warmup_steps = 4
save_interval_steps = 3
save_interval_minutes = 0
keep_last = 4
log_interval_steps = 1
valid_interval_steps = 3
dtype = "fp32"
preflight = false
[decode]
max_len_b = 5
[recipe]
average_last = 2
"""


def micro_grid(tmp_path: Path, *, d_ff: int = 64, dev_decode: str = "greedy") -> Path:
    (tmp_path / "micro.toml").write_text(MICRO_RECIPE)
    path = tmp_path / "table3.toml"
    path.write_text(
        f"""\
[sweep]
recipe = "micro.toml"
scale = "micro"
dev_decode = "{dev_decode}"
[sweep.set]
d_ff = {d_ff}
[rows]
base = {{}}
A1 = {{ h = 1, d_k = 32, d_v = 32 }}
A3 = {{ h = 4, d_k = 8, d_v = 8 }}
"""
    )
    return path


@pytest.fixture
def train_calls(monkeypatch):
    """The runs stages.train_stage trains, by run directory."""
    calls: list[Path] = []
    real = stages.train_stage

    def counting(recipe, cfg, prepared, out, device, hooks):
        calls.append(Path(out))
        return real(recipe, cfg, prepared, out, device, hooks)

    monkeypatch.setattr(stages, "train_stage", counting)
    return calls


def test_micro_sweep_resumes_after_an_interruption_and_refuses_a_changed_row(
    tmp_path, small_data, train_calls
):
    out = tmp_path / "sweep"
    exp = t3.load_table3(micro_grid(tmp_path))

    # the base row alone: trained, scored, marked done
    report = t3.run_table3(exp, out, prepared=small_data, rows=["base"])
    assert [r.row for r in report.rows] == ["base"] and report.missing == ["A1", "A3"]
    base_run = out / "base" / "seed1"
    marker = json.loads((base_run / t3.ROW_FILE).read_text())
    assert marker["steps"] == 6 and marker["stopped_by"] == "max_steps"
    assert marker["dev_ppl"] > 1 and 0 <= marker["dev_bleu"] <= 100
    assert marker["averaged"] == ["checkpoint_3.pt", "checkpoint_6.pt"]
    assert marker["machine"] == machine_name("cpu") and marker["machine"]
    assert len((base_run / "dev.hyp").read_text().splitlines()) == 40
    stamp = {p.name: p.stat().st_mtime_ns for p in base_run.iterdir()}
    assert train_calls == [base_run]

    # base and A1, A1 stopped by SIGTERM at its step 2: the base row is not trained again
    def stop_a1(row, seed, steps):
        def on_step(step, stats):
            if row == "A1" and step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        return Hooks(on_step=on_step)

    with pytest.raises(RecipeStoppedError, match="SIGTERM at step 2"):
        t3.run_table3(exp, out, prepared=small_data, rows=["base", "A1"], hooks_for=stop_a1)
    a1_run = out / "A1" / "seed1"
    assert train_calls == [base_run, a1_run]
    assert not (a1_run / t3.ROW_FILE).exists() and (a1_run / "checkpoint_2.pt").is_file()
    # an interrupted run is checked too: another model would not resume from its checkpoint
    with pytest.raises(ConfigError, match=r"A1/seed1: started with other settings.*model\.d_ff"):
        t3.run_table3(t3.load_table3(micro_grid(tmp_path, d_ff=96)), out, prepared=small_data)
    assert len(train_calls) == 2
    exp = t3.load_table3(micro_grid(tmp_path))

    # the same call again resumes A1 from its step 2 and leaves base as it was
    report = t3.run_table3(exp, out, prepared=small_data, rows=["base", "A1"])
    assert train_calls == [base_run, a1_run, a1_run]
    assert {p.name: p.stat().st_mtime_ns for p in base_run.iterdir()} == stamp
    a1 = json.loads((a1_run / t3.ROW_FILE).read_text())
    assert a1["steps"] == 6
    logged = [json.loads(x) for x in (a1_run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r and "event" not in r] == [1, 2, 3, 4, 5, 6]

    # the table: the paper's layout, one line per finished row, files written
    assert [r.row for r in report.rows] == ["base", "A1"] and report.missing == ["A3"]
    assert report.rows[1].h == 1 and report.rows[1].params == a1["params"]
    assert report.rows[1].machine == machine_name("cpu")
    text = t3.format_table(report.rows)
    header = text.splitlines()[0].split()
    for column in ("row", "N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls"):
        assert column in header
    for column in ("steps", "dev PPL", "dev BLEU", "params", "paper PPL", "paper BLEU"):
        assert column in text.splitlines()[0]
    assert "rows point the paper's way" in text
    assert (out / "table3.csv").is_file() and (out / "table3.json").is_file()
    assert [r.row for r in t3.read_csv(out / "table3.csv")] == ["base", "A1"]

    # a changed setting: refused before any training, naming the key and each run
    changed = t3.load_table3(micro_grid(tmp_path, d_ff=96))
    with pytest.raises(ConfigError, match=r"model\.d_ff: 64 -> 96") as e:
        t3.run_table3(changed, out, prepared=small_data)
    assert str(base_run) in str(e.value) and str(a1_run) in str(e.value)
    assert len(train_calls) == 3

    # a scoring setting alone: rescored from the checkpoints, not trained
    beam = t3.load_table3(micro_grid(tmp_path, dev_decode="beam"))
    report = t3.run_table3(beam, out, prepared=small_data, rows=["base"])
    assert len(train_calls) == 3
    rescored = json.loads((base_run / t3.ROW_FILE).read_text())
    assert rescored["score_key"]["dev_decode"] == "beam" and rescored["steps"] == 6
    assert [r.row for r in report.rows] == ["base"]  # A1, scored greedily, is left out

    # the command line: the finished rows' table, nothing trained or scored
    code, stdout, _ = cli(
        "table3", micro_grid(tmp_path), "--out", out, "--prepared", small_data, "--no-train"
    )
    assert code == 0 and "not in the table yet: base, A3" in stdout and "dev BLEU" in stdout
    assert len(train_calls) == 3


def test_directions_against_hand_made_numbers():
    def row(label, ppl, bleu, base="base", paper=None, seeds=1, spread=0.0, **settings):
        s = {**t3.settings_of(get_preset("base")), **settings}
        return t3.TableRow(
            row=label,
            paper=paper or label,
            base=base,
            **s,
            steps=100,
            steps_max=100,
            seeds=seeds,
            dev_ppl=ppl,
            dev_ppl_min=None if ppl is None else ppl - spread,
            dev_ppl_max=None if ppl is None else ppl + spread,
            dev_bleu=bleu,
            dev_bleu_min=bleu - spread,
            dev_bleu_max=bleu + spread,
            bleu_metric="sacreBLEU",
            params=1000,
            source="test",
        )

    rows = [
        row("base", 5.0, 30.0),
        row("A1", 5.5, 29.0, h=1, d_k=512, d_v=512),  # paper: PPL up, BLEU down
        row("C5", 5.5, 31.0, d_model=1024),  # paper: PPL down, BLEU up
        row("A3", 4.9, 30.04, h=16, d_k=32, d_v=32),  # paper BLEU 25.8 = base: a tie
        row("E", 5.3, 29.0, positional="learned"),  # paper PPL 4.92 = base: a tie
    ]
    v = t3.compare(rows)
    assert "base" not in v
    assert [x.direction for x in v["A1"]] == ["same", "same"]
    assert [x.direction for x in v["C5"]] == ["opposite", "same"]
    assert [x.direction for x in v["A3"]] == ["same", "tie"]  # paper -0.01 PPL; BLEU 0 both
    assert [x.direction for x in v["E"]] == ["tie", "same"]
    assert v["C5"][0].ours == pytest.approx(0.5) and v["C5"][0].paper == pytest.approx(-0.26)
    assert v["A1"][0].within_spread is None  # one seed: no spread
    assert t3.summary(rows) == [
        "dev PPL: 2 of 4 rows point the paper's way (50%); 1 opposite (C5), 1 tie (E)",
        "dev BLEU: 3 of 4 rows point the paper's way (75%); 0 opposite, 1 tie (A3)",
    ]
    # ours within rounding of zero is a tie too; a missing score is not judged
    assert t3.direction(-0.1, 0.004, t3.TIE["ppl"]) == "tie"
    assert t3.direction(-0.1, 0.04, t3.TIE["bleu"]) == "tie"
    assert t3.direction(0.2, 0.06, t3.TIE["bleu"]) == "same"
    assert t3.direction(0.2, None, t3.TIE["bleu"]) == ""
    # three seeds: an opposite change inside the seeds' range says so
    seeded = [
        row("base", 5.0, 30.0, seeds=3, spread=0.3),
        row("C5", 5.2, 29.5, seeds=3, spread=0.3, d_model=1024),
    ]
    ppl, bleu = t3.compare(seeded)["C5"]
    assert ppl.direction == "opposite" and ppl.within_spread is True
    assert bleu.direction == "opposite" and bleu.within_spread is True
    assert "opposite (in spread)" in t3.format_table(seeded)
    assert "1 of them within the seeds' spread" in t3.summary(seeded)[0]
    assert "5.20 (4.90-5.50)" in t3.format_table(seeded)
    # seeds for the base row alone: a one-seed row is in spread when its value lies in
    # the base row's range, and not when it lies outside
    base_seeded = [
        row("base", 5.0, 30.0, seeds=3, spread=0.3),
        row("C5", 5.2, 29.0, d_model=1024),
    ]
    ppl, bleu = t3.compare(base_seeded)["C5"]
    assert ppl.direction == "opposite" and ppl.within_spread is True
    assert bleu.direction == "opposite" and bleu.within_spread is False
    assert "1 of them within the seeds' spread" in t3.summary(base_seeded)[0]
    assert "0 of them within the seeds' spread" in t3.summary(base_seeded)[1]
    # two machines' sweeps in one table: an opposite row whose base has one seed is named
    # as unjudged rather than counted outside the spread
    two_bases = [
        *base_seeded,
        row("base (b)", 5.0, 30.0, base="base (b)", paper="base"),
        row("C5b", 5.2, 29.0, base="base (b)", paper="C5", d_model=1024),
    ]
    line = t3.summary(two_bases)[0]
    assert "2 opposite (C5, C5b; 1 of them within the seeds' spread, C5b one seed a side)" in line


def test_the_csv_gives_the_same_table_as_markdown(tmp_path):
    rows = _probe_rows()
    path = tmp_path / "table3.csv"
    path.write_text(t3.to_csv(rows))
    back = t3.read_csv(path)
    assert back == rows
    assert t3.markdown(back) == t3.markdown(rows)
    md = t3.markdown(rows).splitlines()
    assert md[0].startswith("| row | paper row | N | d_model |") and md[1].startswith("|---|")
    assert any(line.startswith("| h = 8, d_k = d_v = 16 | A3 |") for line in md)
    code, stdout, _ = cli("table3", "--csv", path, "--markdown")
    assert code == 0 and stdout.strip() == t3.markdown(rows).strip()


def test_sweeps_from_two_machines_in_one_table_each_row_against_its_own_base(tmp_path):
    def row(label, ppl, bleu, machine, seeds=1, spread=0.0, **settings):
        s = {**t3.settings_of(get_preset("base")), **settings}
        return t3.TableRow(
            row=label,
            paper=label,
            base="base",
            **s,
            steps=100,
            steps_max=100,
            seeds=seeds,
            dev_ppl=ppl,
            dev_ppl_min=ppl - spread,
            dev_ppl_max=ppl + spread,
            dev_bleu=bleu,
            dev_bleu_min=bleu - spread,
            dev_bleu_max=bleu + spread,
            bleu_metric="sacreBLEU",
            params=1000,
            source="sweep",
            machine=machine,
        )

    # machine one's A1 goes the paper's way against its own base (PPL up, BLEU down) and
    # would go the other way against machine two's, whose base is worse
    one = [row("base", 5.0, 30.0, "CPU one", seeds=3, spread=0.1), row("A1", 5.5, 29.0, "CPU one")]
    two = [row("base", 6.0, 28.0, "CPU two"), row("C7", 5.8, 28.5, "CPU two", d_ff=4096)]
    paths = []
    for k, rows in enumerate((one, two)):
        paths.append(tmp_path / f"sweep{k}.csv")
        paths[-1].write_text(t3.to_csv(rows))
    rows = t3.combine([(str(p), t3.read_csv(p)) for p in paths])
    assert [r.row for r in rows] == ["base (CPU one)", "A1", "base (CPU two)", "C7"]
    assert [r.base for r in rows] == ["base (CPU one)"] * 2 + ["base (CPU two)"] * 2
    v = t3.compare(rows)
    assert set(v) == {"A1", "C7"}
    assert v["A1"][0].ours == pytest.approx(0.5) and v["A1"][1].ours == pytest.approx(-1.0)
    assert v["C7"][0].ours == pytest.approx(-0.2) and v["C7"][1].ours == pytest.approx(0.5)
    assert [x.direction for x in v["A1"] + v["C7"]] == ["same"] * 4
    assert v["A1"][0].within_spread is False and v["C7"][0].within_spread is None
    assert t3.summary(rows)[0].startswith("dev PPL: 2 of 2 rows point the paper's way")
    # the machine is a column when the rows ran on more than one; the paper's layout
    # blanks a setting equal to the row's own base
    md = t3.markdown(rows).splitlines()
    assert md[0].endswith("| PPL way | BLEU way | machine |")
    assert md[5].startswith("| C7 | C7 |  |  | 4096 |  |") and md[5].endswith("| CPU two |")
    code, stdout, _ = cli("table3", "--csv", paths[0], "--csv", paths[1], "--markdown")
    assert code == 0 and stdout.strip() == t3.markdown(rows).strip()
    # one table alone keeps its base row's name; a row in two tables is refused
    assert [r.row for r in t3.combine([("one", one)])] == ["base", "A1"]
    with pytest.raises(InputError, match=r"sweep1\.csv: row A1 is also in .*sweep0\.csv"):
        t3.combine([(str(paths[0]), one), (str(paths[1]), [*two, one[1]])])
    # a CSV written before the machine column reads as rows with no machine recorded
    old = tmp_path / "old.csv"
    lines = t3.to_csv(one).splitlines()
    k = lines[0].split(",").index("machine")
    old.write_text("\n".join(",".join(x.split(",")[:k] + x.split(",")[k + 1 :]) for x in lines))
    assert [r.machine for r in t3.read_csv(old)] == ["", ""]


def test_the_papers_table():
    paper = t3.PAPER_TABLE3
    assert (paper["base"].ppl, paper["base"].bleu, paper["base"].params_m) == (4.92, 25.8, 65)
    assert (paper["big"].ppl, paper["big"].bleu, paper["big"].params_m) == (4.33, 26.4, 213)
    assert (paper["C5"].ppl, paper["C5"].bleu) == (4.66, 26.0)
    assert len(paper) == 20  # base, 18 rows A-E, big
    for label in paper:  # each paper row's settings are the preset of its name
        s = t3.paper_settings(label)
        if label[0] == "A":  # constant compute
            assert s["h"] * s["d_k"] == s["h"] * s["d_v"] == 512
        assert s["steps"] == (300_000 if label == "big" else 100_000)
    # every row but the base and big changes the base the way its analog does: itself
    base = t3.paper_settings("base")
    for label in paper:
        if label not in ("base", "big"):
            assert t3.paper_analog(base, t3.paper_settings(label)) == label


def test_the_multi30k_experiment_file_scales_each_row_as_the_paper():
    exp = t3.load_table3(CONFIG)
    assert [r.name for r in exp.rows] == list(t3.PAPER_TABLE3)[:-1]  # all but big
    assert exp.recipe_path.name == "multi30k-en-de.toml"
    recipe_cfg, _ = load_recipe(exp.recipe_path)
    assert exp.base.model == recipe_cfg.model  # the base row is the recipe's model
    assert exp.base.train.save_interval_minutes == 0 and exp.recipe.average_last == 5
    base = t3.settings_of(exp.base)
    for spec in exp.rows:
        cfg = exp.config(spec, 1)
        assert spec.paper == spec.name
        assert cfg.train.max_steps == 4000 and cfg.train.max_minutes == 120  # one budget
        if spec.name[0] == "A":
            assert cfg.model.h * cfg.model.d_k == cfg.model.d_model
        # the settings its paper row changes, each the same way (the size may differ:
        # C1's N = 2 of 4 is nearer C2's 4 of 6, but both are fewer layers)
        ours = t3.moves(base, t3.settings_of(cfg))
        theirs = t3.moves(t3.paper_settings("base"), t3.paper_settings(spec.name))
        assert set(ours) == set(theirs)
        assert all((ours[k] > 0) == (theirs[k] > 0) for k in ours), spec.name


def test_pre_ln_rows_train_with_model_norm_pre():
    """configs/table3-norm.toml: post- against pre-LN as rows (issue 73)."""
    exp = t3.load_table3(ROOT / "configs" / "table3-norm.toml")
    norms = {s.name: exp.config(s, 1).model for s in exp.rows}
    assert {k: (m.norm, m.N) for k, m in norms.items()} == {
        "base": ("post", 4),
        "pre": ("pre", 4),
        "C3": ("post", 6),
        "C3pre": ("pre", 6),
    }
    assert exp.row("pre").paper is None and exp.row("C3pre").paper is None
    assert exp.row("C3").paper == "C3"
    assert exp.base == t3.load_table3(CONFIG).base  # the Table 3 sweep's base row


def test_a_row_that_moves_against_its_paper_row_is_refused(tmp_path):
    (tmp_path / "micro.toml").write_text(MICRO_RECIPE)
    bad = tmp_path / "bad.toml"
    bad.write_text('[sweep]\nrecipe = "micro.toml"\n[rows]\nbase = {}\nC7 = { d_ff = 32 }\n')
    with pytest.raises(ConfigError, match="d_ff down but the paper's C7 changes d_ff up"):
        t3.load_table3(bad)
    bad.write_text('[sweep]\nrecipe = "micro.toml"\n[rows]\nA1 = { h = 1 }\n')
    with pytest.raises(ConfigError, match="base"):
        t3.load_table3(bad)
    bad.write_text('[sweep]\nrecipe = "micro.toml"\n[rows]\nbase = {}\nX = { vocab_size = 9 }\n')
    with pytest.raises(ConfigError, match="rows.X"):
        t3.load_table3(bad)
    good = micro_grid(tmp_path)
    exp = t3.load_table3(good)
    assert [s.name for s in t3.select_rows(exp, ["A"])] == ["base", "A1", "A3"]
    with pytest.raises(ValueError, match="no row 'B'"):
        t3.select_rows(exp, ["B"])


def _probe_rows():
    cfg, recipe = load_recipe(ROOT / "configs" / "multi30k-en-de.toml")
    rows, skipped = t3.import_probes(PROBES, cfg, recipe.vocab_size)
    return rows


def test_the_probes_become_rows_against_their_paired_recipe_runs():
    cfg, recipe = load_recipe(ROOT / "configs" / "multi30k-en-de.toml")
    rows, skipped = t3.import_probes(PROBES, cfg, recipe.vocab_size)
    by = {r.row: r for r in rows}
    assert by["recipe (AMD EPYC)"].dev_bleu == 41.71 and by["recipe (AMD EPYC)"].paper == "base"
    assert by["recipe (AMD EPYC)"].params == 2_342_912  # docs/experiments: the recipe's count
    assert by["N = 2"].params == 1_683_456 and by["N = 2"].N == 2
    assert by["learned positional embeddings (max_positions 1,024)"].params == 2_605_056
    analogs = {r.row: r.paper for r in rows if r.paper != "base"}
    assert analogs == {
        "eps_ls 0.2": "D4",
        "d_ff 512": "C7",
        "N = 6, warmup 4,000": "C3",
        "P_drop 0.2": "D1",
        "h = 8, d_k = d_v = 16": "A3",
        "eps_ls 0": "D3",
        "h = 2, d_k = d_v = 64": "A2",
        "learned positional embeddings (max_positions 1,024)": "E",
        "P_drop 0.4": "D2",
        "d_k 16 (h = 4, d_v = 32)": "B2",
        "N = 2": "C2",
    }
    assert by["d_ff 512"].base == "recipe (Sapphire Rapids)" and by["N = 2"].base == (
        "recipe (AMD EPYC)"
    )
    assert all(r.dev_ppl is None and r.bleu_metric == "tok-BLEU" for r in rows)
    assert skipped == ["eps_ls 0.2 and d_ff 512, 9,200 steps (H200): no val BLEU recorded"]
    assert t3.compare(rows)["d_ff 512"][1].direction == "opposite"  # 41.50 < 41.61


def test_the_data_is_prepared_once_for_every_row(tmp_path):
    from helpers import MULTI30K

    if not MULTI30K.is_dir():
        pytest.skip("needs ../shared/data/multi30k")
    path = micro_grid(tmp_path)
    small = {"recipe.max_train_pairs": 200, "recipe.vocab_size": 200}
    out = tmp_path / "sweep"
    prepared = t3.prepare_data(t3.load_table3(path, small), out, MULTI30K)
    manifest = (prepared / "manifest.json").stat().st_mtime_ns
    assert t3.prepare_data(t3.load_table3(path, small), out, MULTI30K) == prepared
    assert (prepared / "manifest.json").stat().st_mtime_ns == manifest  # reused, not redone
    src, ref = _valid_text(prepared)  # dev BLEU reads the whole val split
    assert src.name.startswith("val.en") and ref.name.startswith("val.de")
    with pytest.raises(ConfigError, match="vocab_size: 200 -> 300"):
        t3.prepare_data(t3.load_table3(path, {**small, "recipe.vocab_size": 300}), out, None)


def test_rows_trained_in_parallel_processes_equal_rows_trained_one_after_another(
    tmp_path, small_data
):
    exp = t3.load_table3(micro_grid(tmp_path))
    one = t3.run_table3(exp, tmp_path / "one", prepared=small_data, rows=["base", "A1"])
    two = t3.run_table3(exp, tmp_path / "two", prepared=small_data, rows=["base", "A1"], jobs=2)
    assert [r.row for r in two.rows] == ["base", "A1"] and two.missing == ["A3"]
    for a, b in zip(one.runs, two.runs, strict=True):
        assert (a.row, a.seed, a.steps, a.params) == (b.row, b.seed, b.steps, b.params)
        # each worker has one thread, this process may have more: other summation order
        assert b.dev_ppl == pytest.approx(a.dev_ppl, rel=1e-4)
        losses = [
            [json.loads(x).get("loss") for x in (Path(r.run_dir) / "train_log.jsonl").open()]
            for r in (a, b)
        ]
        assert [x for x in losses[1] if x] == pytest.approx([x for x in losses[0] if x], rel=1e-4)
    assert [r.row for r in t3.read_csv(tmp_path / "two" / "table3.csv")] == ["base", "A1"]
    # a finished parallel sweep is finished: nothing runs again
    again = t3.run_table3(exp, tmp_path / "two", prepared=small_data, rows=["base", "A1"], jobs=2)
    assert [r.train_seconds for r in again.runs] == [r.train_seconds for r in two.runs]


def test_a_signal_to_a_parallel_sweep_saves_the_running_rows_and_starts_no_queued_one(
    tmp_path, small_data
):
    # three runs on two workers: the pool hands the third to whichever worker stops first
    # (it is queued in the pool already), which must not start it after the SIGTERM
    exp = t3.load_table3(micro_grid(tmp_path), {"train.max_steps": 400})
    out = tmp_path / "sweep"
    # (checkpoint_last.pt: a numbered one may already be gone, train.keep_last)
    first = [out / row / "seed1" / "checkpoint_last.pt" for row in ("base", "A1")]

    returned = threading.Event()  # no SIGTERM to pytest itself once the sweep is over

    def stop_when_both_train() -> None:
        deadline = time.monotonic() + 120
        while not all(f.is_file() for f in first) and time.monotonic() < deadline:
            if returned.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_both_train, daemon=True).start()
    try:
        with pytest.raises(RecipeStoppedError, match="stopped by SIGTERM: 0 runs finished"):
            t3.run_table3(exp, out, prepared=small_data, jobs=2)
    finally:
        returned.set()
    for row in ("base", "A1"):
        run = out / row / "seed1"
        assert not (run / t3.ROW_FILE).exists()
        log = [json.loads(x) for x in (run / "train_log.jsonl").open()]
        last = max(x["step"] for x in log if "step" in x)
        assert 3 <= last < 400 and (run / "checkpoint_last.pt").is_file()
    assert not (out / "A3").exists()  # never started


def test_a_stopped_run_survives_the_trip_from_a_worker_process():
    # a worker's exception reaches the parent by pickle: one that cannot be rebuilt there
    # breaks the pool, which then SIGTERMs every worker
    e = RecipeStoppedError("SIGTERM", 12, Path("runs/x"))
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.signal_name, back.step) == (
        RecipeStoppedError,
        str(e),
        "SIGTERM",
        12,
    )
