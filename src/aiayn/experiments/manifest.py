"""The machine and software a run ran on, recorded in its results.json."""

from __future__ import annotations

import logging
import os
import platform
import re
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def environment() -> dict[str, Any]:
    """Library versions and machine, for the manifest."""
    versions: dict[str, str | None] = {}
    for name in ("aiayn", "torch", "sentencepiece", "sacrebleu", "sacremoses", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    machine: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        **cpu_kernels(),
    }
    if torch.cuda.is_available():
        machine["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    return {"versions": versions, "machine": machine}


def cpu_kernels() -> dict[str, Any]:
    """Which vector units PyTorch and oneDNN use on this CPU.

    They choose oneDNN's kernels, and so how a bf16 run's sums round: the same seed
    reproduced bit for bit on Sapphire Rapids VMs (AMX) and gave another run, a few tenths
    of BLEU apart (inside the seeds' spread), on an AVX-512 BF16 CPU without AMX
    (measured: docs/results.md).
    """
    from aiayn.fast import machine

    c = machine.cpu()
    choice = machine.best()
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in c.flags and c.cls in machine.NATIVE_BF16,
        "amx_bf16": "amx_bf16" in c.flags and c.cls == "amx",
        # what aiayn.fast.machine chose here, and the probe it chose from
        "cpu_class": c.cls,
        "cpu_class_held_by_environment": c.cap is not None,
        "auto_train_dtype": choice.train_dtype,
        "auto_decode_dtype": choice.decode_dtype,
        "auto_int8_bits": choice.int8_bits,
        "kernels_isa": choice.kernels,
        "probe": None if choice.rates is None else asdict(choice.rates),
    }


def _cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor()


def machine_name(device: str = "cpu") -> str:
    """The machine a run ran on, in a few words, for tables that put runs from several
    machines side by side: the GPU's name, or the CPU's model with the bf16 units that
    decide how its bf16 sums round (`cpu_kernels`), e.g. "AMD EPYC 9R14, AVX-512 BF16"."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    name = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b|@.*$|\d+-Core", "", _cpu_name())
    name = " ".join(name.split()) or "CPU"
    from aiayn.fast import machine

    units = {"amx": "AMX", "avx512_bf16": "AVX-512 BF16", "avx2": "AVX2 only"}.get(
        machine.cpu().cls, ""
    )
    return f"{name}, {units}" if units else name


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none, e.g. macOS)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# --------------------------------------------------------------------------- ensemble members
