"""The Triton kernels of `aiayn.fast.kernels` (imported on first use: importing Triton is
slow, and CPU runs should not pay for it; measured: docs/performance.md). See that module
for the math."""

import triton
import triton.language as tl


@triton.jit
def _scores(
    q,
    k,
    rq,
    rk,
    keep_ptr,
    b,
    smb,
    tq,
    tk,
    scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PREC: tl.constexpr,
):
    """Scaled scores with illegal connections at -inf, and the mask of legal ones."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    valid = (rk[None, :] < tk) & (rq[:, None] < tq)
    if HAS_MASK:
        keep = tl.load(keep_ptr + b * smb + rk, mask=rk < tk, other=0)
        valid = valid & (keep[None, :] != 0)
    if CAUSAL:
        valid = valid & (rk[None, :] <= rq[:, None])
    return tl.where(valid, s, float("-inf")), valid


@triton.jit
def _ptrs(base, b, h, sb, sh, st, r, rd):
    """Addresses of one (sentence, head)'s rows r x columns rd of a (B, H, T, D)-strided
    tensor (any layout whose last dimension is contiguous)."""
    return base + b * sb + h * sh + r[:, None] * st + rd[None, :]


@triton.jit
def _load_qkv(
    Q,
    K,
    V,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    H,
    TQ,
    TK,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    D: tl.constexpr,
):
    """This program's (sentence, head), its query, key and column ranges, and its Q, K
    and V tiles (rows past TQ or TK read as 0)."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    rq = tl.arange(0, BQ)
    rk = tl.arange(0, BK)
    rd = tl.arange(0, D)
    q = tl.load(_ptrs(Q, b, h, sqb, sqh, sqt, rq, rd), mask=rq[:, None] < TQ, other=0.0)
    k = tl.load(_ptrs(K, b, h, skb, skh, skt, rk, rd), mask=rk[:, None] < TK, other=0.0)
    v = tl.load(_ptrs(V, b, h, svb, svh, svt, rk, rd), mask=rk[:, None] < TK, other=0.0)
    return pid, b, h, rq, rk, rd, q, k, v


@triton.jit
def attn_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    KEEP,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    smb,
    H,
    TQ,
    TK,
    scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PREC: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    D: tl.constexpr,
):
    """One program per (sentence, head): O = softmax(Q K^T * scale) V, and the rows'
    log-sum-exp for the backward."""
    pid, b, h, rq, rk, rd, q, k, v = _load_qkv(
        Q, K, V, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, H, TQ, TK, BQ, BK, D
    )
    qm = rq[:, None] < TQ
    s, valid = _scores(q, k, rq, rk, KEEP, b, smb, TQ, TK, scale, CAUSAL, HAS_MASK, PREC)
    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row with no legal key: output 0
    p = tl.where(valid, tl.exp(s - m[:, None]), 0.0)
    denom = tl.sum(p, axis=1)
    denom = tl.where(denom == 0.0, 1.0, denom)
    p = p / denom[:, None]
    o = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    tl.store(_ptrs(Out, b, h, sob, soh, sot, rq, rd), o.to(Out.dtype.element_ty), mask=qm)
    tl.store(LSE + pid * TQ + rq, m + tl.log(denom), mask=rq < TQ)


@triton.jit
def attn_bwd(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    KEEP,
    DQ,
    DK,
    DV,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    sdb,
    sdh,
    sdt,
    smb,
    sgqb,
    sgqh,
    sgqt,
    sgkb,
    sgkh,
    sgkt,
    H,
    TQ,
    TK,
    scale,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PREC: tl.constexpr,
    BQ: tl.constexpr,
    BK: tl.constexpr,
    D: tl.constexpr,
):
    """dQ, dK, dV of one (sentence, head), recomputing P from the saved log-sum-exp."""
    pid, b, h, rq, rk, rd, q, k, v = _load_qkv(
        Q, K, V, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, H, TQ, TK, BQ, BK, D
    )
    qm = rq[:, None] < TQ
    km = rk[:, None] < TK
    o = tl.load(_ptrs(Out, b, h, sob, soh, sot, rq, rd), mask=qm, other=0.0)
    do = tl.load(_ptrs(DO, b, h, sdb, sdh, sdt, rq, rd), mask=qm, other=0.0)
    lse = tl.load(LSE + pid * TQ + rq, mask=rq < TQ, other=0.0)
    s, valid = _scores(q, k, rq, rk, KEEP, b, smb, TQ, TK, scale, CAUSAL, HAS_MASK, PREC)
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    di = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    ds = p * (dp - di[:, None])
    dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC) * scale
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
    tl.store(_ptrs(DQ, b, h, sgqb, sgqh, sgqt, rq, rd), dq.to(DQ.dtype.element_ty), mask=qm)
    # DK and DV share a layout (B, Tk, H, D)
    tl.store(_ptrs(DK, b, h, sgkb, sgkh, sgkt, rk, rd), dk.to(DK.dtype.element_ty), mask=km)
    tl.store(_ptrs(DV, b, h, sgkb, sgkh, sgkt, rk, rd), dv.to(DV.dtype.element_ty), mask=km)
