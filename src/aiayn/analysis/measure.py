"""Measuring one layer of Table 1 at one n: time of forward + backward, FLOPs counted by
PyTorch, and peak memory (`aiayn.analysis.table1` runs these over the grid)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from aiayn.analysis.layers import Table1Layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(layer: Table1Layer, x: Tensor, grad: Tensor) -> None:
    """Forward and backward: the gradients of the input and of every parameter."""
    out = layer(x)
    torch.autograd.grad(out, [x, *layer.parameters()], grad)


def time_step(
    layer: Table1Layer, x: Tensor, grad: Tensor, repeats: int, warmup: int
) -> list[float]:
    """Wall seconds of each of `repeats` forward + backward passes, after `warmup` ones."""
    for _ in range(warmup):
        _step(layer, x, grad)
    times = []
    for _ in range(repeats):
        _sync(x.device)
        start = time.perf_counter()
        _step(layer, x, grad)
        _sync(x.device)
        times.append(time.perf_counter() - start)
    return times


def count_flops(layer: Table1Layer, x: Tensor, grad: Tensor) -> tuple[int, int]:
    """FLOPs PyTorch counts (matrix products and convolutions, 2 a multiply-add) forward,
    and forward + backward, on the unrolled layer (the fused LSTM is opaque to it)."""
    with FlopCounterMode(display=False) as counter:
        out = layer.unrolled(x)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(out, [x, *layer.parameters()], grad)
    return forward, forward + counter.get_total_flops()


def peak_memory(layer: Table1Layer, x: Tensor, grad: Tensor) -> int:
    """CUDA: the peak bytes allocated during forward + backward above those before.
    CPU (no allocator statistics): the bytes of the tensors autograd saves for the
    backward pass, parameters excluded, each storage once: the activation memory that
    grows with n."""
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        base = torch.cuda.memory_allocated(x.device)
        _step(layer, x, grad)
        torch.cuda.synchronize(x.device)
        return int(torch.cuda.max_memory_allocated(x.device) - base)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


def machine(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model, cores and torch threads."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{name or 'CPU'}, {os.cpu_count()} cores, {threads} torch thread{'s' * (threads > 1)}"
