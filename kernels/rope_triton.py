"""Triton rotary embedding of a (B, H, T, D) tensor of any strides; forward and its transpose (the backward).

One program per token (b, t): it loads the token's cos/sin once and rotates every head. The output has the input's
strides, so q/k stay in the layout the projections wrote ((B, T, H, D) in memory) and the token's heads are one
contiguous run. Imported lazily by ``rope`` so that ``TRITON_INTERPRET=1`` can be set before triton is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    sxb,
    sxh,
    sxt,
    sxd,
    scb,
    sct,
    scd,
    sob,
    soh,
    sot,
    sod,
    T,
    H,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    jmask = j < HALF
    mask = (h < H) & jmask
    cs = cos_ptr + b * scb + t * sct
    sn = sin_ptr + b * scb + t * sct
    c1 = tl.load(cs + j * scd, mask=jmask, other=0.0).to(tl.float32)
    c2 = tl.load(cs + (HALF + j) * scd, mask=jmask, other=0.0).to(tl.float32)
    s1 = tl.load(sn + j * scd, mask=jmask, other=0.0).to(tl.float32)
    s2 = tl.load(sn + (HALF + j) * scd, mask=jmask, other=0.0).to(tl.float32)
    xr = x_ptr + b * sxb + t * sxt + h * sxh
    x1 = tl.load(xr + j * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xr + (HALF + j) * sxd, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # the gradient: R^T g with R = [[c1, -s1], [s2, c2]] per pair
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    orow = out_ptr + b * sob + t * sot + h * soh
    tl.store(orow + j * sod, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(orow + (HALF + j) * sod, y2.to(out_ptr.dtype.element_ty), mask=mask)


def rope_bhtd(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, transpose: bool) -> torch.Tensor:
    """Rotate every head of every token; `transpose` applies the transposed rotation (the backward). The output has
    `x_BHTD`'s strides when those are dense (else contiguous)."""
    B, H, T, D = x_BHTD.shape
    out = torch.empty_like(x_BHTD)
    if out.numel() == 0:
        return out
    if cos_BTD.stride() != sin_BTD.stride():
        sin_BTD = sin_BTD.contiguous()
        cos_BTD = cos_BTD.contiguous()
    half = D // 2
    _rope_kernel[(B * T,)](
        x_BHTD,
        cos_BTD,
        sin_BTD,
        out,
        *x_BHTD.stride(),
        *cos_BTD.stride(),
        *out.stride(),
        T,
        H,
        half,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_HALF=triton.next_power_of_2(half),
        TRANSPOSE=transpose,
        num_warps=4,
    )
    return out
