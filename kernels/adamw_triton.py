"""Triton AdamW step on fp32 master weights: one launch per parameter tensor, one pass over its arrays.

Each program updates BLOCK elements. With bf16 parameters (SPLIT) it rebuilds the fp32 master from the parameter's
bits and the int16 low bits, updates it, and writes both halves back: the parameter rounded to nearest even and the
remainder (`sftflow.kernels.adamw` explains the split). The rounding is done on the bit pattern, so the GPU and
Triton's CPU interpreter (whose fp32 -> bf16 cast truncates) give the same bits. With fp32 parameters the parameter
is the master. The step counters are advanced before (`adamw.advance_steps_`, one `foreach` add on the device), so
every program reads the same, new step. Imported lazily by ``adamw`` so that ``TRITON_INTERPRET=1`` can be set
before triton is imported.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sftflow.kernels.adamw_tensors import AdamWHyper, MasterTensors

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _adamw_master_kernel(
    param_ptr,
    low_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    step_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    n,
    lr,
    beta1,
    beta2,
    eps,
    decay,
    log2_beta1,
    log2_beta2,
    SPLIT: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    skip = False
    if HAS_FOUND_INF:
        skip = tl.load(found_inf_ptr) != 0
    if not skip:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GRAD_SCALE:
            g = g / tl.load(grad_scale_ptr).to(tl.float32)
        if SPLIT:
            high = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
            low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
            w = ((high << 16) + low).to(tl.float32, bitcast=True)  # modulo 2^32, as the split was made
        else:
            w = tl.load(param_ptr + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        step = tl.load(step_ptr)
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp_(g, 1 - beta1)
        v = beta2 * v + (1.0 - beta2) * g * g
        bias1 = 1.0 - tl.exp2(step * log2_beta1)
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        w = w * decay - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if SPLIT:
            bits = w.to(tl.uint32, bitcast=True)
            high = (bits + 0x8000) >> 16  # round to nearest, ties away from zero (as `split_master`)
            low = (bits - (high << 16)).to(tl.int32, bitcast=True)  # in [-2^15, 2^15)
            tl.store(param_ptr + offs, high.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
            tl.store(low_ptr + offs, low.to(tl.int16), mask=mask)
        else:
            tl.store(param_ptr + offs, w, mask=mask)


def _log2(beta: float) -> float:
    return math.log2(beta) if beta > 0 else float("-inf")


def adamw_master_step_triton_(
    tensors: list[MasterTensors],
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The kernels only: the step counters must have been advanced already (`adamw.advance_steps_`)."""
    dummy = tensors[0].step  # stands for an absent pointer (never read)
    lr, beta1, beta2, eps = float(hyper.lr), float(hyper.beta1), float(hyper.beta2), float(hyper.eps)
    decay = 1.0 - lr * float(hyper.weight_decay)
    for t in tensors:
        n = t.param.numel()
        if n == 0:
            continue
        _adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
            t.param,
            dummy if t.low is None else t.low,
            t.grad,
            t.exp_avg,
            t.exp_avg_sq,
            t.step,
            dummy if grad_scale is None else grad_scale,
            dummy if found_inf is None else found_inf,
            n,
            lr,
            beta1,
            beta2,
            eps,
            decay,
            _log2(beta1),
            _log2(beta2),
            SPLIT=t.low is not None,
            HAS_GRAD_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
