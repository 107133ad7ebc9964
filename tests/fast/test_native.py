"""The compiled beam step (native.lse_topk) against PyTorch in float64, and its fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch

from aiayn.decoding import search
from aiayn.decoding.search import NEVER_GENERATED
from aiayn.fast import native
from aiayn.model import MultiHeadAttention

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

#: float32's unit roundoff: every float32 operation's relative rounding error is at most this.
U32 = 2.0**-24
#: The probabilistic bound's lambda (Higham & Mary 2019, "A new approach to probabilistic
#: rounding error analysis", Thm. 2.4): a sum of n terms rounded in any order is within
#: LAMBDA * sqrt(n) * u * sum|terms| of the exact sum, but with probability below
#: 2 exp(-LAMBDA^2 / 2) = 3e-8 per sum. The worst-case bound n * u * sum|terms| is sqrt(n)
#: times looser; either is a property of float32 arithmetic, not of one CPU's kernels.
LAMBDA = 6.0


def sum_bound(n: int | torch.Tensor) -> float | torch.Tensor:
    """Relative error bound (against sum|terms|) of an n-term float32 sum, any order."""
    return LAMBDA * (n**0.5) * U32


def log_p_bound(x: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How far float32 may put log P = (x - m) - log(sum_i exp(x_i - m)) from the exact
    `want` (R, k), for the (R, V) logits x: the sum's rounding (V positive terms:
    `sum_bound(V)` relative, any order, whatever the kernel's lanes), each exponential's
    (Cephes expf: 2u), and the log's, the subtraction's and the maximum's (u each, relative
    to |log P| and to the row maximum)."""
    row_max = x.double().amax(dim=1, keepdim=True).abs()
    return sum_bound(x.size(1)) + 4 * U32 + 2 * U32 * (want.abs() + row_max)


def assert_log_p(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, times: int = 1) -> None:
    """got within `times` x `log_p_bound` of want (2: two float32 results, each within it)."""
    err = (got.double() - want.double()).abs()
    bound = times * log_p_bound(x, want.double())
    assert (err <= bound).all(), f"{(err - bound).max():.3g} over the bound"


def _isas() -> list[str]:
    """The kernels' instruction sets this CPU runs: its own class's and every narrower one
    (an AVX-512 CPU checks the AVX2 and portable builds too)."""
    from aiayn.cpu_isa import cpu, kernel_isa

    order = ["avx512", "avx2", "portable"]
    own = kernel_isa(cpu().detected)
    return order[order.index(own) :] if own in order else ["portable"]


@pytest.fixture(params=_isas())
def every_isa(request, monkeypatch):  # type: ignore[no-untyped-def]
    """The kernels built for each instruction set this CPU runs (`native.library_for`)."""
    lib = native.library_for(request.param)
    assert lib is not None
    monkeypatch.setattr(native, "library", lambda: lib)
    return request.param


on_every_isa = pytest.mark.usefixtures("every_isa")


@pytest.fixture(scope="module", autouse=True)
def _own_cache_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Build into a directory of this module's own: neither a stale nor an unwritable
    user cache can decide these tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("AIAYN_CACHE_DIR", str(tmp_path_factory.mktemp("native-cache")))
    native.clear_cache()
    yield
    mp.undo()
    native.clear_cache()


