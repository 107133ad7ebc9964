"""What aiayn picks on each CPU class (aiayn.cpu_isa, aiayn.fast.machine), checked for every
class on whatever machine runs the tests: flags and probe results are injected, and the
libraries' own ceilings (oneDNN, ATen) hold a real process to a narrower class."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from aiayn import cpu_isa
from aiayn.fast import machine
from aiayn.fast.machine import Rates

# /proc/cpuinfo flags of one CPU of each class (trimmed to the ones that decide)
FLAGS = {
    "amx": "fma avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8",
    "avx512_bf16": "fma avx2 avx512f avx512bw avx512_vnni avx512_bf16",  # Zen 4
    "avx512": "fma avx2 avx512f avx512bw avx512_vnni",  # Cascade Lake
    "avx2": "fma avx2 f16c bmi2",  # Zen 3
    "portable": "sse4_2 avx",  # no AVX2
}

#: Probe results as measured on each class (GFLOP/s; sentences/s on one thread): SPR and
#: Zen 4 from this repository's runs, AVX2 from a Zen 4 held to AVX2 (docs/performance.md).
RATES = {
    "amx": Rates(380.0, 2400.0, 150.0, 420.0, 380.0, threads=2),
    "avx512_bf16": Rates(90.0, 400.0, 124.0, 273.0, 348.0, threads=2),
    "avx512": Rates(180.0, 75.0, 130.0, 60.0, 300.0, threads=2),
    "avx2": Rates(170.0, 2.2, 168.0, 2.0, 252.0, threads=2, int8_backend="aiayn"),
    "portable": Rates(20.0, 1.0, 40.0, 2.0, 30.0, threads=2),
}


@pytest.mark.parametrize("cls", list(FLAGS))
def test_each_cpu_class_is_told_apart_by_its_flags(cls: str) -> None:
    assert cpu_isa.classify(frozenset(FLAGS[cls].split())) == cls


def test_arm_and_other_cpus_are_portable() -> None:
    assert cpu_isa.classify(frozenset({"fp", "asimd", "sve"}), "aarch64") == "portable"
    # AMX flags without the tile flag (a kernel that has not enabled tiles) are not AMX
    assert cpu_isa.classify(frozenset(FLAGS["avx512_bf16"].split()) | {"amx_bf16"}) != "amx"


def test_the_environment_caps_the_class() -> None:
    assert cpu_isa.isa_cap({}) is None
    assert cpu_isa.isa_cap({"AIAYN_CPU_ISA": "avx2"}) == "avx2"
    assert cpu_isa.isa_cap({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "avx2"
    assert cpu_isa.isa_cap({"ONEDNN_MAX_CPU_ISA": "avx512_core"}) == "avx512"
    assert cpu_isa.isa_cap({"DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == "amx"
    # ours first: it is what the user asked aiayn for
    assert cpu_isa.isa_cap({"AIAYN_CPU_ISA": "portable", "ONEDNN_MAX_CPU_ISA": "AVX2"}) == (
        "portable"
    )
    with pytest.raises(ValueError, match="AIAYN_CPU_ISA='avx3'.*avx2"):
        cpu_isa.isa_cap({"AIAYN_CPU_ISA": "avx3"})
    # a cap only narrows: an AVX2 CPU held to AVX-512 stays AVX2
    assert cpu_isa.capped("amx", "avx2") == "avx2"
    assert cpu_isa.capped("avx2", "avx512") == "avx2"
    assert cpu_isa.capped("avx512_bf16", None) == "avx512_bf16"


def test_the_class_environment_sets_every_library_and_keeps_the_users() -> None:
    env = cpu_isa.isa_environment("avx2")
    assert env["AIAYN_CPU_ISA"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["CT2_FORCE_CPU_ISA"] == "AVX2"
    mine = {"AIAYN_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default"}
    cpu_isa.apply_isa_environment(mine)
    assert mine["ONEDNN_MAX_CPU_ISA"] == "AVX2" and mine["ATEN_CPU_CAPABILITY"] == "default"
    with pytest.raises(ValueError, match="unknown CPU class"):
        cpu_isa.isa_environment("sse")


@pytest.mark.parametrize("cls", list(FLAGS))
def test_choices_for_every_class(cls: str) -> None:
    """bf16 trains where the CPU multiplies it natively; decoding takes the fastest
    precision the probe measured; the kernels' instruction set follows the class."""
    choice = machine.choose(cls, RATES[cls])
    train, decode, kernels, bits = {
        "amx": ("bf16", "bf16", "avx512", 8),
        "avx512_bf16": ("bf16", "int8", "avx512", 8),
        "avx512": ("fp32", "int8", "avx512", 8),
        "avx2": ("fp32", "int8", "avx2", 7),  # aiayn's kernel: 7-bit inputs move no signs
        "portable": ("fp32", "fp32", "portable", 8),
    }[cls]
    assert (choice.train_dtype, choice.decode_dtype, choice.kernels) == (train, decode, kernels)
    assert choice.int8_bits == bits
    assert choice.cpu_class == cls and "train" in choice.reasons
    assert json.loads(json.dumps(choice.to_dict()))["rates"]["train_fp32"] == RATES[cls].train_fp32


