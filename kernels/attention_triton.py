"""Varlen causal attention in Triton: FlashAttention-2-style forward and backward over a packed row.

Instead of a per-document launch, the grid runs over blocks of the packed row. ``seq_start[t]`` (``seq_end[t]``) is
the first (one-past-last) token of token t's document, so key j is visible to query i iff
``seq_start[i] <= j <= i``. Starts never decrease along the row, so a query block [m0, m0 + BLOCK_M) only scans key
blocks from ``seq_start[m0]`` up to its diagonal, and a key block only meets query blocks from itself to the end of
its last key's document::

    keys ->     doc A       doc B        query block over B scans only B's keys up to the diagonal;
    q  A  |\\                            a query block spanning A|B scans from A's start (rows of B mask A's keys)
    |  B  |         |\\
    v  C  |                   |\\

Masks: of the blocks a program scans, only those on the diagonal or across a document boundary need the causal /
document mask; each block is tested ([u_lo, u_hi) is the unmasked run) and the others are used unmasked.

Program order: the grid is one-dimensional with heads fastest, so the programs of one block position run side by
side (with GQA they read the same K/V tiles). A program's work grows with its block's distance from its document's
start (queries) or end (keys); in row order the long programs of late blocks start last and the GPU idles on the
tail. ``ORDER="lpt"`` has each program read its block from a work-sorted order (``RowLayout``, longest first:
longest-processing-time scheduling); ``ORDER="row"`` keeps row order, which keeps neighbouring blocks of a document
(and their K/V tiles in L2) together. Which wins depends on the shape (benchmarks/RESULTS.md).

Sliding windows (Mistral, Phi-3, Gemma 3's local layers): with ``WINDOW`` = W, query i sees keys j with
max(seq_start[i], i - W + 1) <= j <= i. That first visible key never decreases along the row either, so the same
block ranges hold with it in place of the document start, and a window skips every key block left of it: attention
over long documents costs O(T W) instead of O(T^2). Without a window, ``WINDOW`` is ``NO_WINDOW`` (2**30).

GQA: query head h reads kv head h // (H / K) through strides, nothing is expanded; the dK/dV program of a kv head loops
over its query heads. With ``PACK`` in a config, a query tile holds BLOCK_M // GROUP positions of every query head of
one kv group, stacked as its BLOCK_M rows: a forward or dQ program serves the whole group from one read of each K/V
tile, a dK/dV program runs one loop instead of one per head (fewer live registers: `python -m sftflow.kernels.aot`), and
a short document's diagonal block is as narrow as BLOCK_M // GROUP positions while the products stay BLOCK_M deep.

TMA (``TMA`` in a config): tiles are loaded and stored through host-side tensor descriptors over each tensor's (T, heads
* D) rows, one bulk copy per tile (zero-filled past the row's end on load, dropped on store), instead of per-thread
pointers and masks: fewer registers (`python -m sftflow.kernels.aot`), and 0-8% faster forward+backward on an H100
(benchmarks/RESULTS.md), so the shipped configs ask for it. Where a tensor's layout does not allow it (`tma_fits`),
on GPUs before Hopper, on a Triton without host-side descriptors (`tma_supported`), or with PACK, pointers.

Softmax runs in base 2 (exp2) on fp32 scores; the forward saves the per-row log-sum-exp for the backward. Imported
lazily by ``attention`` so TRITON_INTERPRET can be set first.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from sftflow.kernels.attention_ops import NO_WINDOW, define_attention_ops, op_arguments

LOG2E = 1.4426950408889634


# Block shapes and program order per (head dim, GQA), from the H200 sweeps in benchmarks/attention.py (see
# benchmarks/RESULTS.md). The backward runs two kernels: dK/dV (a program per key block, looping over its group's
# query heads) and dQ (a program per query block), each with its own shape.
def _cfg(block_m: int, block_n: int, stages: int, order: str, warps: int = 4, split: bool = False) -> dict:
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, ORDER=order)
    return {**cfg, "SPLIT": True} if split else cfg


def with_flags(parts: dict, **flags) -> dict:
    """A kernel set's configs with `flags` set in every part (`TMA=False`: the tiles through per-thread pointers)."""
    return {part: {**cfg, **flags} for part, cfg in parts.items()}


