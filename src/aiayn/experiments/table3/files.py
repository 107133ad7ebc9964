"""The sweep's files: table3.csv (written and read back, several combined) and table3.json."""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from aiayn.experiments.table3.grid import Table3Experiment
from aiayn.experiments.table3.paper import PAPER_TABLE3, TIE
from aiayn.experiments.table3.table import Table3Report, TableRow, compare, summary
from aiayn.files import write_text_atomic

if sys.version_info >= (3, 11):
    pass
else:  # Python 3.10: tomli, the same parser
    pass


#: TableRow's columns a CSV may lack (written by a version before them): their defaults.
_OPTIONAL_COLUMNS = ("note", "machine")

#: Columns the CSV adds after TableRow's own: derived, ignored when it is read back.
DERIVED = (
    "paper_ppl",
    "paper_bleu",
    "paper_params_m",
    "ppl_change",
    "paper_ppl_change",
    "ppl_way",
    "ppl_within_spread",
    "bleu_change",
    "paper_bleu_change",
    "bleu_way",
    "bleu_within_spread",
)


def _csv_value(x: Any) -> str:
    if x is None:
        return ""
    return repr(x) if isinstance(x, float) else str(x)


def to_csv(rows: Sequence[TableRow]) -> str:
    """The rows as CSV: TableRow's fields, then the paper's numbers and the verdicts."""
    verdicts = compare(rows)
    buf = io.StringIO()
    names = [f.name for f in fields(TableRow)]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(names + list(DERIVED))
    for r in rows:
        paper = PAPER_TABLE3.get(r.paper or "")
        v = verdicts.get(r.row)
        derived: list[Any] = [
            None if paper is None else paper.ppl,
            None if paper is None else paper.bleu,
            None if paper is None else paper.params_m,
        ]
        for i in (0, 1):
            derived += (
                [None] * 4
                if v is None
                else [v[i].ours, v[i].paper, v[i].direction, v[i].within_spread]
            )
        w.writerow([_csv_value(getattr(r, n)) for n in names] + [_csv_value(x) for x in derived])
    return buf.getvalue()


def read_csv(path: str | Path) -> list[TableRow]:
    """A table3.csv read back (its derived columns are recomputed, not read).

    Raises:
        InputError: a missing column or a bad number, naming the file and line.
    """
    from aiayn.files import InputError

    types = {f.name: f.type for f in fields(TableRow)}
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}): not a table3.csv") from None
    with io.StringIO(text, newline="") as f:
        reader = csv.DictReader(f)
        have = set(reader.fieldnames or [])
        missing = [n for n in types if n not in have and n not in _OPTIONAL_COLUMNS]
        if missing:
            raise InputError(f"{path}: not a table3 CSV (no column {', '.join(missing)})")
        for line, raw in enumerate(reader, start=2):
            values: dict[str, Any] = {}
            for name, typ in types.items():
                if name not in have:
                    continue  # an optional column, from before it was written: its default
                text = raw[name]
                try:
                    if text == "" and "None" in str(typ):
                        values[name] = None
                    elif str(typ).startswith("int"):
                        values[name] = int(text)
                    elif str(typ).startswith("float"):
                        values[name] = float(text)
                    else:
                        values[name] = text
                except ValueError:
                    raise InputError(f"{path}, line {line}: {name} = {text!r}") from None
            rows.append(TableRow(**values))
    return rows


def combine(tables: Sequence[tuple[str, Sequence[TableRow]]]) -> list[TableRow]:
    """Several tables (e.g. sweeps on different machines) as one, each row still measured
    against the base row of its own table.

    `tables` is (name, rows) per table, the name a file's for messages. Where more than
    one table has a row called "base", each is renamed "base (MACHINE)", MACHINE being
    the machine its table's base row trained on (or the table's name where none is
    recorded), and the rows that pointed at it follow: a row's change is measured on the
    machine that trained it, where the bf16 kernels (and the base) are its own.

    Raises:
        InputError: a row name (other than "base") in two tables, naming both.
    """
    from aiayn.files import InputError

    bases = sum(1 for _, rows in tables if any(r.row == "base" for r in rows))
    out: list[TableRow] = []
    seen: dict[str, str] = {}
    for name, rows in tables:
        rename: dict[str, str] = {}
        if bases > 1:
            base = next((r for r in rows if r.row == "base"), None)
            if base is not None:
                rename["base"] = f"base ({base.machine or Path(name).stem})"
        for r in rows:
            label = rename.get(r.row, r.row)
            if label in seen:
                raise InputError(
                    f"{name}: row {label} is also in {seen[label]}: a row can be in one table "
                    "only (a machine's second base row needs its own machine name)"
                )
            seen[label] = name
            out.append(replace(r, row=label, base=rename.get(r.base, r.base)))
    return out


def to_json(report: Table3Report, exp: Table3Experiment | None = None) -> dict[str, Any]:
    verdicts = compare(report.rows)
    return {
        "experiment": None if exp is None else str(exp.path),
        "recipe": None if exp is None else str(exp.recipe_path),
        "scale": None if exp is None else exp.scale,
        "dev_decode": None if exp is None else exp.dev_decode,
        "rows": [
            {
                **asdict(r),
                "verdicts": None
                if r.row not in verdicts
                else dict(zip(("ppl", "bleu"), map(asdict, verdicts[r.row]), strict=True)),
            }
            for r in report.rows
        ],
        "summary": summary(report.rows),
        "missing": report.missing,
        "runs": [asdict(r) for r in report.runs],
        "paper": {k: asdict(v) for k, v in PAPER_TABLE3.items()},
        "tie": TIE,
    }


def write_outputs(
    report: Table3Report, out: Path, exp: Table3Experiment | None = None
) -> list[Path]:
    """DIR/table3.csv and DIR/table3.json."""
    paths = [out / "table3.csv", out / "table3.json"]
    write_text_atomic(paths[0], to_csv(report.rows))
    write_text_atomic(paths[1], json.dumps(to_json(report, exp), indent=1) + "\n")
    return paths
