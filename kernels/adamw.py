"""AdamW on fp32 master weights for bf16 model parameters, the master stored as the parameter plus its low bits.

``adamw_master_step_(tensors, hyper)`` updates each parameter tensor's fp32 master weight and moments from its
gradient, and writes the rounded result into the parameter the model computes with::

    g  = grad / grad_scale                         (grad in bf16 or fp32; grad_scale is the clipping factor)
    m  = beta1 m + (1 - beta1) g                   fp32 state, as torch's AdamW
    v  = beta2 v + (1 - beta2) g^2
    master = master (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    param  = bf16(master), round to nearest (ties away from zero)

Why: on one GPU the model can hold bf16 parameters and compute with them directly, with no FSDP copy-in of a bf16
copy per layer for forward and backward and no fp32 gradient copy-out (~16 ms of a 255 ms 1B-model step on an H200).
The optimizer then owns the fp32 masters.

The master is not stored as a separate fp32 tensor. Its 32 bits are the bf16 parameter's 16 bits (the master
rounded to nearest) plus a signed 16-bit remainder, ``low = bits(master) - (bits(param) << 16)``, which lies in
[-2^15, 2^15) when ties round away from zero (`split_master`). So the fp32 master is exact, and parameter +
remainder take 4 bytes per parameter, as an fp32 master alone would: the one-device path holds no more than FSDP's
fp32 parameters. The kernel moves 26 bytes per parameter (reads grad 2, param 2, low 2,
moments 8; writes param, low, moments), against 28 for torch's fused AdamW over fp32 parameters. With fp32
parameters (fp32 compute) the parameter is the master and there is no remainder.

``found_inf`` (a one-element device tensor) skips the update when set, and ``grad_scale`` divides every gradient,
both read on the device (no host sync), as torch's fused AdamW does with the same two attributes. Step counters are
per tensor (0-d fp32 on the device, torch's format) and advance only when the step is not skipped.

Backends: ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) and ``reference`` (PyTorch, the CPU default);
``SFTFLOW_ADAMW=<name>`` forces one.
"""

from __future__ import annotations

import torch

from sftflow.kernels import dispatch
from sftflow.kernels.adamw_tensors import AdamWHyper, MasterTensors

KERNEL = "adamw"
ENV_VAR = "SFTFLOW_ADAMW"

BACKENDS = dispatch.TRITON_OR_REFERENCE
PREFERENCE = dispatch.TRITON_ON_CUDA

SPLIT_CHUNK = 1 << 24  # elements split at a time: the int64 arithmetic takes ~40 bytes an element while it runs


def split_master(master: torch.Tensor, chunk: int = SPLIT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 parameter, int16 low bits) with `join_master(*split) == master`, bit for bit.

    The parameter is the master rounded to nearest, ties away from zero: adding half a bf16 step to the bit pattern
    and truncating leaves a remainder in [-2^15, 2^15), which int16 holds. (Ties to even would need one value more:
    at a tie the remainder is +2^15 or -2^15.) It is torch's bf16 cast except at exact ties, 1 in 2^16 values.

    Done `chunk` elements at a time into the two outputs, so the temporaries stay near 0.7 GB whatever the tensor
    (whole, an 8B model's 525M-element embedding would take ~21 GB of them on its device)."""
    flat = master.contiguous().view(-1)
    param = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    low = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    param_flat, low_flat = param.view(-1), low.view(-1)
    for start in range(0, flat.numel(), chunk):
        end = min(start + chunk, flat.numel())
        bits = flat[start:end].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        high = (bits + 0x8000) >> 16
        low_flat[start:end] = bits - (high << 16)
        param_flat[start:end] = torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16).view(torch.bfloat16)
    return param, low


def join_master(param: torch.Tensor, low: torch.Tensor | None, chunk: int = SPLIT_CHUNK) -> torch.Tensor:
    """The fp32 master of a bf16 `param` and its `low` bits (a new tensor); an fp32 `param` is its own master. Joined
    `chunk` elements at a time, so that the temporaries stay small beside the result."""
    if low is None:
        return param
    master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    bits, param_flat, low_flat = (
        master.view(torch.int32).view(-1),
        param.contiguous().view(-1),
        low.contiguous().view(-1),
    )
    for start in range(0, bits.numel(), chunk):
        end = min(start + chunk, bits.numel())
        bits[start:end] = param_flat[start:end].float().view(torch.int32) + low_flat[start:end].to(torch.int32)
    return master


