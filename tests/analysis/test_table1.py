"""Table 1 (section 4) measured: the path lengths and sequential operations measured from
the computation agree with the values known for each layer, the counted FLOPs with the
closed forms, the exponent fit with synthetic data; `aiayn table1` writes its files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from aiayn.analysis import layers, paths
from aiayn.analysis.table1 import crossover, fit_exponent, large_half
from aiayn.cli.flags_analysis import KINDS
from helpers import cli

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8  # the path lengths do not depend on the width: small and quick


def stack(kind: str, n: int, *, k: int = 3, r: int = 5, dilated: bool = False) -> int | None:
    def make(i: int) -> nn.Module:
        return layers.build(kind, D, h=2, k=k, r=r, dilation=k**i if dilated else 1)

    return paths.stacked_path_length(make, n, D, max_layers=n + 1)


# --------------------------------------------------------------------------- path length
def test_self_attention_connects_every_pair_in_one_layer() -> None:
    """Table 1, row 1: maximum path length O(1), i.e. 1."""
    assert stack("self-attention", 16) == 1
    assert stack("self-attention", 64) == 1


@pytest.mark.parametrize("kind", ["convolutional", "separable"])
@pytest.mark.parametrize(("k", "n"), [(3, 16), (3, 17), (5, 16), (2, 9)])
def test_contiguous_convolutions_need_ceil_n_minus_1_over_k_minus_1_layers(
    kind: str, k: int, n: int
) -> None:
    """Section 4: a stack of contiguous kernel-k convolutions, each reaching k-1 positions
    back (causal), connects position 1 to position n after ceil((n-1)/(k-1)) layers."""
    assert stack(kind, n, k=k) == math.ceil((n - 1) / (k - 1))


@pytest.mark.parametrize(("k", "n", "expected"), [(3, 16, 3), (3, 9, 2), (3, 10, 3), (2, 16, 4)])
def test_dilated_convolutions_need_ceil_log_k_n_layers(k: int, n: int, expected: int) -> None:
    """Table 1, row 3: O(log_k n) with dilations k^l: after L layers the receptive field
    reaches k^L - 1 positions back, so L = ceil(log_k n) (k^L >= n)."""
    assert expected == math.ceil(math.log(n, k) - 1e-9)
    assert stack("convolutional", n, k=k, dilated=True) == expected
    assert stack("separable", n, k=k, dilated=True) == expected


@pytest.mark.parametrize(("r", "n"), [(3, 16), (5, 16), (9, 16), (9, 64)])
def test_restricted_attention_needs_ceil_n_over_half_r_layers(r: int, n: int) -> None:
    """Table 1, row 4: O(n/r); with r positions centred on each query, each layer reaches
    (r-1)/2 further, so ceil((n-1) / ((r-1)/2)) layers."""
    assert stack("restricted", n, r=r) == math.ceil((n - 1) / ((r - 1) // 2))


@pytest.mark.parametrize("n", [1, 2, 16, 33])
def test_the_recurrent_path_runs_through_every_step(n: int) -> None:
    """Table 1, row 2: O(n). One LSTM layer connects input 1 to output n, through the
    states of steps 1..n-1: detaching any of them cuts the dependency."""
    assert stack("recurrent", n) == 1
    rnn = layers.build("recurrent", D, h=2, k=3, r=5)
    assert isinstance(rnn, layers.Recurrent)
    assert paths.recurrent_path_length(rnn, n) == n


def test_a_position_wise_layer_never_connects_two_positions() -> None:
    """Negative control: a layer that does not mix positions gives no path at all."""
    assert paths.stacked_path_length(lambda i: nn.Linear(D, D), 8, D, max_layers=5) is None
    assert paths.stacked_path_length(lambda i: nn.Linear(D, D), 1, D, max_layers=5) == 1


# --------------------------------------------------------------------------- the layers
def test_the_unrolled_lstm_is_pytorchs_lstm() -> None:
    """The LSTM's FLOPs and sequential ops are counted on `unrolled`: the same function."""
    rnn = layers.build("recurrent", 16, h=2, k=3, r=5)
    x = torch.randn(3, 11, 16)
    torch.testing.assert_close(rnn.unrolled(x), rnn(x), atol=1e-6, rtol=1e-5)


