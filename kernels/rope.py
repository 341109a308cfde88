"""Rotary position embedding as one fused op for forward and backward, keeping the projections' memory layout.

``rotary(x_BHTD, cos_BTD, sin_BTD)`` returns what Llama's ``x * cos + rotate_half(x) * sin`` gives (halves
``[x1, x2]`` -> ``[x1*c1 - x2*s1, x2*c2 + x1*s2]``) for q or k as Hugging Face passes them: (B, H, T, D) views of the
projections' (B, T, H, D) output. The Triton path reads and writes that memory layout as it is.

Why a kernel: under ``torch.compile`` (regional, dynamic shapes) inductor's RoPE ran at ~0.4 TB/s on an H200, about
9 ms of a 272 ms 1B-model step (``benchmarks/RESULTS.md``), where a pass over q and k is a few hundred
microseconds. The backward is the transposed rotation, so both directions are one kernel.

It is a ``torch.library`` custom op (``sftflow::rotary``): compiled graphs call it without a graph break, and its
backward is registered with it. Backends: ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) and ``reference``
(PyTorch, the CPU default); ``SFTFLOW_ROPE=<name>`` forces one.
"""

from __future__ import annotations

import torch

from sftflow.kernels import dispatch

KERNEL = "rope"
ENV_VAR = "SFTFLOW_ROPE"


BACKENDS = dispatch.TRITON_OR_REFERENCE
PREFERENCE = dispatch.TRITON_ON_CUDA


def select_backend(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dispatch.BackendChoice:
    device = torch.device(device)
    return dispatch.select(KERNEL, ENV_VAR, BACKENDS, PREFERENCE.get(device.type, PREFERENCE["cpu"]), device, dtype)


def rotary_reference(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, transpose: bool = False):
    """The rotation (or its transpose, the backward) in PyTorch, fp32 math (fp64 for fp64), output in x's dtype."""
    half = x_BHTD.shape[-1] // 2
    math_dtype = torch.promote_types(x_BHTD.dtype, torch.float32)
    x = x_BHTD.to(math_dtype)
    c, s = cos_BTD.to(math_dtype).unsqueeze(1), sin_BTD.to(math_dtype).unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        out = torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    else:
        out = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)
    return out.to(x_BHTD.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    if select_backend(x.device, x.dtype).name == "reference":
        # the op's contract (and its fake) is "x's strides": compiled graphs check it
        return torch.empty_like(x).copy_(rotary_reference(x, cos, sin, transpose))
    from sftflow.kernels.rope_triton import rope_bhtd

    return rope_bhtd(x, cos, sin, transpose)


@torch.library.custom_op("sftflow::rotary", mutates_args=())
def _rotary_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, transpose)


@_rotary_op.register_fake
def _(x, cos, sin, transpose):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    _, cos, sin, transpose = inputs
    ctx.save_for_backward(cos, sin)
    ctx.transpose = transpose


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rotary_op(grad, cos, sin, not ctx.transpose), None, None, None


_rotary_op.register_autograd(_backward, setup_context=_setup_context)


def rotary(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    """Llama-style RoPE of `x_BHTD` (B, H, T, D), any strides, with `cos_BTD`/`sin_BTD` (B, T, D); differentiable in
    x only. On the Triton path the output keeps x's strides (the projections' (B, T, H, D) memory layout)."""
    B, H, T, D = x_BHTD.shape if x_BHTD.ndim == 4 else (None,) * 4
    if x_BHTD.ndim != 4 or cos_BTD.shape != (B, T, D) or sin_BTD.shape != cos_BTD.shape:
        raise ValueError(
            f"rotary: x {tuple(x_BHTD.shape)} and cos/sin {tuple(cos_BTD.shape)} are not (B, H, T, D) and (B, T, D)"
        )
    if D % 2:
        raise ValueError(f"rotary: head dim {D} is odd")
    return _rotary_op(x_BHTD, cos_BTD.detach(), sin_BTD.detach(), False)