def test_a_lower_precision_must_gain_and_int8_must_not_have_fallen_back() -> None:
    base = RATES["avx2"]
    # int8 a little faster than fp32 is not enough to give up fp32's precision
    close = Rates(170.0, 2.2, 168.0, 2.0, 168.0 * 1.1, threads=2)
    assert machine.choose("avx2", close).decode_dtype == "fp32"
    # PyTorch's int8 product fell back to its generic loop: never int8 by default
    slow = Rates(**{**base.__dict__, "int8_fallback": True})
    choice = machine.choose("avx2", slow)
    assert choice.decode_dtype == "fp32" and "generic loop" in choice.reasons["decode_int8"]
    # a native-bf16 CPU whose probe found bf16 slower (a broken build): fp32
    odd = Rates(400.0, 300.0, 124.0, 100.0, 110.0, threads=2)
    assert machine.choose("avx512_bf16", odd).train_dtype == "fp32"
    # bf16 that would be emulated never trains by default, however the probe came out
    assert machine.choose("avx2", Rates(1.0, 5.0, 1.0, 5.0, 1.0, threads=2)).train_dtype == "fp32"


def test_auto_int8_takes_7_bit_activations_only_where_aiayns_simd_kernel_multiplies() -> None:
    """7 bits where the products run aiayn's AVX2 kernel (no VNNI: sign-free, ~1.4x);
    8 where PyTorch's VNNI products run them, on the plain-C kernel (7 bits gain nothing
    there), and where auto does not decode in int8."""
    avx2 = RATES["avx2"]
    assert machine.choose("avx2", avx2).int8_bits == 7
    assert "VNNI" in machine.choose("avx2", avx2).reasons["int8_bits"]
    no_vnni = Rates(**{**RATES["avx512"].__dict__, "int8_backend": "aiayn"})  # Skylake-SP
    assert machine.choose("avx512", no_vnni).int8_bits == 7
    assert machine.choose("avx512", RATES["avx512"]).int8_bits == 8  # VNNI: PyTorch's
    plain = Rates(20.0, 1.0, 40.0, 2.0, 300.0, threads=2, int8_backend="aiayn")
    assert machine.choose("portable", plain).decode_dtype == "int8"
    assert machine.choose("portable", plain).int8_bits == 8
    fp32 = Rates(**{**avx2.__dict__, "decode_int8": avx2.decode_fp32})
    assert machine.choose("avx2", fp32).int8_bits == 8


@pytest.fixture
def on_class(monkeypatch):  # type: ignore[no-untyped-def]
    """Make this process's machine look like a CPU of a given class with its RATES."""

    def use(cls: str) -> None:
        fake = cpu_isa.Cpu("a test CPU", frozenset(FLAGS[cls].split()), "x86_64", cls, None)
        monkeypatch.setattr(machine, "cpu", lambda: fake)
        monkeypatch.setattr(machine, "probe", lambda refresh=False: RATES[cls])
        machine.best.cache_clear()

    yield use
    machine.best.cache_clear()


@pytest.mark.parametrize("cls", ["amx", "avx2"])
def test_auto_resolves_through_the_machine_for_training_and_decoding(on_class, cls) -> None:  # type: ignore[no-untyped-def]
    from aiayn.training.precision import resolve_dtype

    on_class(cls)
    assert resolve_dtype("auto", "cpu") == ("bf16" if cls == "amx" else "fp32")
    assert resolve_dtype("fp32", "cpu") == "fp32"  # an explicit choice stands
    assert machine.resolve_decode_dtype("auto") == ("bf16" if cls == "amx" else "int8")
    assert machine.resolve_decode_dtype("fp32") == "fp32"
    line = machine.describe()
    assert f"class {cls}" in line and "a test CPU" in line and "GFLOP/s" in line


def test_an_explicit_bf16_where_it_is_emulated_says_so_with_the_factor(on_class) -> None:  # type: ignore[no-untyped-def]
    on_class("avx2")
    train = machine.slow_bf16_warning("cpu")
    assert train is not None and "77.3x faster" in train and "class avx2" in train
    assert machine.slow_dtype_warning("bf16", "train") is not None
    decode = machine.slow_dtype_warning("bf16", "decode")
    assert decode is not None and "126.0x slower in bf16 than in int8" in decode
    assert machine.slow_dtype_warning("int8", "decode") is None  # int8 is the fastest here
    on_class("amx")
    assert machine.slow_bf16_warning("cpu") is None
    assert machine.slow_bf16_warning("cuda") is None


