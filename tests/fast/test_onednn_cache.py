"""The `aiayn` command enlarges oneDNN's kernel cache before any torch work
(aiayn.cli.environment): a product of a shape seen 1,100 shapes ago must be found in the
cache, not compiled again. `import aiayn` alone changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROGRAM = """
from aiayn.cli.environment import apply_process_settings
apply_process_settings([], reexec=False)  # what `aiayn COMMAND` does first
import torch
w = torch.randn(32, 16, dtype=torch.bfloat16)
for m in range(16, 16 + 1100):  # more shapes than oneDNN's default cache of 1,024
    torch.empty(m, 32, dtype=torch.bfloat16) @ w
print("REPEAT", flush=True)
torch.empty(16, 32, dtype=torch.bfloat16) @ w
"""


def _repeat_lookup(capacity: str | None) -> str:
    """The cache lookup oneDNN logged for the repeated product: cache_hit or cache_miss."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
    }
    env["ONEDNN_VERBOSE"] = "2"  # logs each primitive's creation, with the cache lookup
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    after = out.split("REPEAT", 1)[1]
    lookups = [
        line.split(",")[3]
        for line in after.splitlines()
        if line.startswith("onednn_verbose") and ",create:" in line
    ]
    if not lookups:
        pytest.skip("this PyTorch does not run bf16 products through oneDNN on this CPU")
    return lookups[0]


def test_the_command_enlarges_onednn_kernel_cache():
    assert _repeat_lookup(None) == "create:cache_hit"


def test_users_own_cache_setting_wins():
    # The control: with oneDNN's default size the same program compiles the kernel again.
    assert _repeat_lookup("1024") == "create:cache_miss"


def test_importing_aiayn_changes_no_environment_variable():
    """No side effects on import: every package of aiayn imported, os.environ unchanged
    (the dependencies' own import effects are kept out: sacremoses, through joblib, sets
    KMP_INIT_AT_FORK, so aiayn imports it where it is used)."""
    program = (
        "import os, pkgutil, importlib, aiayn\n"
        "before = dict(os.environ)\n"
        "for m in pkgutil.walk_packages(aiayn.__path__, 'aiayn.'):\n"
        "    if '_triton' not in m.name and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())\n"
        "print('unchanged')\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
    }
    out = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-2000:]
