"""The pair of `torch.library` ops each in-graph attention backend is: a forward `(q, k, v, cu_seqlens, max_seqlen,
scale, window) -> (o, lse)` and its backward, with fake kernels, the autograd link between them and FLOP formulas.

As custom ops, a compiled decoder layer calls the kernels inside its graph: no graph break around the attention, no
host time spent at one, and the gradient reaches the kernels in the layout they produced. (At a graph break, the
compiled backward made each q, k and v gradient contiguous in the (B, H, T, D) shape Hugging Face hands over, a
transposing copy of ~2.4 ms per 1B-model step on an H200.)

Shapes: q (T, H, D), k and v (T, K, D) with stride 1 in D, int32 `cu_seqlens` on their device; o like q, lse (H, T)
float32. `max_seqlen` is the longest document; `window`: each query sees at most this many keys, itself included
(`NO_WINDOW`: its whole document so far).

FLOPs, for torch's flop counter and for the compiler's choice of what to recompute in the backward
(`torch._functorch.config.activation_memory_budget`), which counts an op without a formula as free and would run the
attention again rather than keep its output. The documents' lengths are data, not shapes: each query is counted as
seeing half of the longest document (or window). The backward makes five block products to the forward's two (dS,
dP, dV, dK, dQ): 2.5x the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

NO_WINDOW = (
    2**30
)  # "no sliding window": larger than any row (kernels compare positions with position - window in int32)


def op_arguments(cu_seqlens: torch.Tensor, device: torch.device, window: int | None) -> tuple[torch.Tensor, int]:
    """The ops' `cu_seqlens` (on `device`) and `window` (`NO_WINDOW` for none), checked."""
    cu = cu_seqlens if cu_seqlens.device == device else cu_seqlens.to(device)
    window = NO_WINDOW if window is None else min(int(window), NO_WINDOW)
    if window < 1:
        raise ValueError(f"window={window}: a query must see at least itself")
    return cu, window


def attention_flops(q_shape, max_seqlen: int, window: int) -> int:
    T, H, D = q_shape
    return 2 * 2 * T * H * D * max(min(max_seqlen, window, T) // 2, 1)


def define_attention_ops(name: str, forward: Callable, backward: Callable):
    """Register `sftflow::<name>` and `sftflow::<name>_backward` around `forward(q, k, v, cu_seqlens, max_seqlen,
    scale, window) -> (o, lse)` and `backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window) -> (dq, dk,
    dv)`; returns the two ops."""

    @torch.library.custom_op(f"sftflow::{name}", mutates_args=())
    def forward_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, cu_seqlens, max_seqlen, scale, window)

    @forward_op.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale, window):
        return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.custom_op(f"sftflow::{name}_backward", mutates_args=())
    def backward_op(
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window)

    @backward_op.register_fake
    def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale, window):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, scale, window = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.window = max_seqlen, scale, window

    def backward_of(ctx, grad_o, grad_lse):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = backward_op(grad_o, q, k, v, o, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None, None

    forward_op.register_autograd(backward_of, setup_context=setup_context)

    @register_flop_formula(getattr(torch.ops.sftflow, name))
    def _(q_shape, k_shape, v_shape, cu_shape, max_seqlen, scale, window, *args, out_shape=None, **kwargs) -> int:
        return attention_flops(q_shape, max_seqlen, window)

    @register_flop_formula(getattr(torch.ops.sftflow, f"{name}_backward"))
    def _(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, cu_shape, max_seqlen, scale, window, *args,
          out_shape=None, **kwargs) -> int:  # fmt: skip
        return 5 * attention_flops(q_shape, max_seqlen, window) // 2

    return forward_op, backward_op
