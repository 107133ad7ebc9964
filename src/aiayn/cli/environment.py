"""Process settings the `aiayn` command makes before any torch work.

Both are environment variables that a library cannot set for itself once the process runs:

- glibc's malloc hands large freed blocks back to the kernel and faults them in again on
  the next training or decoding step. Page faults are slow on virtual machines, so the
  heavy subcommands re-execute themselves once with settings that keep those blocks
  (`MALLOC_ENV`; the allocator reads them only at process start). Opt out with
  AIAYN_NO_MALLOC_TUNING=1; values the user set win.
- On the CPU, PyTorch's bf16 matrix products are oneDNN primitives, each compiled for one
  product shape and kept in a cache of 1,024 by default. Length-bucketed batches make
  more distinct shapes than that every epoch, so with the default cache training would
  compile its kernels again on every step. oneDNN reads the capacity when it makes its
  first primitive, so it is raised to `ONEDNN_PRIMITIVE_CACHE_CAPACITY` here, first thing,
  unless the user set it (ONEDNN_ or the older DNNL_ name).
- `AIAYN_CPU_ISA=CLASS` (e.g. avx2) holds the process to a CPU class: the libraries' own
  ceilings (oneDNN's, ATen's, MKL's, CTranslate2's) are set from it here, before torch
  reads them (`aiayn.cpu_isa.isa_environment`), so a bigger CPU runs what that class runs.
"""

from __future__ import annotations

import os
import sys

from aiayn.config import ONEDNN_PRIMITIVE_CACHE_CAPACITY
from aiayn.cpu_isa import apply_isa_environment

#: Kernels oneDNN keeps compiled (its own default: 1,024).
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")

#: glibc malloc settings that keep freed memory in the process instead of returning it.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "536870912",
}
#: Subcommands that allocate and free large tensors every step.
HEAVY_COMMANDS = frozenset({"train", "translate", "recipe", "bench", "serve", "table1", "table3"})


def set_onednn_cache_capacity() -> None:
    """Raise oneDNN's kernel cache to ONEDNN_PRIMITIVE_CACHE_CAPACITY unless the user set it."""
    if not any(k in os.environ for k in ONEDNN_CACHE_VARIABLES):
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(ONEDNN_PRIMITIVE_CACHE_CAPACITY)


def _maybe_reexec_with_malloc_settings(argv: list[str]) -> None:
    """Re-run this process with the allocator settings (opt out: AIAYN_NO_MALLOC_TUNING=1)."""
    if os.environ.get("AIAYN_NO_MALLOC_TUNING") or not argv or argv[0] not in HEAVY_COMMANDS:
        return
    if all(os.environ.get(k) for k in MALLOC_ENV) or sys.platform != "linux":
        return
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}}
    os.execve(sys.executable, [sys.executable, "-m", "aiayn", *argv], env)


def apply_process_settings(argv: list[str], *, reexec: bool = True) -> None:
    """Set the oneDNN cache; then, if `reexec`, re-execute heavy commands with MALLOC_ENV.

    `argv` is the command line without the program name. `reexec=False` (for `main(argv)`
    called in-process, e.g. by tests) never replaces the running process.
    """
    set_onednn_cache_capacity()
    apply_isa_environment()
    if reexec:
        _maybe_reexec_with_malloc_settings(argv)
