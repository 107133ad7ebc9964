"""Mixed precision: the compute dtype a run's `train.dtype` means on a device, autocast to
it, and dynamic loss scaling for float16.

The paper trained on P100s, which have no bfloat16: float16 there needs loss scaling,
because float16 (5 exponent bits) flushes gradients below ~6e-8 to zero and overflows
above 65504. `torch.amp.GradScaler` does it with PyTorch's defaults, kept here as they
are: the loss is multiplied by a scale S before backward (S starts at 2^16); a step
whose gradients hold an inf or NaN is skipped (Adam does not run) and S halves; after
2,000 clean steps in a row S doubles. The master weights and Adam's moments stay
float32 (autocast only changes the dtype of the products), and the gradients are
unscaled (divided by S) before clipping, so clip_norm and the logged gnorm mean what
they mean in float32.

bfloat16 has float32's exponent range and needs no scaling; its scaler is disabled
(a no-op whose state is empty).
"""

from __future__ import annotations

from typing import Any

import torch

from aiayn import speed

#: What `train.dtype` may say; "auto" is resolved per device by `resolve_dtype`.
TRAIN_DTYPES = ("fp32", "bf16", "fp16", "auto")
#: The autocast dtype of each mixed-precision mode (fp32 runs without autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Below this loss scale, repeated overflows are a loss that diverged, not a scale too
#: large: 1e-4 is fairseq's --min-loss-scale. From 2^16, 30 overflows in a row (with no
#: 2,000 clean steps between to double it back) reach it.
MIN_LOSS_SCALE = 1e-4


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """The dtype a run computes in: "auto" becomes bf16 on a GPU that supports it
    natively, fp16 on an older CUDA GPU (P100, V100, T4: bf16 there would be emulated);
    on the CPU what this machine trains fastest in (`aiayn.fast.machine.best`, through
    `aiayn.speed`: bf16 where the CPU multiplies it natively, AMX or AVX-512 BF16, and
    the probe confirms it; fp32 where bf16 would be emulated, AVX2-only CPUs among them;
    fp32 without the speed paths); fp32 on any other device.
    Any other value stands as it is."""
    if dtype != "auto":
        return dtype
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native_bf16 else "fp16"
    if device.type == "cpu":
        choice = speed.machine_choice()
        return "fp32" if choice is None else choice.train_dtype
    return "fp32"


def autocast(device: torch.device, dtype: str) -> Any:
    """Autocast to the run's 16-bit dtype (fp32 master weights), or nothing for fp32.
    `dtype` may be "auto" (`resolve_dtype`)."""
    compute = AUTOCAST_DTYPES.get(resolve_dtype(dtype, device))
    return torch.autocast(device.type, dtype=compute or torch.float32, enabled=compute is not None)


def make_scaler(dtype: str, device: torch.device) -> torch.amp.GradScaler:
    """PyTorch's dynamic loss scaler for fp16 (defaults: init scale 2^16, growth x2 after
    2,000 clean steps, backoff x0.5 on an overflow); disabled (a no-op) otherwise. `dtype`
    may be "auto"."""
    return torch.amp.GradScaler(device.type, enabled=resolve_dtype(dtype, device) == "fp16")
