"""aiayn enlarges oneDNN's kernel cache on import (aiayn/__init__.py): a product of a shape
seen 1,100 shapes ago must be found in the cache, not compiled again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROGRAM = """
import aiayn, torch
w = torch.randn(32, 16, dtype=torch.bfloat16)
for m in range(16, 16 + 1100):  # more shapes than oneDNN's default cache of 1,024
    torch.empty(m, 32, dtype=torch.bfloat16) @ w
print("REPEAT", flush=True)
torch.empty(16, 32, dtype=torch.bfloat16) @ w
"""


def _repeat_lookup(capacity: str | None) -> str:
    """The cache lookup oneDNN logged for the repeated product: cache_hit or cache_miss."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")}
    env["ONEDNN_VERBOSE"] = "2"  # logs each primitive's creation, with the cache lookup
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    after = out.split("REPEAT", 1)[1]
    lookups = [line.split(",")[3] for line in after.splitlines()
               if line.startswith("onednn_verbose") and ",create:" in line]
    if not lookups:
        pytest.skip("this PyTorch does not run bf16 products through oneDNN on this CPU")
    return lookups[0]


def test_import_enlarges_onednn_kernel_cache():
    assert _repeat_lookup(None) == "create:cache_hit"


def test_users_own_cache_setting_wins():
    # The control: with oneDNN's default size the same program compiles the kernel again.
    assert _repeat_lookup("1024") == "create:cache_miss"
