"""The probes' rows (docs/results.md's earlier experiments) as rows of the table."""

from __future__ import annotations

import csv
import io
import re
import sys
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

from aiayn.config import (
    Config,
)
from aiayn.experiments.table3.paper import (
    _RATES,
    SETTINGS,
    _describe,
    moves,
    paper_analog,
    settings_of,
)
from aiayn.experiments.table3.table import TableRow

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass


_PROBE_KEYS = r"N|d_model|d_ff|h|d_k|d_v|P_drop|eps_ls"
_PROBE_SETTING = re.compile(
    rf"\b((?:(?:{_PROBE_KEYS})\s*=?\s*)+)(\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+(?:\.\d+)?)"
)


def probe_settings(text: str, base: dict[str, Any]) -> dict[str, Any]:
    """The Table 3 settings a probe's name states ("h = 8, d_k = d_v = 16", "P_drop 0.2",
    "learned positional embeddings ..."), applied to `base`."""
    row = dict(base)
    for names, value in _PROBE_SETTING.findall(text):
        for key in re.findall(rf"\b(?:{_PROBE_KEYS})\b", names):
            number = value.replace(",", "")
            row[key] = float(number) if key in _RATES else int(float(number))
    if re.search(r"learned positional", text, re.I):
        row["positional"] = "learned"
    return row


def import_probes(
    path: str | Path, base_cfg: Config, vocab_size: int
) -> tuple[list[TableRow], list[str]]:
    """The probes of docs/m30k-en-de-probes.csv that are Table 3 rows, as table rows.

    Each probe there is one change to the recipe (`base_cfg`, the En->De recipe) with its
    val tok-BLEU and that of the recipe run it is paired with (same machine, same seed).
    Rows whose `knob` is Table 3's become rows here: their settings read from the probe's
    name, the paper row they stand for inferred (`paper_analog`), dev BLEU their val
    tok-BLEU (alpha chosen on val, as the recipe does; not sacreBLEU), measured against a
    base row per machine made of the paired recipe runs. The CSV records no dev
    perplexity, so these rows have none. Params are counted on the model the settings
    give with a `vocab_size` vocabulary.

    Returns:
        The rows (each machine's base row first), and a line for each Table 3 probe left
        out and why.
    """
    from aiayn.files import InputError

    base = settings_of(base_cfg)
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}): not a table3.csv") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.DictReader(f)
        need = {"probe", "knob", "machine", "seed", "steps", "recipe_val", "arm_val"}
        if not need <= set(reader.fieldnames or []):
            raise InputError(f"{path}: not a probes CSV (columns {', '.join(sorted(need))})")
        for line, raw in enumerate(reader, start=2):
            if not raw["knob"].startswith("Table 3"):
                continue
            g = groups.setdefault(
                (raw["probe"], raw["machine"]),
                {"steps": raw["steps"], "section": raw.get("section", ""), "recipe": [], "arm": []},
            )
            try:
                if raw["recipe_val"] and raw["arm_val"]:
                    g["recipe"].append(float(raw["recipe_val"]))
                    g["arm"].append(float(raw["arm_val"]))
            except ValueError:
                raise InputError(f"{path}, line {line}: a val score is not a number") from None
    bases: dict[tuple[str, tuple[float, ...]], TableRow] = {}
    members: dict[str, list[TableRow]] = {}
    skipped = []
    for (probe, machine), g in groups.items():
        settings = probe_settings(probe, base)
        analog = paper_analog(base, settings)
        if not g["arm"]:
            skipped.append(f"{probe} ({machine}): no val BLEU recorded")
            continue
        if analog is None or analog == "base":
            skipped.append(
                f"{probe} ({machine}): changes {_describe(moves(base, settings))}: "
                "no one row of the paper's Table 3 does"
            )
            continue
        key = (machine, tuple(g["recipe"]))
        if key not in bases:
            n = sum(1 for m, _ in bases if m == machine)
            label = f"recipe ({machine})" + (f" #{n + 1}" if n else "")
            bases[key] = _probe_row(
                label,
                "base",
                label,
                base,
                g["recipe"],
                base_cfg,
                vocab_size,
                base_cfg.train.max_steps,
                f"the paired recipe runs; {machine}",
            )
            members[label] = []
        members[bases[key].row].append(
            _probe_row(
                probe,
                analog,
                bases[key].row,
                settings,
                g["arm"],
                base_cfg,
                vocab_size,
                int(g["steps"]),
                f"{machine}; {g['section']}",
            )
        )
    return [r for b in bases.values() for r in [b, *members[b.row]]], skipped


def _probe_row(
    label: str,
    paper: str,
    base: str,
    settings: dict[str, Any],
    bleu: list[float],
    base_cfg: Config,
    vocab_size: int,
    steps: int,
    note: str,
) -> TableRow:
    from aiayn.model import Transformer, count_parameters

    model = replace(
        base_cfg.model,
        **{k: settings[k] for k in SETTINGS if k != "eps_ls"},
        vocab_size=vocab_size,
    )
    return TableRow(
        row=label,
        paper=paper,
        base=base,
        **settings,
        steps=steps,
        steps_max=steps,
        seeds=len(bleu),
        dev_ppl=None,
        dev_ppl_min=None,
        dev_ppl_max=None,
        dev_bleu=mean(bleu),
        dev_bleu_min=min(bleu),
        dev_bleu_max=max(bleu),
        bleu_metric="tok-BLEU",
        params=count_parameters(Transformer(model)),
        source="probes",
        note=note,
    )
