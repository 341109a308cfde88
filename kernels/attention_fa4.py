"""FlashAttention-4 (the `flash-attn-4` package: FlashAttention in NVIDIA's CuTe DSL) as `torch.library` ops.

On Hopper (sm_90) and newer, FlashAttention-4's varlen forward and backward run long documents at ~88% of the bf16
matmul rate where sftflow's Triton kernels reach 56-60% (`benchmarks/RESULTS.md`). Its own entry point
(`flash_attn.cute.flash_attn_varlen_func`) is an `autograd.Function` that a compiled decoder layer cannot trace: a
graph break in every layer, three graphs where one would do, and the host time of the break on every call. Here its
forward and backward are two custom ops with fake implementations, as the Triton kernels are, so a compiled layer
calls them inside its graph and the gradient reaches the backward in the layout the forward left.

Semantics are the other backends': causal within each document of a packed row (`cu_seqlens`), GQA as GQA (K/V
heads are not repeated), and `window` keys at most per query, itself included (FlashAttention's left window is
`window - 1`).

Determinism. FlashAttention's backward adds each query block's dQ (and, under GQA, each group's dK/dV) from many
thread blocks with atomics, in whatever order they finish, so two runs of a step can differ in the last bits.
sftflow's GPU step is otherwise deterministic (a resumed run repeats the uninterrupted one bit for bit), so the
backward runs in FlashAttention's deterministic mode (semaphores fix the order) unless `SFTFLOW_FA4_DETERMINISTIC=0`;
`benchmarks/RESULTS.md` gives its cost.

Install: `pip install flash-attn-4` (or sftflow's `hopper` extra). The first call of each shape compiles its kernels
(tens of seconds); `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1` keeps them on disk for later processes.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from sftflow.kernels.attention_ops import NO_WINDOW, define_attention_ops, op_arguments

HALF = (torch.float16, torch.bfloat16)


def unavailable_reason(
    device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> str | None:
    """None when FlashAttention-4 can run on `device` with `dtype`, else why not (`capability`: the GPU's, where it
    is known without asking the device)."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "flash-attn-4 is not installed (pip install flash-attn-4)"
    if device.type != "cuda":
        return f"FlashAttention-4 needs CUDA, tensors are on {device.type}"
    if dtype not in HALF:
        return f"FlashAttention-4 needs fp16/bf16, got {dtype}"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if major < 9:
        return f"FlashAttention-4 needs sm_90 (Hopper) or newer; this GPU is sm_{major}{minor}"
    return None


# Head dims whose forward and backward sftflow checked against the float64 reference on an H100 (2026-12-06,
# flash-attn-4 4.0.0b36): 32, 64, 96, 128 and 256 agree to bf16 rounding. At 16, 48 and 80 the forward is right and
# the backward is not (dQ, dK and dV off by their own size; at 80, dQ), so those and every head dim not checked go
# to the Triton kernels: a wrong gradient trains silently.
VERIFIED_HEAD_DIMS = (32, 64, 96, 128, 256)


def head_dim_reason(head_dim: int, device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """None when FlashAttention-4 takes heads of `head_dim` on `device`'s architecture, else why not."""
    if head_dim not in VERIFIED_HEAD_DIMS:
        return (
            f"FlashAttention-4 is used at head dims {list(VERIFIED_HEAD_DIMS)}, the ones whose gradients sftflow "
            f"checked; {head_dim} is not one of them"
        )
    on_gpu = device.type == "cuda" and (capability is not None or torch.cuda.is_available())
    if on_gpu:
        major = (capability or torch.cuda.get_device_capability(device))[0]
    else:
        major = 9  # read as Hopper's rules
    if major in (10, 11) and not (head_dim <= 128 or head_dim == 256):
        return f"FlashAttention-4 on sm_{major}x takes head dims up to 128, or 256, got {head_dim}"
    if major == 9 and head_dim == 256 and deterministic():
        # The fixed-order dQ sums cost most at the largest head dim: there the Triton kernels win on packed and long
        # rows alike (benchmarks/results/attention.jsonl), and the nondeterministic mode wins over both.
        return (
            "FlashAttention-4's deterministic backward at head dim 256 runs slower than the Triton kernels on sm_90 "
            "(SFTFLOW_FA4_DETERMINISTIC=0 takes FlashAttention-4, summing in no fixed order)"
        )
    return None


def deterministic() -> bool:
    """Whether the backward fixes the order of its sums (`SFTFLOW_FA4_DETERMINISTIC`, on unless set to 0)."""
    return os.environ.get("SFTFLOW_FA4_DETERMINISTIC", "1").strip() != "0"


def _windows(window: int) -> tuple[int | None, int | None]:
    """FlashAttention's (left, right) for a causal window of `window` keys; (None, None) is plain causal."""
    return (None, None) if window >= NO_WINDOW else (window - 1, 0)


def _op_forward(q, k, v, cu_seqlens, max_seqlen, scale, window):
    from flash_attn.cute.interface import _flash_attn_fwd

    left, right = _windows(window)
    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=True,
        window_size_left=left,
        window_size_right=right,
        return_lse=True,
    )
    return out, lse


def _op_backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window):
    from flash_attn.cute.interface import _flash_attn_bwd

    left, right = _windows(window)
    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        o,
        do,
        lse,
        scale,
        True,
        window_size_left=left,
        window_size_right=right,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        deterministic=deterministic(),
    )
    return dq, dk, dv


# `sftflow::fa4_varlen_attention` and its backward: what compiled decoder layers call inside their graph.
fa4_attention_op, fa4_attention_backward_op = define_attention_ops("fa4_varlen_attention", _op_forward, _op_backward)


def fa4_varlen_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within documents on FlashAttention-4; with `window`, each query sees at most its last `window`
    keys (itself included). Differentiable; traced by `torch.compile` as one op each way."""
    # Contiguous: FlashAttention-4 writes o, dq, dk and dv contiguous whatever its inputs' strides, and the ops' fake
    # kernels promise the inputs' layout (`empty_like`), which a compiled graph checks.
    q, k, v = (x.contiguous() for x in (q_THD, k_TKD, v_TKD))
    cu, window = op_arguments(cu_seqlens, q.device, window)
    return fa4_attention_op(q, k, v, cu.to(torch.int32), int(max_seqlen), scale, window)[0]
