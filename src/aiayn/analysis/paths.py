"""Table 1's two structural columns, measured from the computation itself rather than read
off the architecture: the maximum path length (from gradients) and the sequential
operations (from the ops PyTorch actually runs).

- Maximum path length: the fewest stacked layers after which output position n depends
  on input position 1, i.e. after which d out[n] / d in[1] is non-zero. Masked-out and
  out-of-kernel connections give exact zeros (exp(-inf) = 0; no product at all), so the
  test is exact; float64 and random weights keep real dependencies away from zero.
  The derivative is carried forward from input 1 (forward-mode AD: (d out / d in[1]) v
  for a random v, non-zero exactly where the Jacobian block is, almost surely).
  A recurrent layer connects them within one layer, through a chain of n cell steps:
  its path is measured as the number of steps that every dependency of output n on
  input 1 passes through (a step whose state, detached, cuts the dependency), plus one.
- Sequential operations: the longest chain of dependent ops dispatched while the layer
  runs forward (each op one level deeper than its deepest input; views are free).
  A constant in n is O(1); a chain that grows by a fixed number of ops per position
  is O(n).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from aiayn.analysis.layers import Recurrent, Table1Layer, build


@contextlib.contextmanager
def _forward_ad() -> Iterator[None]:
    """Forward-mode AD, without gradients recorded. Its first use makes PyTorch script
    its own jvp decompositions (torch._decomp.decompositions_for_jvp), which warns that
    torch.jit.script is deprecated: PyTorch's affair, not silenced anywhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
        with fwAD.dual_level(), torch.no_grad():
            yield


def _dual_input(n: int, d: int, seed: int) -> Tensor:
    """(1, n, d) float64 random input, dual with a random tangent at position 1 only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d, dtype=torch.float64, generator=g)
    tangent = torch.zeros_like(x)
    tangent[:, 0] = torch.randn(d, dtype=torch.float64, generator=g)
    return fwAD.make_dual(x, tangent)


def depends(y: Tensor, n: int) -> bool:
    """Whether output position n (1-based) of the dual y (1, n', d) depends on input
    position 1: the tangent there, (d out[n] / d in[1]) v, has a non-zero entry."""
    tangent = fwAD.unpack_dual(y).tangent
    return tangent is not None and bool(tangent[:, n - 1].ne(0).any())


def stacked_path_length(
    make_layer: Callable[[int], nn.Module], n: int, d: int, max_layers: int, seed: int = 0
) -> int | None:
    """The fewest layers, stacked, after which output n depends on input 1.

    The derivative is carried forward (forward-mode AD from input 1), so each layer runs
    once however deep the stack: O(layers), not the O(layers^2) of a backward pass from
    the top after each layer added.

    Args:
        make_layer: layer l (0-based) of the stack, e.g. a dilated convolution's dilation
            k^l; run in float64.
        n: the sequence length; d: the width.
        max_layers: give up after this many.
    Returns:
        The number of layers, or None if max_layers were not enough.
    """
    # the layers' random weights from `seed`, the caller's random state left as it was
    with torch.random.fork_rng(devices=[]), _forward_ad():
        torch.manual_seed(seed)
        y = _dual_input(n, d, seed)
        for layers in range(1, max_layers + 1):
            y = make_layer(layers - 1).double()(y)
            if depends(y, n):
                return layers
    return None


def recurrent_path_length(layer: Recurrent, n: int, seed: int = 0) -> int | None:
    """The number of cell steps on every path from input 1 to output n of one recurrent
    layer: 1 + the steps s (1..n-1) whose state, detached, makes output n independent of
    input 1. None if output n does not depend on input 1 at all."""
    layer = copy.deepcopy(layer).double()  # the caller's layer stays as it was
    with _forward_ad():
        x = _dual_input(n, layer.lstm.input_size, seed)
        if not depends(layer.unrolled(x), n):
            return None
        cuts = sum(not depends(layer.unrolled(x, cut=s), n) for s in range(n - 1))
    return cuts + 1


#: Ops that only relabel memory, as views do, without being marked as views.
_NO_WORK = (torch.ops.aten.detach, torch.ops.aten._unsafe_view)


class _DependentOps(TorchDispatchMode):
    """Each tensor an op makes is one level deeper than the deepest tensor it read (views,
    detach, _unsafe_view: as deep); inputs and parameters are level 0. `depth` is the
    deepest."""

    def __init__(self) -> None:
        super().__init__()
        self.level: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.depth = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        free = func.is_view or func.overloadpacket in _NO_WORK
        level = max((self.level.get(t, 0) for t in read), default=0) + (0 if free else 1)
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                self.level[t] = level
        self.depth = max(self.depth, level)
        return out


def dependent_ops(layer: Table1Layer, n: int, d: int) -> int:
    """The longest chain of dependent ops in the layer's forward (`unrolled`) on (1, n, d)."""
    x = torch.randn(1, n, d, dtype=next(layer.parameters()).dtype)
    with torch.no_grad(), _DependentOps() as mode:
        layer.unrolled(x)
    return mode.depth


def measure_structure(
    kinds: Sequence[str], d: int, *, h: int, k: int, r: int, n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Table 1's structural columns for each kind: the dependent ops of one layer's forward
    at n/4, n/2 and n (with the growth per position), and the maximum path length at n
    (stacked layers; for the convolutions also a dilated stack, dilation k^l in layer l;
    for the recurrent layer the steps within it), on freshly built layers."""
    sequential, path = {}, {}
    for kind in kinds:
        layer = build(kind, d, h=h, k=k, r=r)
        ns = [max(1, n // 4), max(1, n // 2), n]
        ops = [dependent_ops(layer, m, d) for m in ns]
        slope = (ops[-1] - ops[0]) / (ns[-1] - ns[0]) if ns[-1] > ns[0] else 0.0
        sequential[kind] = {"n": ns, "ops": ops, "per_position": slope}
        if isinstance(layer, Recurrent):
            path[kind] = {"n": n, "layers": 1, "steps": recurrent_path_length(layer, n)}
            continue

        def make(i: int, kind: str = kind, dilated: bool = False) -> Table1Layer:
            return build(kind, d, h=h, k=k, r=r, dilation=k**i if dilated else 1)

        path[kind] = {"n": n, "layers": stacked_path_length(make, n, d, n + 1)}
        if kind in ("convolutional", "separable"):
            dilated = functools.partial(make, kind=kind, dilated=True)
            path[kind]["dilated_layers"] = stacked_path_length(dilated, n, d, n + 1)
    return sequential, path