def reference(
    x: torch.Tensor, k: int, exclude: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, in float64: logit - logsumexp(all logits) for the k best logits
    outside `exclude`."""
    x64 = x.double()
    lse = torch.logsumexp(x64, dim=1, keepdim=True)
    masked = x64.clone()
    masked[:, list(exclude)] = float("-inf")
    top, idx = masked.topk(k, dim=1)
    return top - lse, idx


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,k", [((37, 10_000), 4), ((5, 8_000), 10), ((64, 1_000), 1), ((3, 70), 5), ((2, 9), 3)]
)
def test_matches_the_definition(dtype: torch.dtype, shape: tuple[int, int], k: int) -> None:
    g = torch.Generator().manual_seed(sum(shape) + k)
    # a spread like a trained model's logits: a few large values over a broad tail
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    exclude = (0, 2)
    got = native.lse_topk(x, k, exclude)
    assert got is not None
    val, idx = got
    want_val, _ = reference(x, k, exclude)
    assert val.dtype == torch.float32 and idx.dtype == torch.int64
    assert_log_p(val, want_val, x)
    # the columns hold those values (bf16 tables have ties, so compare values, not columns)
    picked = x.double().gather(1, idx) - torch.logsumexp(x.double(), 1, keepdim=True)
    torch.testing.assert_close(picked, want_val, atol=0, rtol=0)
    assert not torch.isin(idx, torch.tensor(exclude)).any()
    assert (val[:, :-1] >= val[:, 1:]).all()  # best first


@needs_cc
@on_every_isa
def test_same_columns_as_topk_without_ties_and_lowest_column_among_ties() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3_000, generator=g)  # float32: no ties
    val, idx = native.lse_topk(x, 6, ())  # type: ignore[misc]
    assert torch.equal(idx, x.topk(6, dim=1).indices)
    ties = torch.zeros(2, 200)
    ties[:, [7, 100, 150]] = 1.0
    _, idx = native.lse_topk(ties, 4, ())  # type: ignore[misc]
    assert idx.tolist() == [[7, 100, 150, 0]] * 2


@needs_cc
@on_every_isa
def test_excluded_columns_count_in_the_normaliser_only() -> None:
    x = torch.full((1, 100), -5.0)
    x[0, 0] = 10.0  # never chosen, yet most of the probability mass
    x[0, 42] = 3.0
    val, idx = native.lse_topk(x, 1, (0,))  # type: ignore[misc]
    assert idx.item() == 42
    assert val.item() == pytest.approx(3.0 - torch.logsumexp(x.double(), 1).item(), abs=1e-6)


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch_or_the_thread_split(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(200, 5_000, generator=g) * 3).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # rows split between two threads
        both = native.lse_topk(x, 4, (0, 2))
        torch.set_num_threads(1)
        one = native.lse_topk(x, 4, (0, 2))
        alone = [native.lse_topk(x[i : i + 1], 4, (0, 2)) for i in (0, 99, 100, 199)]
    finally:
        torch.set_num_threads(threads)
    assert both is not None and one is not None
    assert torch.equal(both[0], one[0]) and torch.equal(both[1], one[1])
    for i, row in zip((0, 99, 100, 199), alone, strict=True):
        assert row is not None
        assert torch.equal(row[0][0], one[0][i]) and torch.equal(row[1][0], one[1][i])


@needs_cc
@on_every_isa
def test_strided_rows() -> None:
    """A (R, V) view of a wider table (row stride > V), as a slice of logits would be."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(8, 700, generator=g)
    x = wide[:, :600]
    val, idx = native.lse_topk(x, 3, ())  # type: ignore[misc]
    want_val, want_idx = reference(x.contiguous(), 3, ())
    assert_log_p(val, want_val, x)
    assert torch.equal(idx, want_idx)


def test_does_not_apply_where_the_c_code_cannot() -> None:
    x = torch.randn(4, 100)
    assert native.lse_topk(x.t(), 2, ()) is None  # columns not contiguous
    assert native.lse_topk(x.half(), 2, ()) is None  # float16
    assert native.lse_topk(x[:, :3], 2, (0, 1)) is None  # fewer than k eligible columns
    assert native.lse_topk(x.double(), 2, ()) is None


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path))
    native.clear_cache()
    yield tmp_path
    native.clear_cache()


@needs_cc
def test_built_once_into_the_cache_dir(fresh_library) -> None:  # type: ignore[no-untyped-def]
    assert native.library() is not None
    (built,) = fresh_library.glob("native-*.so")
    stamp = built.stat().st_mtime_ns
    native.clear_cache()
    assert native.library() is not None
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert list(fresh_library.glob("*.so")) == [built]  # no temporary file left


