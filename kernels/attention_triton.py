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

GQA: query head h reads kv head h // (H / K) through strides, nothing is expanded; the dK/dV program of a kv head
loops over its query heads. Softmax runs in base 2 (exp2) on fp32 scores; the forward saves the per-row
log-sum-exp for the backward. Imported lazily by ``attention`` so TRITON_INTERPRET can be set first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# Block shapes per head dim, from the H200 sweep in benchmarks/attention.py (see benchmarks/RESULTS.md). The backward
# runs two kernels: dK/dV (a program per key block) and dQ (a program per query block), each with its own shape.
FWD_CONFIGS = {
    64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    128: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4),
}
BWD_CONFIGS = {
    64: {
        "dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
        "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
    },
    128: {
        "dkdv": dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
        "dq": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
    },
}
# With GQA each dK/dV program loops over its group's query heads: at D=64 taller query tiles win (2026-11-30 sweep,
# H=32 K=8: 1.47 ms fwd+bwd against 1.53 ms with the K=H shape).
BWD_CONFIGS_GQA = {64: {**BWD_CONFIGS[64], "dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)}}
SMALL_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)  # the CPU interpreter and odd head dims


@triton.jit
def _fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    seq_start_ptr,
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
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    kh = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    start_m = tl.load(seq_start_ptr + offs_m, mask=row_ok, other=T)
    lo = tl.load(seq_start_ptr + m0)
    hi = tl.minimum(m0 + BLOCK_M, T)
    start_last = tl.load(seq_start_ptr + hi - 1)  # the largest start among the block's rows

    q = tl.load(
        q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < T
        k = tl.load(
            k_ptr + offs_n[:, None] * stride_kt + kh * stride_kh + offs_d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + offs_n[:, None] * stride_vt + kh * stride_vh + offs_d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if (n0 + BLOCK_N > m0 + 1) | (start_last > n0) | (m0 + BLOCK_M > T):  # not a block fully inside one doc
            visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= start_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    tl.store(
        o_ptr + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + h * T + offs_m, m_i + tl.log2(l_safe), mask=row_ok)


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
    qk_scale,
    scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    kh = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < D
    start_m = tl.load(seq_start_ptr + offs_m, mask=row_ok, other=T)
    lo = tl.load(seq_start_ptr + m0)
    hi = tl.minimum(m0 + BLOCK_M, T)
    start_last = tl.load(seq_start_ptr + hi - 1)  # the largest start among the block's rows
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(do_ptr + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(lse_ptr + h * T + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + h * T + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < T
        k = tl.load(
            k_ptr + offs_n[:, None] * stride_kt + kh * stride_kh + offs_d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + offs_n[:, None] * stride_vt + kh * stride_vh + offs_d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.exp2(s - lse[:, None])
        if (n0 + BLOCK_N > m0 + 1) | (start_last > n0) | (m0 + BLOCK_M > T):
            visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= start_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        dq_ptr + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=qd_mask,
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
    qk_scale,
    scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    kh = tl.program_id(1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < T
    d_ok = offs_d < D
    kd_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + offs_n[:, None] * stride_kt + kh * stride_kh + offs_d[None, :], mask=kd_mask, other=0.0)
    v = tl.load(v_ptr + offs_n[:, None] * stride_vt + kh * stride_vh + offs_d[None, :], mask=kd_mask, other=0.0)
    # Queries that can see a key of this block: from the block itself to the end of its last key's document.
    q_hi = tl.load(seq_end_ptr + tl.minimum(n0 + BLOCK_N, T) - 1)
    q_lo = n0 // BLOCK_M * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):
        h = kh * GROUP + g
        for m0 in range(q_lo, q_hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            qd_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
            do = tl.load(
                do_ptr + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0
            )
            start_m = tl.load(seq_start_ptr + offs_m, mask=row_ok, other=T)
            lse = tl.load(lse_ptr + h * T + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + h * T + offs_m, mask=row_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
            p_t = tl.exp2(s_t - lse[None, :])
            start_last = tl.load(seq_start_ptr + tl.minimum(m0 + BLOCK_M, T) - 1)
            if (n0 + BLOCK_N > m0 + 1) | (start_last > n0) | (m0 + BLOCK_M > T):
                visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_n[:, None] >= start_m[None, :])
                p_t = tl.where(visible, p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    tl.store(
        dk_ptr + offs_n[:, None] * stride_dkt + kh * stride_dkh + offs_d[None, :],
        (dk * scale).to(dk_ptr.dtype.element_ty),
        mask=kd_mask,
    )
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


def _config(table: dict, D: int, device: torch.device, override: dict | None, part: str | None = None) -> dict:
    if override is not None:
        return dict(override[part] if part else override)
    if device.type != "cuda":
        return dict(SMALL_CONFIG)
    entry = table.get(D) or table[64 if D < 64 else 128]
    return dict(entry[part] if part else entry)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 dots (tests); ignored for 16-bit


def document_bounds(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the first and one-past-last token of its document (int32, on cu_seqlens' device; no sync)."""
    cu = cu_seqlens.to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    seq_start = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    seq_end = torch.repeat_interleave(cu[1:], lengths, output_size=total)
    return seq_start, seq_end


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_start, seq_end, scale, fwd_config, bwd_config):
        T, H, D = q.shape
        group = H // k.shape[1]
        o = torch.empty_like(q)
        lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
        cfg = _config(FWD_CONFIGS, D, q.device, fwd_config)
        grid = (triton.cdiv(T, cfg["BLOCK_M"]), H)
        _fwd_kernel[grid](
            q,
            k,
            v,
            o,
            lse,
            seq_start,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            o.stride(0),
            o.stride(1),
            T,
            D,
            scale * LOG2E,
            GROUP=group,
            BLOCK_D=max(16, triton.next_power_of_2(D)),
            PRECISION=_precision(q.dtype),
            **cfg,
        )
        ctx.save_for_backward(q, k, v, o, lse, seq_start, seq_end)
        ctx.scale = scale
        ctx.bwd_config = bwd_config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, seq_start, seq_end = ctx.saved_tensors
        T, H, D = q.shape
        K = k.shape[1]
        do = do.contiguous() if do.stride(-1) != 1 else do
        delta = torch.empty((H, T), dtype=torch.float32, device=q.device)
        block_d = max(16, triton.next_power_of_2(D))
        _bwd_delta_kernel[(triton.cdiv(T, 64), H)](
            o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), T, D, BLOCK_M=64, BLOCK_D=block_d
        )
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        table = BWD_CONFIGS_GQA if H != K and D in BWD_CONFIGS_GQA else BWD_CONFIGS
        cfg_kv = _config(table, D, q.device, ctx.bwd_config, "dkdv")
        cfg_q = _config(table, D, q.device, ctx.bwd_config, "dq")
        common = dict(GROUP=H // K, BLOCK_D=block_d, PRECISION=_precision(q.dtype))
        strides_in = (
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            do.stride(0),
            do.stride(1),
        )
        _bwd_dkdv_kernel[(triton.cdiv(T, cfg_kv["BLOCK_N"]), K)](
            q,
            k,
            v,
            do,
            dk,
            dv,
            lse,
            delta,
            seq_start,
            seq_end,
            *strides_in,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            T,
            D,
            ctx.scale * LOG2E,
            ctx.scale,
            **common,
            **cfg_kv,
        )
        _bwd_dq_kernel[(triton.cdiv(T, cfg_q["BLOCK_M"]), H)](
            q,
            k,
            v,
            do,
            dq,
            lse,
            delta,
            seq_start,
            *strides_in,
            dq.stride(0),
            dq.stride(1),
            T,
            D,
            ctx.scale * LOG2E,
            ctx.scale,
            **common,
            **cfg_q,
        )
        return dq, dk, dv, None, None, None, None, None


def triton_varlen_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    fwd_config: dict | None = None,
    bwd_config: dict | None = None,
) -> torch.Tensor:
    """Causal attention within documents.

    `fwd_config` ({BLOCK_M, BLOCK_N, num_warps, num_stages}) and `bwd_config` ({"dkdv": {...}, "dq": {...}}) override
    the block shapes, for tuning.
    """
    T, H, D = q_THD.shape
    if q_THD.numel() >= 2**31 or k_TKD.numel() >= 2**31:
        raise ValueError(f"q {tuple(q_THD.shape)} has 2**31 or more elements; the kernel indexes in int32")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_THD, k_TKD, v_TKD))
    seq_start, seq_end = document_bounds(cu_seqlens.to(q.device), T)
    return _VarlenAttention.apply(q, k, v, seq_start, seq_end, scale, fwd_config, bwd_config)