def select_backend(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dispatch.BackendChoice:
    device = torch.device(device)
    return dispatch.select(KERNEL, ENV_VAR, BACKENDS, PREFERENCE.get(device.type, PREFERENCE["cpu"]), device, dtype)


def _check(t: MasterTensors) -> None:
    moments = (t.exp_avg, t.exp_avg_sq)
    if any(x.dtype != torch.float32 for x in moments) or t.step.dtype != torch.float32:
        raise ValueError("adamw: exp_avg, exp_avg_sq and step must be fp32")
    split = (torch.bfloat16, torch.int16)
    if (t.param.dtype, None if t.low is None else t.low.dtype) not in (split, (torch.float32, None)):
        raise ValueError(
            f"adamw: a {t.param.dtype} param with low bits {None if t.low is None else t.low.dtype}; expected a bf16 "
            "param with int16 low bits, or an fp32 param without"
        )
    tensors = [t.param, t.grad, *moments] + ([] if t.low is None else [t.low])
    if any(x.shape != t.param.shape for x in tensors):
        raise ValueError(f"adamw: shapes differ: {[tuple(x.shape) for x in tensors]} (param, grad, moments, low)")
    if not all(x.is_contiguous() for x in tensors):
        raise ValueError("adamw: param, grad, moments and low bits must be contiguous")


def advance_steps_(steps: list[torch.Tensor], found_inf: torch.Tensor | None = None) -> None:
    """Add 1 to every step counter, or 0 when `found_inf` is set: one `foreach` launch, no host sync."""
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        # A list of 0-d tensors, not the 0-d tensor itself: given one tensor, `_foreach_add_` takes the Scalar
        # overload, which reads it with `.item()`, a host sync that kept the optimizer from being queued until the
        # whole backward had run on the GPU.
        increment = (1.0 - found_inf.float()).reshape(())
        torch._foreach_add_(steps, [increment] * len(steps))


def adamw_master_step_reference(
    tensors: list[MasterTensors],
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """The update in plain PyTorch, fp32 math, one tensor at a time (the oracle; checks `found_inf` on the host).
    Reads the step counters as already advanced (`advance_steps_`), as the Triton kernel does."""
    if found_inf is not None and bool(found_inf.item()):
        return
    for t in tensors:
        g = t.grad.float()
        if grad_scale is not None:
            g = g / grad_scale
        t.exp_avg.lerp_(g, 1 - hyper.beta1)
        t.exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
        bias1 = 1 - hyper.beta1**t.step
        bias2_sqrt = (1 - hyper.beta2**t.step).sqrt()
        master = join_master(t.param, t.low)
        master.mul_(1 - hyper.lr * hyper.weight_decay)
        denom = t.exp_avg_sq.sqrt() / bias2_sqrt + hyper.eps
        master.sub_(hyper.lr / bias1 * t.exp_avg / denom)
        if t.low is not None:
            param, low = split_master(master)
            t.param.copy_(param)
            t.low.copy_(low)


def adamw_master_step_(
    tensors: list[MasterTensors],
    hyper: AdamWHyper,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    *,
    advance_steps: bool = True,
    check: bool = True,
    backend: str | None = None,
) -> None:
    """One AdamW step over `tensors` in place (see the module docstring), on the dispatched backend (or `backend`).

    `advance_steps=False`: the caller has advanced the step counters already (`advance_steps_`, once for all its
    parameter groups). `check=False`: the caller has checked the tensors' dtypes, shapes and layouts (per-tensor
    checks cost ~10 us of host time each, at the one point of the step where the GPU may wait on the host)."""
    if not tensors:
        return
    if check:
        for t in tensors:
            _check(t)
    if backend is None:
        backend = select_backend(tensors[0].param.device, tensors[0].param.dtype).name
    elif backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not an {KERNEL} backend; expected one of {sorted(BACKENDS)}")
    if advance_steps:
        advance_steps_([t.step for t in tensors], found_inf)
    if backend == "reference":
        adamw_master_step_reference(tensors, hyper, grad_scale, found_inf)
        return
    from sftflow.kernels.adamw_triton import adamw_master_step_triton_

    adamw_master_step_triton_(tensors, hyper, grad_scale, found_inf)