def test_a_bf16_checkpoint_decodes_in_the_machines_precision(on_class) -> None:  # type: ignore[no-untyped-def]
    """Whatever precision the parameters are in (a model cast to bf16 on an AMX machine),
    auto gives the machine's choice: int8 layers on the AVX2 class."""
    from aiayn.config import ModelConfig
    from aiayn.fast.inference import Int8Linear
    from aiayn.model import Transformer

    on_class("avx2")
    cfg = ModelConfig(N=1, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, vocab_size=40, P_drop=0.0)
    model = Transformer(cfg).to(torch.bfloat16).eval()
    model = machine.cast_for_inference(model, "auto")
    assert isinstance(model.generator, Int8Linear)
    assert next(model.parameters()).dtype == torch.float32


def test_auto_and_explicit_int8_quantize_activations_to_their_bits(on_class, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--dtype auto` takes the machine's bits (7 on AVX2 without VNNI), an explicit int8
    8 (the same outputs on every CPU), AIAYN_INT8_ACTIVATIONS either; the FFN's second
    layer (a ReLU's input) keeps 8 in all of them."""
    from aiayn.config import ModelConfig
    from aiayn.fast.inference import Int8Linear
    from aiayn.model import Transformer

    cfg = ModelConfig(N=1, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, vocab_size=40, P_drop=0.0)

    def bits(dtype: str) -> set[int]:
        model = machine.cast_for_inference(Transformer(cfg).eval(), dtype)
        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        assert layers and not any(m._r7 for m in layers if m.nonneg_input)
        return {7 if m._r7 else 8 for m in layers if not m.nonneg_input}

    monkeypatch.delenv("AIAYN_INT8_ACTIVATIONS", raising=False)
    on_class("avx2")
    assert bits("auto") == {7} and bits("int8") == {8}
    assert "decode int8 (7-bit activations)" in machine.describe()
    monkeypatch.setenv("AIAYN_INT8_ACTIVATIONS", "8")
    assert bits("auto") == {8}
    monkeypatch.setenv("AIAYN_INT8_ACTIVATIONS", "7")
    assert bits("int8") == {7}
    monkeypatch.delenv("AIAYN_INT8_ACTIVATIONS")
    on_class("avx512_bf16")  # VNNI: PyTorch's exact products, 8 bits
    assert bits("auto") == {8}
    assert "7-bit" not in machine.describe()


def test_the_probe_is_cached_per_machine_and_a_damaged_cache_is_measured_again(
    monkeypatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    calls = []

    def measure() -> Rates:
        calls.append(1)
        return RATES["avx2"]

    monkeypatch.setattr(machine, "measure_rates", measure)
    monkeypatch.setattr(machine, "_rates", {})
    assert machine.probe() == RATES["avx2"]
    (cached,) = tmp_path.glob("machine-*.json")
    assert json.loads(cached.read_text())["rates"]["decode_int8"] == 252.0
    monkeypatch.setattr(machine, "_rates", {})  # a new process
    assert machine.probe() == RATES["avx2"] and len(calls) == 1  # read back, not measured
    cached.write_text("{not json")
    monkeypatch.setattr(machine, "_rates", {})
    assert machine.probe() == RATES["avx2"] and len(calls) == 2
    assert machine.probe(refresh=True) == RATES["avx2"] and len(calls) == 3
    monkeypatch.setattr(machine, "_rates", {})
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")  # a cache directory that cannot be made
    assert machine.probe() == RATES["avx2"]  # measured, not an error


def test_the_probe_measures_every_precision_quickly() -> None:
    """The real probe on this machine: positive rates, under a few seconds even where
    bf16 is emulated (its search is then estimated, not run)."""
    rates = machine.measure_rates()
    assert rates.seconds < 20
    for name in ("train_fp32", "train_bf16", "decode_fp32", "decode_bf16", "decode_int8"):
        assert getattr(rates, name) > 0, name
    assert rates.threads == torch.get_num_threads()


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or machine.cpu().detected == "portable",
    reason="holding a process to AVX2 needs an AVX2 x86 CPU",
)
def test_a_process_held_to_avx2_chooses_as_an_avx2_machine(tmp_path) -> None:
    """The end to end check of the class cap: `AIAYN_CPU_ISA=avx2 aiayn info` on this CPU
    sets oneDNN's and ATen's ceilings before torch starts, and the real probe then sees
    emulated bf16: training auto is fp32, the kernels are built for AVX2."""
    env = {**os.environ, "AIAYN_CPU_ISA": "avx2", "AIAYN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "aiayn", "info", "--preset", "tiny", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    m = json.loads(done.stdout)["machine"]
    assert m["cpu_class"] == "avx2" and m["kernels"] == "avx2"
    assert m["train_dtype"] == "fp32"
    assert m["rates"]["train_bf16"] < m["rates"]["train_fp32"] / 5  # emulated, measured
