"""Triton step of the fused linear cross-entropy: per row, CE loss and d loss / d logits written over the logits.

One program per row makes two passes over the row's V logits: an online max / sum-exp (fp32), then
``softmax - onehot(target)`` stored back in the logits' dtype. Imported lazily by ``cross_entropy`` so that
``TRITON_INTERPRET=1`` can be set before triton is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per step and warps per row program, from the H200 sweep in benchmarks/cross_entropy.py --kernel-sweep.
BLOCK_V_MAX = 32768
NUM_WARPS = 32
SCALE_BLOCK = 4096


@triton.jit
def _ce_loss_and_grad_kernel(
    logits_ptr, stride_row, target_ptr, loss_ptr, correct_ptr, V, BLOCK_V: tl.constexpr, HAS_CORRECT: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: running max m and running sum of exp(x - m), in fp32.
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    for v0 in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    x_target = tl.load(base + target).to(tl.float32)
    tl.store(loss_ptr + row, (lse - x_target).to(loss_ptr.dtype.element_ty))
    if HAS_CORRECT:  # the row's max is at hand: token accuracy costs one store, not another pass over the logits
        tl.store(correct_ptr + row, (x_target >= m).to(correct_ptr.dtype.element_ty))

    # Pass 2: overwrite the logits with softmax - onehot(target).
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        p = tl.where(cols == target, p - 1.0, p)
        tl.store(base + cols, p.to(logits_ptr.dtype.element_ty), mask=cols < V)


def ce_loss_and_grad_(
    logits_CV: torch.Tensor,
    target_C: torch.Tensor,
    loss_C: torch.Tensor | None = None,
    correct_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row CE loss (fp32, shape (C,), written into `loss_C` when given); `logits_CV` is overwritten with
    softmax - onehot(target). With `correct_C` ((C,), contiguous), also 1 where the target's logit is the row's
    largest, else 0."""
    C, V = logits_CV.shape
    assert logits_CV.stride(1) == 1, "logits rows must be contiguous"
    if loss_C is None:
        loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    assert loss_C.shape == (C,) and loss_C.is_contiguous(), "loss_C must be a contiguous (C,) tensor"
    assert correct_C is None or (correct_C.shape == (C,) and correct_C.is_contiguous()), "correct_C must be (C,)"
    if C == 0:
        return loss_C
    block_v = min(triton.next_power_of_2(V), BLOCK_V_MAX)
    _ce_loss_and_grad_kernel[(C,)](
        logits_CV,
        logits_CV.stride(0),
        target_C.contiguous(),
        loss_C,
        loss_C if correct_C is None else correct_C,  # not read or written without HAS_CORRECT
        V,
        BLOCK_V=block_v,
        HAS_CORRECT=correct_C is not None,
        num_warps=NUM_WARPS,
    )
    return loss_C


@triton.jit
def _scale_kernel(x_ptr, s_ptr, n, BLOCK: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:  # every program reads the scale on the device and exits at once when it is 1
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x_ptr.dtype.element_ty), mask=offs < n)


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`x *= s` in place (fp32 math), `s` a one-element tensor on x's device; no pass over x when s == 1.

    The backward scales the gradients that the forward precomputed by the incoming gradient. That is 1 when the CE
    sum is the loss, and a pass over (V, D) is then wasted; checking it on the host would cost a sync, so the kernel
    checks it on the device instead."""
    assert x.is_contiguous() and s.numel() == 1, "x must be contiguous and s a one-element tensor"
    if x.numel():
        _scale_kernel[(triton.cdiv(x.numel(), SCALE_BLOCK),)](x, s, x.numel(), BLOCK=SCALE_BLOCK, num_warps=8)
    return x