def _tma(parts: dict) -> dict:
    """A kernel set's configs with their tiles moved through TMA descriptors."""
    return with_flags(parts, TMA=True)


# D=256 dK/dV in two passes (dV, then dK), each with one 128-key fp32 accumulator: 1.24x the single pass with two
# 32-64-key accumulators on long documents, 1.07x on packed rows, for recomputing the scores once more.
_SPLIT_256 = _cfg(32, 128, 2, "row", 8, split=True)


# Every tile through TMA descriptors: ahead of per-thread pointers at every shape timed (H100, benchmarks/RESULTS.md).
CONFIGS = {
    (64, False): _tma({"fwd": _cfg(64, 64, 3, "row"), "dkdv": _cfg(32, 64, 3, "row"), "dq": _cfg(64, 32, 3, "row")}),
    (64, True): _tma({"fwd": _cfg(64, 64, 3, "lpt"), "dkdv": _cfg(64, 64, 3, "lpt"), "dq": _cfg(64, 32, 3, "lpt")}),
    (128, False): _tma({"fwd": _cfg(64, 64, 3, "row"), "dkdv": _cfg(32, 64, 3, "row"), "dq": _cfg(64, 32, 3, "row")}),
    (128, True): _tma({"fwd": _cfg(64, 64, 3, "lpt"), "dkdv": _cfg(32, 64, 3, "lpt"), "dq": _cfg(64, 32, 3, "lpt")}),
    # Gemma 3 (D=256): shallower tiles, so that K/V stages and the fp32 accumulators fit shared memory and registers
    (256, False): _tma({"fwd": _cfg(64, 32, 2, "row"), "dkdv": _SPLIT_256, "dq": _cfg(128, 32, 2, "row", 8)}),
    (256, True): _tma({"fwd": _cfg(64, 32, 2, "row"), "dkdv": _SPLIT_256, "dq": _cfg(128, 32, 2, "row", 8)}),
}
# Rows whose longest document has at least LONG_DOC tokens: that document holds nearly all of the row's attention work
# (an 8192-token document does 14x the work of 8192 tokens of 600-token ones) and few of its blocks are masked, so
# deeper tiles pay off there; on short documents they waste work on the diagonals. Measured without windows only.
LONG_DOC = 8192
_LONG_64 = _tma({"fwd": _cfg(128, 64, 3, "lpt", 8), "dkdv": _cfg(32, 128, 3, "row"), "dq": _cfg(128, 64, 3, "lpt")})
_LONG_128 = _tma(
    {"fwd": _cfg(128, 64, 3, "lpt", 8), "dkdv": _cfg(64, 128, 3, "lpt", 8), "dq": _cfg(128, 64, 3, "lpt", 8)}
)
_LONG_256 = _tma({"fwd": _cfg(64, 32, 2, "lpt"), "dkdv": _SPLIT_256, "dq": _cfg(128, 32, 2, "row", 8)})
CONFIGS_LONG = {
    (64, False): _LONG_64,
    (64, True): _LONG_64,
    (128, False): _LONG_128,
    (128, True): _LONG_128,
    (256, False): _LONG_256,
    (256, True): _LONG_256,
}
SMALL_CONFIG = _cfg(16, 16, 1, "lpt")  # the CPU interpreter and odd head dims


