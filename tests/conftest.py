"""Shared test fixtures."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import pytest
import torch

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


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
    from aiayn.data import prepare
    from aiayn.files import read_lines

    root = tmp_path_factory.mktemp("small")
    for lang in ("en", "de"):
        lines = list(islice(read_lines(MULTI30K / f"train.{lang}.gz"), 200))
        (root / f"train.{lang}").write_text("".join(f"{x}\n" for x in lines), encoding="utf-8")
        (root / f"valid.{lang}").write_text("".join(f"{x}\n" for x in lines[:40]),
                                            encoding="utf-8")
    prepare("en", "de", root / "train", root / "valid", None, root / "prep", vocab_size=200)
    return root / "prep"


@pytest.fixture(scope="session")
def torchrun() -> list[str]:
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun")
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone"]