def test_windowed_restricted_attention_is_banded_self_attention() -> None:
    """The O(r n d) windows compute what a banded mask on the full O(n^2 d) layer does."""
    torch.manual_seed(0)
    restricted = layers.build("restricted", 16, h=4, k=3, r=5)
    full = layers.SelfAttention(16, 4)
    full.load_state_dict(restricted.state_dict())
    x = torch.randn(2, 13, 16)
    torch.testing.assert_close(restricted(x), full(x, mask=layers.banded_mask(13, 5)))
    assert not torch.allclose(restricted(x), full(x))


@pytest.mark.parametrize(("n", "d"), [(12, 16), (40, 32)])
def test_self_attention_flops_are_4nd2_plus_2n2d_multiply_adds(n: int, d: int) -> None:
    """Counted forward: Q, K, V and output projections 4 n d^2, Q K^T n^2 d and
    weights x V n^2 d multiply-adds (2 FLOPs each); softmax and scaling not counted."""
    layer = layers.build("self-attention", d, h=4, k=3, r=5)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, n, d))
    assert counter.get_total_flops() == 2 * (4 * n * d * d + 2 * n * n * d)


@pytest.mark.parametrize("kind", layers.KINDS)
def test_every_kind_counts_the_multiply_adds_of_its_formula(kind: str) -> None:
    layer = layers.build(kind, 16, h=4, k=3, r=5)
    with FlopCounterMode(display=False) as counter:
        layer.unrolled(torch.randn(1, 20, 16))
    assert counter.get_total_flops() == 2 * layers.forward_macs(kind, 20, 16, k=3, r=5)


def test_sequential_ops_are_constant_but_for_the_recurrent_layer() -> None:
    """Table 1's sequential operations: O(1) for attention and convolutions, O(n) for the
    recurrence, as the longest chain of dependent ops each runs."""
    for kind in layers.KINDS:
        layer = layers.build(kind, D, h=2, k=3, r=5)
        ops = [paths.dependent_ops(layer, n, D) for n in (8, 16, 32)]
        if kind == "recurrent":
            assert ops[1] - ops[0] > 0
            assert (ops[2] - ops[1]) == 2 * (ops[1] - ops[0])  # a fixed number per step
        else:
            assert ops[0] == ops[1] == ops[2] > 0


def test_the_dependent_op_counter_sees_a_chain() -> None:
    """Negative control: n sequential matrix products are n dependent ops; n independent
    ones, stacked and summed, three."""

    class Chain(layers.Table1Layer):
        def __init__(self, steps: int, sequential: bool) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(D, D))
            self.steps, self.sequential = steps, sequential

        def forward(self, x: Tensor) -> Tensor:
            if self.sequential:
                for _ in range(self.steps):
                    x = x @ self.w
                return x
            return torch.stack([x @ self.w for _ in range(self.steps)]).sum(0)

    assert paths.dependent_ops(Chain(7, True), 4, D) == 7
    assert paths.dependent_ops(Chain(7, False), 4, D) == 3  # mm, stack, sum


# --------------------------------------------------------------------------- fitting
def test_fit_exponent_recovers_the_power_of_synthetic_data() -> None:
    ns = [2**i for i in range(4, 13)]
    assert fit_exponent(ns, [3.0 * n**2 for n in ns]) == pytest.approx(2.0)
    assert fit_exponent(ns, [0.5 * n for n in ns]) == pytest.approx(1.0)
    # n^2 d + n d^2 with d = 64: the large-n half is near 2, the whole range is not
    mixed = [n * n * 64 + n * 64 * 64 * 8 for n in ns]
    half = large_half(ns)
    assert ns[half] == [256, 512, 1024, 2048, 4096]
    assert fit_exponent(ns[half], mixed[half]) > fit_exponent(ns, mixed) + 0.2
    # noise of +-5% moves the exponent by little
    wobble = [1.05, 0.95, 1.0, 1.05, 0.95, 1.0, 1.05, 0.95, 1.0]
    noisy = [n**1.5 * w for n, w in zip(ns, wobble, strict=True)]
    assert fit_exponent(ns, noisy) == pytest.approx(1.5, abs=0.02)
    with pytest.raises(ValueError):
        fit_exponent([16], [1.0])


