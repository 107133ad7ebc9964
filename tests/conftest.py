"""Shared test fixtures."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from helpers import MULTI30K

# Property tests draw the same examples on every run under CI (CI=true, as .ci/run sets),
# so a red build is a change in the code, not a new draw; by hand they search afresh.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI") == "true":
    settings.load_profile("ci")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a test on one thread: for tiny matrices thread start-up costs more than the work
    (and the machines are shared). Modules opt in with `usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared data directory of 200 Multi30k pairs with a 200-subword vocabulary: enough
    for a training loop to run tens of steps in a second."""
    if not MULTI30K.is_dir():
        pytest.skip("needs ../shared/data/multi30k")
    from aiayn.data.prepare import prepare
    from aiayn.files import read_lines

    root = tmp_path_factory.mktemp("small")
    for lang in ("en", "de"):
        lines = list(islice(read_lines(MULTI30K / f"train.{lang}.gz"), 200))
        (root / f"train.{lang}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        (root / f"valid.{lang}").write_text("".join(f"{x}\n" for x in lines[:40]), encoding="utf-8")
    prepare("en", "de", root / "train", root / "valid", None, root / "prep", vocab_size=200)
    return root / "prep"


@pytest.fixture(scope="session")
def torchrun() -> list[str]:
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun")
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone"]


# --------------------------------------------------------------------------- reliability report
# With AIAYN_RELIABILITY_REPORT=FILE, every test marked `rows(...)` appends one JSON line:
# its RELIABILITY.md rows, outcome, duration and what it recorded with record_property
# (faults injected, steps lost, ...). scripts/reliability_report.py turns that into the
# figures of the matrix's section 4.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("AIAYN_RELIABILITY_REPORT")
    marker = item.get_closest_marker("rows")
    if not path or marker is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        record = {
            "test": item.nodeid,
            "rows": list(marker.args),
            "outcome": report.outcome,
            "seconds": round(report.duration, 2),
            "properties": {k: v for k, v in item.user_properties},
        }
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
