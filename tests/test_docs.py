"""The probe table behind docs/m30k-en-de-probes.png against docs/experiments/, whose
dated files record each run (moved there verbatim from docs/results.md), and against the
table pasted into docs/results.md: a number copied wrong into the CSV fails here."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from helpers import ROOT  # noqa: E402


def _plot_probes():
    path = ROOT / "scripts" / "plot_probes.py"
    spec = importlib.util.spec_from_file_location("plot_probes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plot_probes"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _section(text: str, title: str) -> str:
    """The body of the `### ...` section of results.md whose heading starts with title."""
    m = re.search(rf"^### {re.escape(title)}.*?$(.*?)(?=^##|\Z)", text, re.M | re.S)
    assert m, f"no section '### {title}' in docs/results.md"
    return m.group(1)


def _experiment(title: str) -> str:
    """The body of the one experiment file of docs/experiments/ whose `# ` heading starts
    with title (up to the next heading, if any)."""
    bodies = {}
    for path in sorted((ROOT / "docs" / "experiments").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        m = re.search(rf"^# {re.escape(title)}.*?$(.*?)(?=^#|\Z)", text, re.M | re.S)
        if m:
            bodies[path.name] = m.group(1)
    assert len(bodies) == 1, f"{len(bodies)} files of docs/experiments/ have '# {title}...'"
    return bodies.popitem()[1]


def test_every_probe_score_is_the_one_its_section_records():
    probes = _plot_probes().read_probes()
    assert len(probes) >= 10
    for p in probes:
        body = _experiment(p.section)
        for value in p.arm_test + p.arm_val + p.recipe_test + p.recipe_val:
            # the value as the file prints it, not as part of a longer number
            assert re.search(rf"(?<![\d.]){value:.2f}(?!\d)", body), (p.probe, value, p.section)
        assert len(p.recipe_test) == len(p.arm_test) == len(p.seeds)


def test_the_table_in_results_md_is_the_one_the_csv_gives():
    """The table is pasted into results.md; a CSV line added or changed without pasting
    the script's output again fails here."""
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    module = _plot_probes()
    assert module.markdown(module.read_probes()) in _section(results, "Every probe at a glance")


def test_markdown_table_gives_the_mean_change_per_probe(tmp_path):
    module = _plot_probes()
    csv = tmp_path / "p.csv"
    csv.write_text(
        "probe,knob,machine,seed,steps,recipe_val,arm_val,recipe_test,arm_test,section\n"
        "x,k,M,1,10,40.00,41.00,39.00,38.00,S\n"
        "x,k,M,2,10,,,40.00,40.50,S\n",
        encoding="utf-8",
    )
    (p,) = module.read_probes(csv)
    assert p.seeds == [1, 2]
    assert p.change("test") == pytest.approx((38.0 + 40.5) / 2 - (39.0 + 40.0) / 2)
    assert p.change("val") == pytest.approx(1.0)
    row = module.markdown([p]).splitlines()[-1]
    assert "39.50 -> 39.25" in row and "**-0.25**" in row and "+1.00" in row


def test_a_bad_number_names_the_file_and_line(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text(
        "probe,knob,machine,seed,steps,recipe_val,arm_val,recipe_test,arm_test,"
        "section\nx,k,M,1,10,,,39.0,forty,S\n",
        encoding="utf-8",
    )
    with pytest.raises(SystemExit, match=r"p\.csv:2:"):
        _plot_probes().read_probes(csv)


def test_results_table3_section_is_generated_from_the_probes_csv() -> None:
    """docs/results.md's Table 3 table is `aiayn table3 --import-probes`'s markdown, as is:
    a probe added to the CSV, or a number edited by hand, fails here."""
    from aiayn.experiments import table3
    from aiayn.experiments.tasks import load_recipe

    base_cfg, recipe = load_recipe(ROOT / "configs" / "multi30k-en-de.toml")
    probes = ROOT / "docs" / "m30k-en-de-probes.csv"
    rows, _ = table3.import_probes(probes, base_cfg, recipe.vocab_size)
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert table3.markdown(rows) in _section(text, "Table 3's rows among the probes")


def test_analysis_table3_sweep_is_generated_from_the_sweeps_csvs() -> None:
    """docs/analysis.md's sweep table is `aiayn table3 --csv AMD --csv SPR --markdown`, as
    is: a row added to either CSV, or a number edited by hand in the table, fails here."""
    from aiayn.experiments import table3

    csvs = [ROOT / "docs" / f"table3-multi30k-{m}.csv" for m in ("amd-epyc", "sapphire-rapids")]
    rows = table3.combine([(str(p), table3.read_csv(p)) for p in csvs])
    assert len(rows) == 20  # the paper's 18 rows that change the base + a base row per machine
    text = (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    body = _section(text, "The sweep (19 rows")
    assert table3.markdown(rows) in body
    for line in table3.summary(rows):
        assert line in body
