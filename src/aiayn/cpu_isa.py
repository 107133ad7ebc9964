"""The CPU classes aiayn tells apart and the environment that holds a process to one, without
importing torch: the `aiayn` command applies `AIAYN_CPU_ISA` before torch starts, since
oneDNN, ATen and MKL read their instruction-set ceilings once. What is fast on each class
is measured and decided in `aiayn.fast.machine`.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

#: The CPU classes aiayn tells apart, best first, with what each has and examples.
CPU_CLASSES: dict[str, str] = {
    "amx": "AMX bf16 tiles (Intel Sapphire Rapids and later Xeons)",
    "avx512_bf16": "AVX-512 BF16, no AMX (AMD Zen 4 and later, Intel Cooper Lake)",
    "avx512": "AVX-512 without BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake)",
    "avx2": "AVX2 and FMA, no AVX-512 (AMD Zen 2/3, Intel client chips, Haswell-Broadwell Xeons)",
    "portable": "no AVX2 (older x86, ARM and other CPUs): portable C and PyTorch's kernels",
}
#: Classes whose CPU multiplies bf16 natively.
NATIVE_BF16 = ("amx", "avx512_bf16")

#: The environment variable that caps the class (and the compiled kernels' instruction set).
ISA_VARIABLE = "AIAYN_CPU_ISA"

#: oneDNN's names for its instruction-set ceilings -> our class (ONEDNN_MAX_CPU_ISA).
_ONEDNN_ISA = {
    "SSE41": "portable",
    "AVX": "portable",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512",
    "AVX512_CORE_VNNI": "avx512",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX10_1_512": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
    "AVX512_CORE_AMX": "amx",
    "AVX10_1_512_AMX": "amx",
    "AVX512_CORE_AMX_FP16": "amx",
    "AVX10_1_512_AMX_FP16": "amx",
    "ALL": "amx",
}

#: What holds each library to a class: oneDNN, ATen's vectorised kernels, MKL, CTranslate2.
_ISA_ENV: dict[str, dict[str, str]] = {
    "portable": {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "CT2_FORCE_CPU_ISA": "GENERIC",
    },
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
    },
    "avx512": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "CT2_FORCE_CPU_ISA": "AVX512",
    },
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "CT2_FORCE_CPU_ISA": "AVX512"},
    "amx": {},
}


def classify(flags: frozenset[str] | set[str], arch: str = "x86_64") -> str:
    """The class of a CPU with these /proc/cpuinfo flags (`CPU_CLASSES`)."""
    if arch not in ("x86_64", "AMD64", "i686", "i386"):
        return "portable"
    if "amx_bf16" in flags and "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "portable"


def isa_cap(env: Mapping[str, str] | None = None) -> str | None:
    """The class the environment holds the process to, or None: `AIAYN_CPU_ISA` (a class
    name) first, else oneDNN's `ONEDNN_MAX_CPU_ISA` (which PyTorch's oneDNN obeys: held to
    AVX2, it has no native bf16)."""
    env = os.environ if env is None else env
    ours = env.get(ISA_VARIABLE, "").strip().lower()
    if ours:
        if ours not in CPU_CLASSES:
            raise ValueError(f"{ISA_VARIABLE}={ours!r}: expected one of {', '.join(CPU_CLASSES)}")
        return ours
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip()
    return _ONEDNN_ISA.get(onednn.upper()) if onednn else None


def capped(cls: str, cap: str | None) -> str:
    """`cls` held to at most `cap` (the classes are ordered, best first)."""
    if cap is None:
        return cls
    order = list(CPU_CLASSES)
    return order[max(order.index(cls), order.index(cap))]


def isa_environment(cls: str) -> dict[str, str]:
    """The environment that holds PyTorch (oneDNN, ATen, MKL), CTranslate2 and aiayn's
    compiled kernels to class `cls`, so that a bigger CPU runs what a `cls` CPU runs: set
    it before the process starts (the libraries read it once). On an AVX-512 CPU,
    `isa_environment("avx2")` gives AVX2's kernels everywhere and no native bf16."""
    if cls not in CPU_CLASSES:
        raise ValueError(f"unknown CPU class {cls!r}: one of {', '.join(CPU_CLASSES)}")
    return {ISA_VARIABLE: cls, **_ISA_ENV[cls]}


def apply_isa_environment(env: MutableMapping[str, str] | None = None) -> None:
    """Where `AIAYN_CPU_ISA` is set, set the libraries' own variables to match (those the
    user set stay): the `aiayn` command does this first thing, before torch starts."""
    env = os.environ if env is None else env
    cls = env.get(ISA_VARIABLE, "").strip().lower()
    if cls in CPU_CLASSES:
        for k, v in _ISA_ENV[cls].items():
            env.setdefault(k, v)


@dataclass(frozen=True)
class Cpu:
    """The CPU as read from /proc/cpuinfo: its model name, flags and class (capped)."""

    model: str
    flags: frozenset[str]
    arch: str
    detected: str  # the class of its flags
    cap: str | None  # the environment's ceiling (`isa_cap`)

    @property
    def cls(self) -> str:
        return capped(self.detected, self.cap)

    def has_vnni(self) -> bool:
        """int8 dot products in one instruction (AVX-512 VNNI or AVX-VNNI)."""
        return self.cls in ("amx", "avx512_bf16", "avx512") and bool(
            {"avx512_vnni", "avx_vnni"} & self.flags
        )


def _read_cpuinfo() -> tuple[str, str]:
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.strip()
            if model and flags:
                break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


@functools.cache
def cpu() -> Cpu:
    """This machine's CPU (read once per process)."""
    model, flags = _read_cpuinfo()
    fs = frozenset(flags.split())
    arch = platform.machine()
    return Cpu(model, fs, arch, classify(fs, arch), isa_cap())


def kernel_isa(cls: str) -> str:
    """The instruction set aiayn's C kernels are built for on a class-`cls` CPU."""
    return {"amx": "avx512", "avx512_bf16": "avx512", "avx512": "avx512"}.get(cls, cls)