def test_falls_back_without_a_compiler_or_when_told(fresh_library, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native.library() is None
    assert "failed" in caplog.text
    assert native.lse_topk(torch.randn(2, 100), 2, ()) is None
    assert not list(fresh_library.glob("*.so"))
    native.clear_cache()
    monkeypatch.setenv("CC", "no-such-compiler-aiayn")
    assert native.library() is None
    native.clear_cache()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("AIAYN_NO_NATIVE", "1")
    assert native.library() is None


class _Fixed:
    """A decoder whose next-token logits are a fixed table (only decode_step is used)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def decode_step(self, tokens, src_mask, states):  # type: ignore[no-untyped-def]
        return self.logits.clone()


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_best_next_tokens_same_either_way(dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    model = _Fixed((torch.randn(32, 2_000, generator=g) * 4).to(dtype))
    fast = search.best_next_tokens(model, None, None, None, 5)  # type: ignore[arg-type]
    monkeypatch.setattr(native, "lse_topk", lambda *a, **kw: None)
    slow = search.best_next_tokens(model, None, None, None, 5)  # type: ignore[arg-type]
    assert_log_p(fast[0], slow[0], model.logits, times=2)
    same_value = model.logits.float().gather(1, fast[1]) == model.logits.float().gather(1, slow[1])
    assert same_value.all()
    assert not torch.isin(fast[1], torch.tensor(sorted(NEVER_GENERATED))).any()


@needs_cc
def test_a_damaged_cached_library_is_built_again(fresh_library) -> None:  # type: ignore[no-untyped-def]
    assert native.library() is not None
    (built,) = fresh_library.glob("native-*.so")
    built.unlink()  # a new file: this process still maps the old one
    built.write_bytes(b"not a shared object")
    native.clear_cache()
    assert native.library() is not None
    assert native.lse_topk(torch.randn(2, 100), 2, ()) is not None


# ------------------------------------------------------------------ decoding attention
def eq1(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 1 in float64 for one query per row: q (R, H, K), k (R, H, t, K), v (R, H, t, Vd),
    mask (R, t) -> (R, H, Vd)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("rhd,rhtd->rht", q, k) / q.size(-1) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rht,rhtd->rhd", scores.softmax(-1), v)


def cached_case(
    dtype: torch.dtype, h: int, d_k: int, d_v: int, rows: list[int], seed: int
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Position tables as a beam search leaves them (rows per step `rows`, the last the
    current batch), a random path through them, and the queries."""
    g = torch.Generator().manual_seed(seed)
    width = h * (2 * d_k + d_v)
    tables = [(torch.randn(n, width, generator=g) * 2).to(dtype) for n in rows]
    r = rows[-1]
    path = torch.stack([torch.randint(0, n, (r,), generator=g) for n in rows], dim=1)
    path[:, -1] = torch.arange(r)  # the newest position: each row's own
    q = (torch.randn(r, h * d_k, generator=g) * 2).to(dtype)
    return tables, path, q


def cached_qkv(
    tables: list[torch.Tensor], path: torch.Tensor, q: torch.Tensor, h: int, d_k: int, d_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values a cached case attends with, as `eq1` takes them."""
    hk = h * d_k
    rows = torch.stack([t[path[:, i]] for i, t in enumerate(tables)], dim=1)  # (R, t, W)
    k = rows[..., hk : 2 * hk].unflatten(-1, (h, d_k)).transpose(1, 2)
    v = rows[..., 2 * hk :].unflatten(-1, (h, d_v)).transpose(1, 2)
    return q.view(-1, h, d_k), k, v


def cached_reference(
    tables: list[torch.Tensor], path: torch.Tensor, q: torch.Tensor, h: int, d_k: int, d_v: int
) -> torch.Tensor:
    return eq1(*cached_qkv(tables, path, q, h, d_k, d_v)).flatten(1)


def cached_bound(
    tables: list[torch.Tensor], path: torch.Tensor, q: torch.Tensor, h: int, d_k: int, d_v: int
) -> torch.Tensor:
    return eq1_bound(*cached_qkv(tables, path, q, h, d_k, d_v))


def run_cached(
    tables: list[torch.Tensor], path: torch.Tensor, q: torch.Tensor, h: int, d_k: int, d_v: int
) -> torch.Tensor:
    addresses = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64)
    hk = h * d_k
    return native.cached_attention(
        q, addresses, tables[0].stride(0), hk, 2 * hk, path.contiguous(), h, d_k, d_v
    )


def eq1_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """How far float32 arithmetic may put a kernel's Eq. 1 from the exact one, per output
    element, for any order of its sums (shapes as `eq1`; (R, H*Vd)).

    A score s_i = (q . k_i) / sqrt(d) is a (d+1)-term sum (the products' roundings
    included) and a scaling: error e_i <= sum_bound(d+1) * sum_j |q_j k_ij| / sqrt(d)
    + u |s_i|. A weight exp(s_i - m) then errs by e_i + e_max (its score's and the
    maximum's) + u |s_i - m| (the subtraction) + 2u (expf), relative. The output
    sum_i w_i v_i / sum_i w_i errs by the weights' largest relative error times max|v_i|,
    plus its two t-term sums (sum_bound(t) each, against sum_i w_i |v_i| and sum_i w_i)
    and the final division and product (2u).
    """
    q, k, v = q.double(), k.double(), v.double()
    d, t = q.size(-1), k.size(2)
    if mask is None:
        mask = torch.ones(k.size(0), t, dtype=torch.bool)
    keep = mask[:, None, :]
    s = torch.einsum("rhd,rhtd->rht", q, k) / d**0.5
    e = sum_bound(d + 1) * torch.einsum("rhd,rhtd->rht", q.abs(), k.abs()) / d**0.5
    e = e + U32 * s.abs()
    m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    e_max = e.masked_fill(~keep, 0).amax(-1, keepdim=True)
    rel = (e + e_max + U32 * (s - m).abs() + 2 * U32).masked_fill(~keep, 0).amax(-1)  # (R, H)
    v_max = v.abs().masked_fill(~keep[..., None], 0).amax(2)  # (R, H, Vd)
    n = keep.sum(-1)  # (R, 1)
    bound = (rel[..., None] + 2 * sum_bound(n)[..., None] + 2 * U32) * v_max
    return bound.flatten(1)


def assert_eq1(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """`got` within float32's `bound` of the exact `want`; for bf16 results, plus the one
    rounding to bf16 at the end (half a bf16 ulp: 2^-9 relative)."""
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want.abs()  # the rounding, and the float32 error's own
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (
        f"{(err - bound).max():.3g} over the bound at {(err - bound).argmax()}"
    )


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,d_k,d_v", [(4, 64, 64), (2, 32, 32), (3, 24, 40), (1, 128, 128)])
def test_cached_attention_is_eq1(dtype: torch.dtype, h: int, d_k: int, d_v: int) -> None:
    """Self-attention of a decoding step over positions whose rows a beam reordered:
    Eq. 1 in float64 on the same (bf16-rounded) inputs, for the specialised head sizes
    (64, 32, 128) and another (d_k != d_v)."""
    tables, path, q = cached_case(dtype, h, d_k, d_v, [3, 12, 12, 7, 9, 9], seed=h + d_k)
    got = run_cached(tables, path, q, h, d_k, d_v)
    assert got.dtype == dtype and got.shape == (9, h * d_v)
    want = cached_reference(tables, path, q, h, d_k, d_v)
    assert_eq1(got, want, cached_bound(tables, path, q, h, d_k, d_v))


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("h,d_k,d_v", [(4, 64, 64), (3, 24, 40)])
def test_memory_attention_is_eq1_under_the_source_mask(
    dtype: torch.dtype, g: int, h: int, d_k: int, d_v: int
) -> None:
    """Encoder-decoder attention of a decoding step: a sentence's g rows attend to its
    keys/values (kept once) under its padding mask; padded positions get no weight."""
    gen = torch.Generator().manual_seed(g + h)
    a, s = 5, 11
    k = (torch.randn(a, h, s, d_k, generator=gen) * 2).to(dtype)
    v = (torch.randn(a, h, s, d_v, generator=gen) * 2).to(dtype)
    v[1, :, 6:] = 1e4  # behind sentence 1's padding: any weight there would show
    lengths = torch.tensor([11, 6, 1, 9, 11])
    mask = (torch.arange(s) < lengths[:, None]).repeat_interleave(g, 0)  # (a*g, s)
    q = (torch.randn(a * g, h * d_k, generator=gen) * 2).to(dtype)
    got = native.memory_attention(q, k, v, mask)
    qkv = (q.view(-1, h, d_k), k.repeat_interleave(g, 0), v.repeat_interleave(g, 0))
    want = eq1(*qkv, mask).flatten(1)
    assert_eq1(got, want, eq1_bound(*qkv, mask))


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_attention_rows_do_not_depend_on_the_batch_or_threads(dtype: torch.dtype) -> None:
    h, d_k = 4, 64
    tables, path, q = cached_case(dtype, h, d_k, d_k, [80, 80, 80], seed=5)
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(20, h, 7, d_k, generator=gen).to(dtype)
    mask = torch.ones(80, 7, dtype=torch.bool)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both = run_cached(tables, path, q, h, d_k, d_k), native.memory_attention(q, k, k, mask)
        torch.set_num_threads(1)
        one = run_cached(tables, path, q, h, d_k, d_k), native.memory_attention(q, k, k, mask)
        alone = run_cached(tables, path[41:42], q[41:42], h, d_k, d_k)
        sentence = native.memory_attention(q[40:44], k[10:11], k[10:11], mask[40:44])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(both[0], one[0]) and torch.equal(both[1], one[1])
    assert torch.equal(alone[0], one[0][41]) and torch.equal(sentence, one[1][40:44])


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,d_k", [(4, 64), (2, 32), (1, 128), (2, 48)])
def test_decoding_attention_over_many_positions_is_eq1(
    dtype: torch.dtype, h: int, d_k: int
) -> None:
    """Past 16 positions or keys (on AVX-512 CPUs the kernels take them 16 at a time and
    sum 16 products at once): 37 cached positions and 40 source keys, two whole blocks
    and a ragged one, against Eq. 1 in float64."""
    rows = [7, 12, 12, 9] * 9 + [10]
    tables, path, q = cached_case(dtype, h, d_k, d_k, rows, seed=d_k)
    got = run_cached(tables, path, q, h, d_k, d_k)
    assert_eq1(
        got,
        cached_reference(tables, path, q, h, d_k, d_k),
        cached_bound(tables, path, q, h, d_k, d_k),
    )
    gen = torch.Generator().manual_seed(h)
    a, s, g = 3, 40, 4
    k = (torch.randn(a, h, s, d_k, generator=gen) * 2).to(dtype)
    v = (torch.randn(a, h, s, d_k, generator=gen) * 2).to(dtype)
    mask = (torch.arange(s) < torch.tensor([40, 17, 33])[:, None]).repeat_interleave(g, 0)
    q = (torch.randn(a * g, h * d_k, generator=gen) * 2).to(dtype)
    qkv = (q.view(-1, h, d_k), k.repeat_interleave(g, 0), v.repeat_interleave(g, 0))
    assert_eq1(
        native.memory_attention(q, k, v, mask), eq1(*qkv, mask).flatten(1), eq1_bound(*qkv, mask)
    )


@needs_cc
@on_every_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_score_does_not_depend_on_where_its_key_falls_or_on_padding(dtype: torch.dtype) -> None:
    """The same keys give bit-identical outputs whether a sentence's source is padded to 11
    or to 45 positions (padding holding NaN, which must never reach an output), and a
    row's self-attention is the same alone or among others when positions pass 16."""
    h, d_k, g = 4, 64, 4
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(1, h, 11, d_k, generator=gen).to(dtype)
    v = torch.randn(1, h, 11, d_k, generator=gen).to(dtype)
    q = torch.randn(g, h * d_k, generator=gen).to(dtype)
    short = native.memory_attention(q, k, v, torch.ones(g, 11, dtype=torch.bool))
    pad = torch.full((1, h, 34, d_k), float("nan")).to(dtype)
    mask = torch.arange(45).expand(g, 45) < 11
    long = native.memory_attention(q, torch.cat([k, pad], 2), torch.cat([v, pad], 2), mask)
    assert torch.equal(short, long)
    tables, path, q = cached_case(dtype, h, d_k, d_k, [40] * 21, seed=8)
    every = run_cached(tables, path, q, h, d_k, d_k)
    alone = run_cached(tables, path[17:18], q[17:18], h, d_k, d_k)
    assert torch.equal(alone[0], every[17])


@needs_cc
@on_every_isa
def test_memory_attention_leaves_a_beam_of_hundreds_to_pytorch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """More rows per sentence than the C code's buffers take: None, and the decoding
    step's encoder-decoder attention then runs PyTorch's ops (a beam of 300)."""
    k = torch.randn(1, 2, 5, 64)
    mask = torch.ones(300, 5, dtype=torch.bool)
    assert native.memory_attention(torch.randn(300, 128), k, k, mask) is None
    assert native.memory_attention(torch.randn(4, 128), k, k, mask[:4]) is not None
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2, 16, 16, self_attention=False).eval()
    x, memory = torch.randn(300, 1, 32), torch.randn(1, 5, 32)
    with torch.no_grad():
        kv = attn.project_kv(memory)
        big_beam = attn(x, mask=mask[:, None, None, :], kv=kv)
        monkeypatch.setattr(native, "attention_applies", lambda *a: False)
        torch_ops = attn(x, mask=mask[:, None, None, :], kv=kv)
    torch.testing.assert_close(big_beam, torch_ops, rtol=0, atol=0)


def test_decoding_attention_applies_only_where_the_c_code_can(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert not native.attention_applies(torch.float64, 4, 64, 64)
    assert not native.attention_applies(torch.float16, 4, 64, 64)
    assert not native.attention_applies(torch.float32, 4, 2048, 64)  # d_k over MAX_D
    monkeypatch.setattr(native, "library", lambda: None)
    assert not native.attention_applies(torch.float32, 4, 64, 64)


# ------------------------------------------------------------------ dropout masks
@needs_cc
@on_every_isa
def test_dropout_masks_do_not_depend_on_threads_or_dtype() -> None:
    """A mask is the same whether its blocks are split over two threads or not, and the
    float32 and bf16 multipliers of one seed drop the same elements."""
    x = torch.zeros(700, 1001)
    threads = torch.get_num_threads()
    try:
        masks = []
        for n, dtype in ((2, torch.float32), (1, torch.float32), (2, torch.bfloat16)):
            torch.set_num_threads(n)
            torch.manual_seed(11)
            masks.append(native.dropout_multiplier(x.to(dtype), 0.1))
    finally:
        torch.set_num_threads(threads)
    two, one, bf16 = masks
    assert two is not None and one is not None and bf16 is not None
    assert torch.equal(two, one) and bf16.dtype == torch.bfloat16
    assert torch.equal(two == 0, bf16 == 0)
    assert two.unique().tolist() == [0.0, pytest.approx(1 / 0.9)]


def test_training_kernels_fall_back_where_the_c_code_does_not_apply(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Dropout masks and the loss's rows: None for other dtypes or layouts and without the
    library; the loss then comes from PyTorch ops, the same to float rounding."""
    from aiayn.training.loss import generator_loss

    assert native.dropout_multiplier(torch.zeros(4, 4, dtype=torch.float64), 0.1) is None
    table = torch.randn(6, 50)
    assert native.smoothed_ce(table.double(), torch.zeros(6, dtype=torch.long), 0.1, True) is None
    assert native.smoothed_ce(table.t(), torch.zeros(50, dtype=torch.long), 0.1, True) is None
    features, weight = torch.randn(2, 3, 8), torch.randn(50, 8)
    target = torch.randint(4, 50, (2, 3))
    with_c = generator_loss(features, weight, target, 0.1)
    monkeypatch.setattr(native, "library", lambda: None)
    assert native.dropout_multiplier(torch.zeros(4, 4), 0.1) is None
    assert native.smoothed_ce(table, torch.zeros(6, dtype=torch.long), 0.1, True) is None
    without = generator_loss(features, weight, target, 0.1)
    torch.testing.assert_close(with_c, without, rtol=1e-5, atol=1e-5)


@needs_cc
@on_every_isa
def test_int8_row_kernels_are_the_definition() -> None:
    """quantize_rows: q = round(x * 127 / max|x|) (ties to even), s = max|x| / 127, rows
    read with their stride, the same as the PyTorch-ops fallback; dequantize_rows:
    acc * s_row * s_col + bias, in place."""
    from aiayn.fast.int8_ops import quantize_per_row

    g = torch.Generator().manual_seed(7)
    wide = torch.randn(150, 300, generator=g) * 5
    x = wide[:, 10:267]  # row stride 300, 257 columns
    x[3] = 0.0
    x[4, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties go to even
    acc = torch.randint(-(2**20), 2**20, (150, 77), generator=g, dtype=torch.int32)
    col, bias = torch.rand(77, generator=g), torch.randn(77, generator=g)
    got = native.quantize_rows(x)
    assert got is not None
    q, s = got
    y = native.dequantize_rows(acc.clone(), s, col, bias)
    assert y is not None
    amax = x.abs().amax(1)
    assert torch.equal(s, amax / 127)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    assert torch.equal(q, torch.round(x * inv[:, None]).to(torch.int8))
    fallback_q, fallback_s = quantize_per_row(x)
    assert torch.equal(q, fallback_q) and torch.equal(s, fallback_s)
    assert q[4, :4].tolist() == [127, 0, 2, -2] and not q[3].any() and s[3] == 0
    product = acc.double() * s.double()[:, None] * col.double()
    want = product + bias.double()
    # int32 -> float32 (u), two products (u each) and the bias's sum (u of the result)
    bound = 3 * U32 * product.abs() + U32 * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    relu = native.dequantize_rows(acc.clone(), s, col, bias, relu=True)
    assert relu is not None and torch.equal(relu, torch.relu(y))


# ------------------------------------------------------------------ int8 output layer
@needs_cc
@on_every_isa
@pytest.mark.parametrize("bias", [False, True])
def test_lse_topk_int8_is_dequantize_then_lse_topk(bias: bool) -> None:
    """The fused pass over an int8 layer's int32 products gives, bit for bit, what
    dequantizing them to floats and then `lse_topk` give, on both threads' halves."""
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-40_000, 40_000, (100, 3_000), generator=g, dtype=torch.int32)
    row_scale = torch.rand(100, generator=g) * 1e-3
    col_scale = torch.rand(3_000, generator=g) * 1e-2
    b = torch.randn(3_000, generator=g) if bias else None
    fused = native.lse_topk_int8(acc, row_scale, col_scale, b, 4, (0, 2, 3))
    logits = native.dequantize_rows(acc.clone(), row_scale, col_scale, b)
    assert fused is not None and logits is not None
    plain = native.lse_topk(logits, 4, (0, 2, 3))
    assert plain is not None
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    ref_val, _ = reference(logits, 4, (0, 2, 3))
    assert_log_p(fused[0], ref_val, logits)


@needs_cc
@on_every_isa
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_lse_topk_int8_in_blocks_of_columns(bias: bool, threads: int) -> None:
    """Over blocks of columns (the last one partial, excluded columns in several blocks,
    the row maximum in any block), the running maximum, sum and top-k give the one-pass
    results: the same k logits and columns, the normaliser within float32 rounding, and
    the float64 log-softmax's values."""
    g = torch.Generator().manual_seed(7)
    rows, v = 70, 1_000
    acc = torch.randint(-40_000, 40_000, (rows, v), generator=g, dtype=torch.int32)
    acc[3, 999] = 90_000  # the maximum in the last, partial block
    acc[4, 0] = 90_000  # in the first
    row_scale = torch.rand(rows, generator=g) * 1e-3
    col_scale = torch.rand(v, generator=g) * 1e-2
    b = torch.randn(v, generator=g) if bias else None
    exclude = (0, 2, 130, 999)
    whole = native.lse_topk_int8(acc, row_scale, col_scale, b, 5, exclude)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = []

        def products(c0: int, c1: int) -> torch.Tensor:
            calls.append((c0, c1))
            return acc[:, c0:c1].contiguous()

        blocked = native.lse_topk_int8_blocked(
            products, rows, v, row_scale, col_scale, b, 5, exclude, block=128
        )
    finally:
        torch.set_num_threads(old)
    assert whole is not None and blocked is not None
    assert calls == [(c, min(c + 128, v)) for c in range(0, v, 128)]
    assert torch.equal(blocked[1], whole[1])
    logits = acc.double() * row_scale.double()[:, None] * col_scale.double()
    if b is not None:
        logits = logits + b.double()
    assert_log_p(blocked[0], whole[0], logits, times=2)
    ref_val, ref_idx = reference(logits, 5, exclude)
    assert torch.equal(blocked[1], ref_idx)
    torch.testing.assert_close(blocked[0].double(), ref_val, atol=1e-5, rtol=0)
    # one block for every column: the one-pass function's results, bit for bit
    one = native.lse_topk_int8_blocked(
        lambda c0, c1: acc[:, c0:c1], rows, v, row_scale, col_scale, b, 5, exclude, block=v
    )
    assert one is not None
    assert torch.equal(one[0], whole[0]) and torch.equal(one[1], whole[1])


@needs_cc
@on_every_isa
def test_int8_output_layer_in_blocks_in_a_beam_search(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`Int8Linear.lse_topk` with blocks of 64 columns (a vocabulary of 300: five blocks)
    finds the same hypotheses as with one block, scores within float32 rounding."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")  # the per-layer path (decoder_step: its own tests)
    from aiayn.config import EOS_ID, ModelConfig
    from aiayn.fast import inference, int8_ops
    from aiayn.fast.machine import cast_for_inference
    from aiayn.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, vocab_size=300, P_drop=0.0)
    model = cast_for_inference(Transformer(cfg).eval(), "int8")
    g = torch.Generator().manual_seed(2)
    src = torch.randint(4, 300, (6, 9), generator=g)
    src[:, -1] = EOS_ID
    calls = []
    real = native.lse_topk_int8_blocked

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "lse_topk_int8_blocked", spy)
    one = search.beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    assert calls and set(calls) == {300}
    monkeypatch.setattr(int8_ops, "LSE_TOPK_BLOCK_BYTES", 1)
    calls.clear()
    blocks = search.beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4)
    assert calls and set(calls) == {64}
    # and with each other backend of the products (exact, so the same search): aiayn's
    # kernel and float32 products of the integers (exact for this width), written into
    # the same reused buffer
    for name in ("aiayn", "float"):
        monkeypatch.setattr(int8_ops, "backend", lambda name=name: name)
        for layer in model.modules():
            if isinstance(layer, inference.Int8Linear):
                layer._weight = int8_ops.Int8Weight(layer.weight_int8)
        other = search.beam_search(
            model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4
        )
        assert other == blocks, name
    for a, b in zip(one, blocks, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        for ha, hb in zip(a, b, strict=True):
            assert ha.score == pytest.approx(hb.score, abs=1e-5)


@needs_cc
@on_every_isa
def test_int8_beam_search_is_the_same_with_the_fused_output_layer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An int8 model's beam search takes the fused output layer (`Int8Linear.lse_topk`)
    and the FFN's ReLU inside its first layer's dequantizing (`Int8Linear.forward_relu`),
    and returns what the plain path (the layer's float logits, then `lse_topk`; the ReLU
    after the layer) returns: the same hypotheses, scores and log P, bit for bit."""
    monkeypatch.setenv("AIAYN_NATIVE_STEP", "0")  # the per-layer path (decoder_step: its own tests)
    from aiayn.config import EOS_ID, PAD_ID, ModelConfig
    from aiayn.fast.inference import Int8Linear
    from aiayn.fast.machine import cast_for_inference
    from aiayn.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(N=2, d_model=32, h=2, d_k=16, d_v=16, d_ff=64, vocab_size=300, P_drop=0.0)
    model = cast_for_inference(Transformer(cfg).eval(), "int8")
    assert isinstance(model.generator, Int8Linear)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 300, (6, 9), generator=g)
    src[:, -1] = EOS_ID
    src[0, 5:] = PAD_ID
    src[0, 4] = EOS_ID
    calls = {"lse_topk": 0, "forward_relu": 0}

    def counted(name):  # type: ignore[no-untyped-def]
        method = getattr(Int8Linear, name)

        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return method(*args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(Int8Linear, name, counted(name))
    fused = search.beam_search(
        model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4, min_len=3
    )
    assert calls["lse_topk"] > 0 and calls["forward_relu"] > 0
    monkeypatch.setattr(Int8Linear, "lse_topk", lambda *a, **kw: None)
    monkeypatch.delattr(Int8Linear, "forward_relu")
    plain = search.beam_search(
        model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=4, min_len=3
    )
    assert fused == plain


# ------------------------------------------------------------------ int8 products
@needs_cc
@on_every_isa
@pytest.mark.parametrize(
    "m,n,k", [(1, 8, 4), (3, 13, 7), (37, 100, 130), (70, 24, 512), (5, 301, 1030)]
)
def test_int8_gemm_is_exact_over_the_whole_range(m: int, n: int, k: int) -> None:
    """aiayn's int8 product (csrc/int8_gemm.c) on operands of the whole range [-127, 127],
    extremes included (where oneDNN's kernel without VNNI saturates): the exact integer
    product, for partial panels and k groups, any column range, both code paths and
    thread splits."""
    check_int8_gemm(m, n, k)


#: csrc/int8_gemm.c's VNNI steps (vpdpbusd) on a CPU without VNNI: the instruction as
#: Intel's manual defines it (each int32 lane plus the four products of its bytes, a
#: unsigned, b signed, no saturation), force-included before the source with its ISA's
#: macros so that the VNNI branch is compiled (`-include`, through a compiler wrapper as CC).
_VNNI_SHIMS = {
    "avx512_vnni": ("#define __AVX512VNNI__ 1\n#define __AVX512VL__ 1\n", "_mm256_dpbusd_epi32"),
    "avx_vnni": ("#define __AVXVNNI__ 1\n", "_mm256_dpbusd_avx_epi32"),
}
_VPDPBUSD = """#include <immintrin.h>
#include <stdint.h>
static inline __m256i vpdpbusd_by_definition(__m256i src, __m256i a, __m256i b) {
    int32_t r[8]; uint8_t ua[32]; int8_t sb[32];
    _mm256_storeu_si256((__m256i *)r, src);
    _mm256_storeu_si256((__m256i *)ua, a);
    _mm256_storeu_si256((__m256i *)sb, b);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) r[i] += (int32_t)ua[4 * i + j] * (int32_t)sb[4 * i + j];
    return _mm256_loadu_si256((const __m256i *)r);
}
"""


@needs_cc
@pytest.mark.parametrize("variant", sorted(_VNNI_SHIMS))
def test_int8_gemm_vnni_steps_are_exact_emulated(variant: str, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The kernel's VNNI steps (AVX-512 VNNI, AVX-VNNI), compiled against vpdpbusd written
    out by its definition on this AVX2 CPU, give the exact products too (a wrong operand
    order fails here); on CPUs with VNNI the every-ISA test above runs the instruction."""
    from aiayn.cpu_isa import cpu

    if "avx2" not in cpu().flags:
        pytest.skip("the emulated build runs the AVX2 kernel: this CPU has no AVX2")
    macros, intrinsic = _VNNI_SHIMS[variant]
    shim = tmp_path / "vnni_shim.h"
    shim.write_text(
        _VPDPBUSD
        + macros
        + f"#undef {intrinsic}\n#define {intrinsic}(s, a, b) vpdpbusd_by_definition(s, a, b)\n"
    )
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("cc")} -include {shim} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    native.clear_cache()
    try:
        lib = native.library_for("avx2")
        assert lib is not None
        monkeypatch.setattr(native, "library", lambda: lib)
        for m, n, k in [(1, 8, 4), (3, 13, 7), (37, 100, 130), (5, 301, 1030)]:
            check_int8_gemm(m, n, k)
    finally:
        monkeypatch.undo()
        native.clear_cache()


