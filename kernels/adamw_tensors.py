"""What an AdamW master step reads: one parameter's tensors and the hyper-parameters, shared by the step's backends
(`sftflow.kernels.adamw` and its Triton kernel, which it imports lazily) so neither imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class MasterTensors:
    """One parameter's tensors: `param` (bf16 or fp32: what the model computes with), `grad` (param's shape, any
    float dtype), `low` (int16, the master's low bits, for bf16 params; None for fp32 params, which are their own
    master), fp32 `exp_avg` and `exp_avg_sq`, and the 0-d fp32 `step`."""

    param: torch.Tensor
    grad: torch.Tensor
    low: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