def test_crossover_interpolates_where_one_line_overtakes_the_other() -> None:
    ns = [16, 32, 64, 128, 256]
    attention = [n * n * 1.0 for n in ns]
    rnn = [n * 100.0 for n in ns]  # crossing at n = 100
    assert crossover(ns, attention, rnn) == pytest.approx(100.0)
    assert crossover(ns, rnn, attention) is None
    assert crossover(ns, [2.0 * n for n in ns], [1.0 * n for n in ns]) == 16.0


# --------------------------------------------------------------------------- the command
def test_the_parser_lists_the_same_kinds_as_the_library() -> None:
    assert tuple(KINDS.split(",")) == layers.KINDS


def test_table1_on_a_tiny_grid_writes_its_table_csv_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "t1"
    code, stdout, err = cli(
        *("table1", "--d", "16", "--heads", "2", "--n-min", "8", "--n-max", "32"),
        *("--repeats", "1", "--warmup", "0", "--path-n", "8", "--no-progress", "--out", out),
    )
    assert code == 0, err
    assert "| Self-Attention | O(n^2 d) | time n^" in stdout
    assert "| Recurrent (LSTM) | O(n d^2) |" in stdout and "8 steps within 1 layer" in stdout
    assert "2 layers dilated, 4 contiguous" in stdout  # k=3, n=8
    rows = list(csv.DictReader((out / "table1.csv").open(encoding="utf-8")))
    assert len(rows) == 5 * 3
    assert {r["kind"] for r in rows} == set(layers.KINDS)
    for r in rows:
        assert float(r["seconds"]) > 0 and int(r["flops"]) > int(r["flops_forward"]) > 0
    sa = [r for r in rows if r["kind"] == "self-attention"]
    assert [int(r["flops_forward"]) for r in sa] == [
        2 * (4 * n * 16 * 16 + 2 * n * n * 16) for n in (8, 16, 32)
    ]
    report = json.loads((out / "table1.json").read_text(encoding="utf-8"))
    assert report["path"]["restricted"]["layers"] == 2  # r=9: 4 each way; n=8
    assert_png(out / "table1.png")


def test_table1_json_prints_the_numbers(tmp_path: Path) -> None:
    code, stdout, err = cli(
        *("table1", "--d", "8", "--heads", "2", "--n-min", "4", "--n-max", "8"),
        *("--repeats", "1", "--path-n", "4", "--kinds", "self-attention,recurrent"),
        *("--json", "--no-progress", "--out", tmp_path),
    )
    assert code == 0, err
    report = json.loads(stdout)
    assert [r["kind"] for r in report["rows"]] == ["self-attention", "recurrent"] * 2
    assert report["path"]["self-attention"]["layers"] == 1
    assert report["sequential"]["recurrent"]["per_position"] > 0
    assert str(tmp_path / "table1.png") in report["files"]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [(["--r", "4"], "odd"), (["--kinds", "lstm"], "lstm"), (["--d", "10"], "divide")],
)
def test_table1_refuses_bad_settings_before_any_work(
    tmp_path: Path, flags: list[str], fragment: str
) -> None:
    code, _, err = cli("table1", *flags, "--out", tmp_path / "x")
    assert code == 2 and fragment in err, err
    assert not (tmp_path / "x").exists()


def assert_png(path: Path) -> None:
    """A PNG file that an image reader decodes into a picture of some size."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50