def check_int8_gemm(m: int, n: int, k: int) -> None:
    """`native.int8_gemm` against the integer product: signed, sign-free (ReLU inputs) and
    7-bit inputs, whole and partial column ranges, one and two threads, both code paths."""
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randint(-127, 128, (m, k + 3), dtype=torch.int8, generator=g)[:, :k]  # strided
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    a[0, : min(k, 4)] = 127
    b[0, : min(k, 4)] = -127  # a pair at its largest: 2 * 127 * 127
    want = a.long() @ b.long().t()
    packed = native.int8_pack(b)
    assert packed is not None
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for plain in (False, True):
                got = native.int8_gemm(a, packed, n, plain=plain)
                assert got.dtype == torch.int32 and torch.equal(got.long(), want), (t, plain)
            if n > 8:
                part = native.int8_gemm(a, packed, n, 8, n - 1)
                assert torch.equal(part.long(), want[:, 8 : n - 1])
            # a ReLU's quantized output, [0, 127]: the kernel without sign moves
            relu = a.clamp(min=0)
            relu[0, : min(k, 4)] = 127
            got = native.int8_gemm(relu, packed, n, nonneg=True)
            assert torch.equal(got.long(), relu.long() @ b.long().t()), t
            if n > 8:
                part = native.int8_gemm(relu, packed, n, 8, n - 1, nonneg=True)
                assert torch.equal(part.long(), (relu.long() @ b.long().t())[:, 8 : n - 1])
            # 7-bit activations stored plus 64 (quantize_rows(bits=7)): the product of the
            # values, the weights' column sums kept by int8_pack
            a7 = (a.long() * 63 // 127).clamp(-63, 63)
            a7[0, : min(k, 4)] = -63
            biased = (a7 + 64).to(torch.int8)
            got = native.int8_gemm(biased, packed, n, r7=True)
            assert torch.equal(got.long(), a7 @ b.long().t()), t
            if n > 8:
                part = native.int8_gemm(biased, packed, n, 8, n - 1, r7=True)
                assert torch.equal(part.long(), (a7 @ b.long().t())[:, 8 : n - 1])
    finally:
        torch.set_num_threads(threads)


def test_int8_products_are_exact_whatever_the_backend(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`int8_ops.int8_matmul` and the layers' `Int8Weight`: exact with torch._int_mm where
    it is exact here, with aiayn's kernel, and with the float fallback (K <= 1,040)."""
    from aiayn.fast import int8_ops

    g = torch.Generator().manual_seed(4)
    a = torch.randint(-127, 128, (33, 520), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (77, 520), dtype=torch.int8, generator=g)
    want = a.long() @ b.long().t()
    backends = ["aiayn", "float"] + (["torch"] if int8_ops._int_mm_exact() else [])
    for name in backends:
        if name == "aiayn" and native.library() is None:
            continue
        monkeypatch.setattr(int8_ops, "backend", lambda name=name: name)
        assert torch.equal(int8_ops.int8_matmul(a, b).long(), want), name
        w = int8_ops.Int8Weight(b)
        assert (w.packed is not None) == (name == "aiayn")
        assert torch.equal(w.matmul(a, 16, 77).long(), want[:, 16:]), name