@triton.jit
def _tile(ptr, row0, rows, stride_row, col_off, offs_d, d_ok, T, EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, zeros past row T (and past D when BLOCK_D > D). With TMA, `ptr` is a tensor
    descriptor over the (T, heads * D) rows and the copy engine loads the box at (row0, col_off), zeros past T."""
    if TMA:
        x = ptr.load([row0, col_off])
    else:
        ptrs = ptr + rows[:, None] * stride_row + col_off + offs_d[None, :]
        if EVEN_D:
            x = tl.load(ptrs, mask=(rows < T)[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows < T)[:, None] & d_ok[None, :], other=0.0)
    return x


@triton.jit
def _key_ranges(m0, seq_start_ptr, T, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks a query block [m0, m0 + BLOCK_M) meets, [lo, end), and among them the unmasked run [u_lo, u_hi).
    A key block needs no mask when every row sees every key: its keys are at or below the block's first row, and at
    or after the largest first visible key among the rows (that of the last valid row: a row's first visible key,
    max(document start, row - WINDOW + 1), never decreases along the row)."""
    hi = tl.minimum(m0 + BLOCK_M, T)
    lo = tl.maximum(tl.load(seq_start_ptr + m0), m0 - WINDOW + 1) // BLOCK_N * BLOCK_N
    start_last = tl.maximum(tl.load(seq_start_ptr + hi - 1), hi - WINDOW)
    end = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    u_lo = tl.minimum(tl.cdiv(start_last, BLOCK_N) * BLOCK_N, end)
    u_hi = tl.maximum(u_lo, (m0 + 1) // BLOCK_N * BLOCK_N)
    return lo, u_lo, u_hi, end


@triton.jit
def _query_rows(order_ptr, H, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """A query program's rows: (first position, position per row, head (per row when packed), kv head).

    Unpacked, a program is one head's BLOCK_M positions. Packed (GQA), it is one kv head's BLOCK_M // GROUP positions
    for all GROUP query heads of the group, row r at position m0 + r // GROUP of head kh * GROUP + r % GROUP: one K/V
    tile serves the whole group, and a short document's diagonal block masks the waste of BLOCK_M // GROUP positions
    while its products are BLOCK_M rows deep."""
    pid = tl.program_id(0)
    if PACK:
        kh = pid % (H // GROUP)
        m0 = tl.load(order_ptr + pid // (H // GROUP)) * (BLOCK_M // GROUP)
        rows = tl.arange(0, BLOCK_M)
        offs_m = m0 + rows // GROUP
        head = kh * GROUP + rows % GROUP
    else:
        head = pid % H
        m0 = tl.load(order_ptr + pid // H) * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        kh = head // GROUP
    return m0, offs_m, head, kh


@triton.jit
def _head_offset(head, stride_h, PACK: tl.constexpr):
    """The head's offset, as a column to add to a (rows, D) tile's pointers when it differs per row (packed)."""
    offset = head * stride_h
    if PACK:  # a constexpr branch: one return, whose shape differs between the two compiled variants
        offset = offset[:, None]
    return offset


@triton.jit
def _kv_scores(
    q, k_ptr, v_ptr, n0, offs_m, start_m, offs_d, d_ok, k_off, v_off, stride_kt, stride_vt, T, u_lo, u_hi,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """The key block at n0: its K and V tiles and the raw scores q k^T, -inf where not visible (callers fold the
    base-2 softmax scale into their exp2 argument: one fused multiply-add per score)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _tile(k_ptr, n0, offs_n, stride_kt, k_off, offs_d, d_ok, T, EVEN_D, TMA)
    v = _tile(v_ptr, n0, offs_n, stride_vt, v_off, offs_d, d_ok, T, EVEN_D, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if (n0 < u_lo) | (n0 >= u_hi):  # on the diagonal or across a document boundary
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= start_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    return k, v, s


@triton.jit
def _fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    seq_start_ptr,
    order_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    T,
    D,
    H,
    qk_scale,
    WINDOW,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    PACK: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    m0, offs_m, head, kh = _query_rows(order_ptr, H, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    start_m = tl.maximum(tl.load(seq_start_ptr + offs_m, mask=row_ok, other=T), offs_m - WINDOW + 1)
    q = _tile(q_ptr, m0, offs_m, stride_qt, _head_offset(head, stride_qh, PACK), offs_d, d_ok, T, EVEN_D, TMA)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, u_lo, u_hi, end = _key_ranges(m0, seq_start_ptr, T, WINDOW, BLOCK_M // GROUP if PACK else BLOCK_M, BLOCK_N)
    k_off, v_off = kh * stride_kh, kh * stride_vh
    for n0 in range(lo, end, BLOCK_N):
        k, v, s = _kv_scores(
            q, k_ptr, v_ptr, n0, offs_m, start_m, offs_d, d_ok, k_off, v_off, stride_kt, stride_vt, T, u_lo, u_hi,
            BLOCK_N, EVEN_D, PRECISION, TMA,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    # Stores written out in each kernel rather than in a helper: through a helper the compiler allocated registers
    # differently (8-24 bytes a thread spilled in the D=256 dK/dV passes; `python -m sftflow.kernels.aot`).
    if TMA:  # the copy engine drops rows past T
        o_ptr.store([m0, head * stride_oh], acc.to(o_ptr.dtype))
    else:
        tl.store(
            o_ptr + offs_m[:, None] * stride_ot + _head_offset(head, stride_oh, PACK) + offs_d[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    tl.store(lse_ptr + head * T + offs_m, m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    dq_ptr,
    lse_ptr,
    delta_ptr,
    seq_start_ptr,
    order_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    T,
    D,
    H,
    qk_scale,
    scale,
    WINDOW,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    PACK: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    m0, offs_m, head, kh = _query_rows(order_ptr, H, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    start_m = tl.maximum(tl.load(seq_start_ptr + offs_m, mask=row_ok, other=T), offs_m - WINDOW + 1)
    q = _tile(q_ptr, m0, offs_m, stride_qt, _head_offset(head, stride_qh, PACK), offs_d, d_ok, T, EVEN_D, TMA)
    do = _tile(do_ptr, m0, offs_m, stride_dot, _head_offset(head, stride_doh, PACK), offs_d, d_ok, T, EVEN_D, TMA)
    lse = tl.load(lse_ptr + head * T + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head * T + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, u_lo, u_hi, end = _key_ranges(m0, seq_start_ptr, T, WINDOW, BLOCK_M // GROUP if PACK else BLOCK_M, BLOCK_N)
    k_off, v_off = kh * stride_kh, kh * stride_vh
    for n0 in range(lo, end, BLOCK_N):
        k, v, s = _kv_scores(
            q, k_ptr, v_ptr, n0, offs_m, start_m, offs_d, d_ok, k_off, v_off, stride_kt, stride_vt, T, u_lo, u_hi,
            BLOCK_N, EVEN_D, PRECISION, TMA,
        )  # fmt: skip
        p = tl.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    if TMA:
        dq_ptr.store([m0, head * stride_dqh], (dq * scale).to(dq_ptr.dtype))
    else:
        tl.store(
            dq_ptr + offs_m[:, None] * stride_dqt + _head_offset(head, stride_dqh, PACK) + offs_d[None, :],
            (dq * scale).to(dq_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    dk_ptr,
    dv_ptr,
    lse_ptr,
    delta_ptr,
    seq_start_ptr,
    seq_end_ptr,
    order_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    T,
    D,
    K,
    qk_scale,
    scale,
    WINDOW,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    PART: tl.constexpr = 0,
    PACK: tl.constexpr = False,
    TMA: tl.constexpr = False,
):
    # PART 0 computes dK and dV; 1 only dV and 2 only dK (a split pass: one fp32 accumulator per program instead of
    # two, so wide heads get deeper key tiles, for the recomputed scores of a second pass). PACK: each query tile is
    # BLOCK_M // GROUP positions of all the group's heads (as the packed query kernels' rows): one loop, not one per
    # head.
    pid = tl.program_id(0)
    kh = pid % K
    n0 = tl.load(order_ptr + pid // K) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k = _tile(k_ptr, n0, offs_n, stride_kt, kh * stride_kh, offs_d, d_ok, T, EVEN_D, TMA)
    v = _tile(v_ptr, n0, offs_n, stride_vt, kh * stride_vh, offs_d, d_ok, T, EVEN_D, TMA)
    # Query blocks that can see a key of this block: from the block itself to the end of its last key's document
    # (or of its window). Unmasked among them, [u_lo, u_hi): rows at or after the block's last key, inside its first
    # key's document and window.
    step = BLOCK_M // GROUP if PACK else BLOCK_M  # positions per query tile
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    q_end = tl.cdiv(tl.minimum(tl.load(seq_end_ptr + last), last + WINDOW), step) * step
    q_lo = n0 // step * step
    u_lo = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, step) * step, q_end)
    u_hi = tl.maximum(u_lo, tl.minimum(tl.load(seq_end_ptr + n0), n0 + WINDOW) // step * step)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(1 if PACK else GROUP):
        for m0 in range(q_lo, q_end, step):
            if PACK:
                rows = tl.arange(0, BLOCK_M)
                offs_m = m0 + rows // GROUP
                h = kh * GROUP + rows % GROUP
            else:
                offs_m = m0 + tl.arange(0, BLOCK_M)
                h = kh * GROUP + g
            q = _tile(q_ptr, m0, offs_m, stride_qt, _head_offset(h, stride_qh, PACK), offs_d, d_ok, T, EVEN_D, TMA)
            do = _tile(do_ptr, m0, offs_m, stride_dot, _head_offset(h, stride_doh, PACK), offs_d, d_ok, T, EVEN_D, TMA)
            lse = tl.load(lse_ptr + h * T + offs_m, mask=offs_m < T, other=0.0)
            delta = tl.load(delta_ptr + h * T + offs_m, mask=offs_m < T, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
            p_t = tl.exp2(s_t * qk_scale - lse[None, :])
            if (m0 < u_lo) | (m0 >= u_hi):  # on the diagonal or across a document boundary
                start_m = tl.maximum(tl.load(seq_start_ptr + offs_m, mask=offs_m < T, other=T), offs_m - WINDOW + 1)
                visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_n[:, None] >= start_m[None, :])
                p_t = tl.where(visible, p_t, 0.0)
            if PART != 2:
                dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            if PART != 1:
                dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
                dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
    kd_mask = (offs_n < T)[:, None] & d_ok[None, :]
    if PART != 1:
        if TMA:
            dk_ptr.store([n0, kh * stride_dkh], (dk * scale).to(dk_ptr.dtype))
        else:
            tl.store(
                dk_ptr + offs_n[:, None] * stride_dkt + kh * stride_dkh + offs_d[None, :],
                (dk * scale).to(dk_ptr.dtype.element_ty),
                mask=kd_mask,
            )
    if PART != 2:
        if TMA:
            dv_ptr.store([n0, kh * stride_dvh], dv.to(dv_ptr.dtype))
        else:
            tl.store(
                dv_ptr + offs_n[:, None] * stride_dvt + kh * stride_dvh + offs_d[None, :],
                dv.to(dv_ptr.dtype.element_ty),
                mask=kd_mask,
            )


@triton.jit
def _bwd_delta_kernel(
    o_ptr,
    do_ptr,
    delta_ptr,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    T,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta[h, t] = sum_d o[t, h, d] * do[t, h, d] in fp32: one read of o and dO."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < T)[:, None] & (offs_d < D)[None, :]
    o = tl.load(o_ptr + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(delta_ptr + h * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < T)


def _configs(D: int, gqa: bool, device: torch.device, long_docs: bool) -> dict:
    if device.type != "cuda":
        return {part: SMALL_CONFIG for part in ("fwd", "dkdv", "dq")}
    table = CONFIGS_LONG if long_docs else CONFIGS
    return table.get((D, gqa)) or table[(64 if D < 64 else 128 if D <= 128 else 256, gqa)]


def _launch(cfg: dict) -> tuple[str, dict]:
    """A config's program order ("lpt" or "row") and its kernel keywords."""
    cfg = dict(cfg)
    order = cfg.pop("ORDER", "lpt")
    if order not in ("lpt", "row"):
        raise ValueError(f"ORDER={order!r}: expected 'lpt' or 'row'")
    return order, cfg


def packs(cfg: dict, group: int) -> bool:
    """Whether a kernel config's `PACK` applies: GQA, with a group that divides BLOCK_M (else a tile per head)."""
    return bool(cfg.get("PACK", False)) and group > 1 and cfg["BLOCK_M"] % group == 0


def _query_launch(cfg: dict, T: int, H: int, group: int, layout: RowLayout, window: int):
    """A query-block kernel's (fwd, dQ) grid, block order and keywords: a program per head, or per kv head with its
    group's query heads stacked as rows where `PACK` applies."""
    order, cfg = _launch(cfg)
    pack = packs(cfg, group)
    cfg.pop("PACK", None)
    positions, programs = (cfg["BLOCK_M"] // group, H // group) if pack else (cfg["BLOCK_M"], H)
    grid = (triton.cdiv(T, positions) * programs,)
    return grid, layout.order("q", positions, order, window), {**cfg, "PACK": pack}


def tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether (T, heads, D) tensors can be read and written through TMA descriptors over their (T, heads * D) rows:
    heads adjacent, D contiguous, a power of two of at least 16 elements, and 16-byte aligned rows and base."""
    for t in tensors:
        T, _, D = t.shape
        if t.stride(2) != 1 or t.stride(1) != D or D < 16 or D & (D - 1) or T == 0:
            return False
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


@functools.cache
def tma_supported(device: torch.device) -> bool:
    """Whether this Triton has host-side tensor descriptors and `device` a copy engine for them (Hopper and later; the
    CPU interpreter emulates them)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _with_tma(cfg: dict, tensors: dict[str, tuple[torch.Tensor, int]]) -> dict[str, object]:
    """A kernel's tensor arguments: each (tensor, box rows) as a TMA descriptor where the config asks for `TMA`, the
    device takes descriptors (`tma_supported`) and every tensor fits (`tma_fits`; never with `PACK`, whose rows are
    gathered), else the tensors; sets cfg["TMA"]."""
    first = next(iter(tensors.values()))[0]
    cfg["TMA"] = (
        cfg.get("TMA", False)
        and not cfg.get("PACK", False)
        and tma_supported(first.device)
        and tma_fits(*(t for t, _ in tensors.values()))
    )
    if not cfg["TMA"]:
        return {name: t for name, (t, _) in tensors.items()}
    return {name: _descriptor(t, rows) for name, (t, rows) in tensors.items()}


def _descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor over a (T, heads, D) tensor's (T, heads * D) rows, in boxes of `rows` rows and one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, heads, D = t.shape
    return TensorDescriptor(t, [T, heads * D], [t.stride(0), 1], [rows, D])


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 dots (tests); ignored for 16-bit


def document_bounds(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the first and one-past-last token of its document (int32, on cu_seqlens' device; no sync)."""
    cu = cu_seqlens.to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    seq_start = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    seq_end = torch.repeat_interleave(cu[1:], lengths, output_size=total)
    return seq_start, seq_end


@dataclass
class RowLayout:
    """Per packed row: document bounds per token and block orders per block size (int32, on the device, computed
    without a host sync). Every attention layer of a step sees the same row, so the last one is kept (`row_layout`)."""

    seq_start: torch.Tensor
    seq_end: torch.Tensor
    orders: dict[tuple[str, int, str, int], torch.Tensor] = field(default_factory=dict)

    def order(self, side: str, block: int, how: str = "lpt", window: int = NO_WINDOW) -> torch.Tensor:
        """Query ("q") or key ("k") blocks of `block` tokens in program order: most work first ("lpt"), or row order.

        A query block's work is the keys it scans (from its first row's first visible key to its end); a key block's
        the queries that can see it (from its start to the end of its last key's document or window)."""
        key = (side, block, how, window)
        if key not in self.orders:
            T, device = self.seq_start.numel(), self.seq_start.device
            blocks = torch.arange(triton.cdiv(T, block), device=device, dtype=torch.int32)
            if how == "row":
                self.orders[key] = blocks
            else:
                first = blocks * block
                last = torch.clamp(first + block, max=T) - 1
                if side == "q":
                    work = last + 1 - torch.maximum(self.seq_start[first], first - window + 1)
                else:
                    work = torch.minimum(self.seq_end[last], last + window) - first
                self.orders[key] = torch.argsort(work, descending=True, stable=True).to(torch.int32)
        return self.orders[key]


_LAST_LAYOUT: dict = {}


def row_layout(cu_seqlens: torch.Tensor, total: int) -> RowLayout:
    """The layout of a row, reused while the same `cu_seqlens` tensor (same object, unmodified) comes back."""
    ref = _LAST_LAYOUT.get("cu")
    if (
        ref is not None
        and ref() is cu_seqlens
        and _LAST_LAYOUT["version"] == cu_seqlens._version
        and _LAST_LAYOUT["layout"].seq_start.numel() == total
    ):
        return _LAST_LAYOUT["layout"]
    layout = RowLayout(*document_bounds(cu_seqlens, total))
    _LAST_LAYOUT.update(cu=weakref.ref(cu_seqlens), version=cu_seqlens._version, layout=layout)
    return layout


def resolve_config(D: int, gqa: bool, device: torch.device, override: dict | None = None, max_seqlen: int = 0) -> dict:
    """The block shapes and program orders used for head dim D ({"fwd", "dkdv", "dq"} -> kernel config) on a row
    whose longest document has `max_seqlen` tokens, with `override`'s entries (per part, partial) on top."""
    base = _configs(D, gqa, device, max_seqlen >= LONG_DOC)
    override = override or {}
    unknown = set(override) - set(base)
    if unknown:
        raise ValueError(f"config parts {sorted(unknown)} unknown; expected some of {sorted(base)}")
    return {part: {**cfg, **override.get(part, {})} for part, cfg in base.items()}


def _row_head_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(stride over tokens, stride over heads) of each (T, heads, D) tensor, in order: the kernels' stride arguments."""
    return tuple(s for t in tensors for s in t.stride()[:2])


def _attention_forward(
    q, k, v, layout: RowLayout, scale: float, config: dict, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: (o, lse), o like q, lse (H, T) fp32 (base-2 log-sum-exp of the scaled scores)."""
    T, H, D = q.shape
    group = H // k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    grid, blocks, cfg = _query_launch(config["fwd"], T, H, group, layout, window)
    m, n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    args = _with_tma(cfg, dict(q=(q, m), k=(k, n), v=(v, n), o=(o, m)))
    _fwd_kernel[grid](
        args["q"],
        args["k"],
        args["v"],
        args["o"],
        lse,
        layout.seq_start,
        blocks,
        *_row_head_strides(q, k, v, o),
        T,
        D,
        H,
        scale * LOG2E,
        window,
        GROUP=group,
        BLOCK_D=_block_d(D),
        EVEN_D=_block_d(D) == D,
        PRECISION=_precision(q.dtype),
        **cfg,
    )
    return o, lse


def _attention_backward(do, q, k, v, o, lse, layout: RowLayout, scale: float, config: dict, window: int):
    """The backward kernels: (dq, dk, dv)."""
    T, H, D = q.shape
    K = k.shape[1]
    do = do.contiguous() if do.stride(-1) != 1 else do
    delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
    block_d = _block_d(D)
    _bwd_delta_kernel[(triton.cdiv(T, 64), H)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), T, D, BLOCK_M=64, BLOCK_D=block_d
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    order_kv, cfg_kv = _launch(config["dkdv"])
    cfg_kv["PACK"] = packs(cfg_kv, H // K)
    grid_q, blocks_q, cfg_q = _query_launch(config["dq"], T, H, H // K, layout, window)
    common = dict(GROUP=H // K, BLOCK_D=block_d, EVEN_D=block_d == D, PRECISION=_precision(q.dtype))
    strides_in = _row_head_strides(q, k, v, do)
    # SPLIT: dV, then dK, each in its own pass (`_bwd_dkdv_kernel`'s PART).
    split = cfg_kv.pop("SPLIT", False)
    m, n = cfg_kv["BLOCK_M"], cfg_kv["BLOCK_N"]
    kv_args = _with_tma(cfg_kv, dict(q=(q, m), k=(k, n), v=(v, n), do=(do, m), dk=(dk, n), dv=(dv, n)))
    for part in (1, 2) if split else (0,):
        _bwd_dkdv_kernel[(triton.cdiv(T, cfg_kv["BLOCK_N"]) * K,)](
            *kv_args.values(),
            lse,
            delta,
            layout.seq_start,
            layout.seq_end,
            layout.order("k", cfg_kv["BLOCK_N"], order_kv, window),
            *strides_in,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            T,
            D,
            K,
            scale * LOG2E,
            scale,
            window,
            **common,
            **cfg_kv,
            PART=part,
        )
    dq = torch.empty_like(q)
    m, n = cfg_q["BLOCK_M"], cfg_q["BLOCK_N"]
    q_args = _with_tma(cfg_q, dict(q=(q, m), k=(k, n), v=(v, n), do=(do, m), dq=(dq, m)))
    _bwd_dq_kernel[grid_q](
        *q_args.values(),
        lse,
        delta,
        layout.seq_start,
        blocks_q,
        *strides_in,
        dq.stride(0),
        dq.stride(1),
        T,
        D,
        H,
        scale * LOG2E,
        scale,
        window,
        **common,
        **cfg_q,
    )
    return dq, dk, dv


class _VarlenAttention(torch.autograd.Function):
    """The kernels with an explicit config (tuning sweeps); training calls the `sftflow::varlen_attention` op."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, config, window):
        o, lse = _attention_forward(q, k, v, layout, scale, config, window)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.layout, ctx.scale, ctx.config, ctx.window = layout, scale, config, window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = _attention_backward(do, q, k, v, o, lse, ctx.layout, ctx.scale, ctx.config, ctx.window)
        return (*grads, None, None, None, None)


def _op_forward(q, k, v, cu_seqlens, max_seqlen, scale, window):
    """(o, lse); `max_seqlen` (the longest document) picks the block shapes (`resolve_config`)."""
    T, H, D = q.shape
    config = resolve_config(D, H != k.shape[1], q.device, max_seqlen=max_seqlen)
    return _attention_forward(q, k, v, row_layout(cu_seqlens, T), scale, config, window)


def _op_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window):
    T, H, D = q.shape
    config = resolve_config(D, H != k.shape[1], q.device, max_seqlen=max_seqlen)
    return _attention_backward(do, q, k, v, o, lse, row_layout(cu_seqlens, T), scale, config, window)


# `sftflow::varlen_attention` and its backward: what compiled decoder layers call inside their graph.
varlen_attention_op, varlen_attention_backward_op = define_attention_ops("varlen_attention", _op_forward, _op_backward)


def triton_varlen_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    window: int | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal attention within documents; with `window`, each query sees at most its last `window` keys (itself
    included), as Hugging Face's sliding-window mask does.

    `config` overrides, for tuning, parts of the per-shape defaults (`resolve_config`): {"fwd" | "dkdv" | "dq":
    {BLOCK_M, BLOCK_N, num_warps, num_stages, ORDER, PACK, TMA}}, each part partial; "dkdv" also takes SPLIT (dV and
    dK in two passes).
    """
    T, H, D = q_THD.shape
    if q_THD.numel() >= 2**31 or k_TKD.numel() >= 2**31:
        raise ValueError(f"q {tuple(q_THD.shape)} has 2**31 or more elements; the kernel indexes in int32")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_THD, k_TKD, v_TKD))
    cu, window = op_arguments(cu_seqlens, q.device, window)
    if config is None:
        return varlen_attention_op(q, k, v, cu.to(torch.int32), int(max_seqlen), scale, window)[0]
    config = resolve_config(D, H != k.shape[1], q.device, config, max_seqlen=int(max_seqlen))
    return _VarlenAttention.apply(q, k, v, row_layout(cu, T), scale, config, window)
