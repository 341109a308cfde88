"""Training on one device without FSDP: the model computes with bf16 parameters, the optimizer owns fp32 masters.

On one GPU, FSDP2 has nothing to shard, yet it still copies every layer's fp32 parameters into a bf16 buffer before
its forward and again before its backward, and copies each bf16 gradient out into an fp32 one: ~16 ms of a 255 ms
1B-model step on an H200. Here instead::

    model parameters   bf16 (compute dtype), used as they are by forward and backward
    master weights     fp32, held as the bf16 parameter + an int16 `master_low` per parameter (exact; see
                       `sftflow.kernels.adamw`): 4 bytes per parameter, like FSDP's fp32 parameters
    gradients          bf16 as autograd makes them; fp32 once a second micro-batch adds to them
    optimizer state    exp_avg, exp_avg_sq (fp32), step: per parameter, torch's AdamW format
    optimizer step     one pass per tensor (`sftflow.kernels.adamw`)

Memory is at most FSDP's at world size 1: 4 (master) + 8 (moments) bytes per parameter, plus the gradients (2 bytes
with one micro-batch per step, 4 with several; FSDP keeps 4). With fp32 compute the parameter is its own master.

Gradient accumulation stays in fp32: a hook after each parameter's gradient accumulation takes the gradient away
from `param.grad` (so autograd never adds in bf16). The first micro-batch's bf16 gradient is kept as it is (no copy);
a second one turns it into an fp32 sum. The optimizer reads these gradients (`gradients()`); `param.grad` stays None.

With `in_backward`, the same hook steps the parameter at once and drops its gradient (gradient release): no step
ever holds the model's gradients, 2 bytes a parameter less (15 GiB of an 8B model), which a long row on one GPU
spends on activations instead of recomputing them. The price: no global-norm clipping (the norm is known only once
the last gradient is made, after most parameters have moved) and no whole-step skip on a non-finite gradient (a
tensor whose gradient is not finite keeps its values and moments; the others step). One micro-batch a step only.

With `offload` (units of parameters), those parameters' moments live in pinned host memory and pass through the
device for their step (`sftflow.tasks.train.host_moments`): 8 bytes a parameter less on the device, 16 over the host
link each step. It works with either way of stepping.

Checkpoints hold exactly what the FSDP path holds: the `model` component is the fp32 masters (each joined as the
checkpoint writer reaches it) under the Hugging Face names (`MasterModelState`), and the optimizer state has torch
AdamW's keys, so a run saved here resumes under FSDP on any number of ranks and the other way round. Buffers (RoPE's
`inv_freq`) are not cast: FSDP's mixed precision leaves them fp32 too.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from sftflow.kernels.adamw import (
    AdamWHyper,
    MasterTensors,
    adamw_master_step_,
    advance_steps_,
    join_master,
    split_master,
)
from sftflow.tasks.train.deferred import deferred, deferred_of


def check_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """The step's kernel reads `g` as one flat run of `p`'s dtype or fp32."""
    if g.dtype not in (p.dtype, torch.float32) or g.shape != p.shape or not g.is_contiguous():
        raise ValueError(
            f"MasterAdamW: a {g.dtype} gradient of shape {tuple(g.shape)} for {p.dtype} {tuple(p.shape)}; "
            "expected a contiguous one of the parameter's shape"
        )


class MasterAdamW(torch.optim.AdamW):
    """AdamW whose fp32 master weights live in the optimizer, for a model that computes with bf16 parameters.

    Build it on the fp32 model, then `cast_parameters(torch.bfloat16)`: each parameter becomes its master rounded to
    bf16, and the optimizer keeps the low bits (`master_low`). It is a `torch.optim.AdamW` for everything outside
    `step` (param groups, state keys, the LR scheduler, DCP), so checkpoints are interchangeable with the FSDP path's
    fused AdamW. Clipping and the non-finite skip come in as the device tensors `grad_scale` and `found_inf`, as for
    fused AdamW.
    """

    def __init__(
        self,
        groups,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        in_backward: bool = False,
        offload: list[list[nn.Parameter]] | None = None,
    ):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=True)
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self.in_backward = in_backward
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        self._released_sq: torch.Tensor | None = None  # sum of squared gradients stepped in this backward
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}
        # The hook holds the optimizer weakly: autograd keeps hooks on the C++ side, where Python's garbage collector
        # cannot see a cycle through them, so a strong reference would keep the optimizer (and its state) alive.
        this = weakref.ref(self)

        def take_grad(p: nn.Parameter) -> None:
            optimizer = this()
            if optimizer is not None:
                optimizer._take_grad(p)

        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"MasterAdamW: build it on fp32 parameters (got {p.dtype}), then cast them")
                if not p.is_contiguous():
                    p.data = p.data.contiguous()  # the step's kernel reads every tensor as one flat run
        self.host_moments = None
        if offload:
            from sftflow.tasks.train.host_moments import HostMoments

            self.host_moments = HostMoments(offload, next(iter(self._group_of)).device)
        for group in self.param_groups:
            for p in group["params"]:
                # State up front (not at the first step): memory is taken before training, and DCP finds it to load
                # into without a dummy step. Offloaded moments are the host tensors, never on the device whole.
                if self.host_moments is not None and p in self.host_moments:
                    exp_avg, exp_avg_sq = self.host_moments.host(p)
                else:
                    exp_avg = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    exp_avg_sq = torch.zeros_like(p, memory_format=torch.contiguous_format)
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": exp_avg,
                    "exp_avg_sq": exp_avg_sq,
                }
        for p in self._group_of:
            p.register_post_accumulate_grad_hook(take_grad)

    # -- gradients --------------------------------------------------------------------------------------------------

    def _take_grad(self, p: nn.Parameter) -> None:
        if self.in_backward:
            self._step_released(p)
            return
        held = self._grads.get(p)
        if held is None:
            self._grads[p] = p.grad  # the first micro-batch: keep autograd's tensor, no copy
        elif held.dtype == torch.float32:
            held.add_(p.grad)
        else:
            self._grads[p] = held.float().add_(p.grad)
        p.grad = None

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient accumulated for `p` this step (`p.grad` when set directly, as DCP's state init does)."""
        return self._grads.get(p, p.grad)

    def gradients(self) -> list[torch.Tensor]:
        return [g for group in self.param_groups for p in group["params"] if (g := self.grad(p)) is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads.clear()
        self._released_sq = None  # a new tensor next step: the last norm may still be read from the old one
        if self.host_moments is not None:
            self.host_moments.end_round()
        super().zero_grad(set_to_none=True)

    def released_norm(self) -> torch.Tensor:
        """With `in_backward`: the L2 norm of the gradients stepped since `zero_grad` (0-d fp32, on the device). The
        step's metrics read it; clipping cannot, as the parameters have moved by then."""
        if self._released_sq is None:
            return torch.zeros((), dtype=torch.float32)
        return self._released_sq.sqrt()

    # -- masters ----------------------------------------------------------------------------------------------------

    def cast_parameters(self, dtype: torch.dtype) -> None:
        """Make the model's parameters bf16 (keeping the low bits of each fp32 master here), or leave them fp32."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"MasterAdamW: parameters in {dtype}; expected bf16 (fp32 masters kept here) or fp32")
        if dtype == torch.float32:
            return
        for group in self.param_groups:
            for p in group["params"]:
                if "master_low" not in self.state[p]:
                    p.data, self.state[p]["master_low"] = split_master(p.data.contiguous())

    def master(self, p: nn.Parameter) -> torch.Tensor:
        """`p`'s fp32 master: `p` itself with fp32 parameters, else joined from `p` and its low bits (a new tensor)."""
        return join_master(p.data, self.state[p].get("master_low"))

    def set_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            low = self.state[p].get("master_low")
            if low is None:
                if p.data_ptr() != value.data_ptr():
                    p.copy_(value)
                return
            param, new_low = split_master(value.to(device=p.device, dtype=torch.float32).contiguous())
            p.copy_(param)
            low.copy_(new_low)

    # -- the step -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient. Host work is kept small (parameters, low bits and
        moments are contiguous fp32/bf16/int16 by construction; gradients are checked here): the GPU may be waiting
        for it."""
        assert closure is None, "MasterAdamW.step takes no closure"
        hm = self.host_moments
        work, steps = [], []
        for group in self.param_groups:
            tensors = []
            for p in group["params"]:
                g = self.grad(p)
                if g is None:
                    continue
                check_grad(p, g)
                s = self.state[p]
                steps.append(s["step"])
                if hm is None or p not in hm:
                    low, step = s.get("master_low"), s["step"]
                    tensors.append(MasterTensors(p.data, g, low, s["exp_avg"], s["exp_avg_sq"], step))
            work.append((tensors, self._hyper(group)))
        advance_steps_(steps, self.found_inf)
        for tensors, hyper in work:
            adamw_master_step_(tensors, hyper, self.grad_scale, self.found_inf, advance_steps=False, check=False)
        if hm is not None:  # unit by unit: the next comes in while this one steps
            for unit in hm.units:
                stepped = False
                for p in unit.params:
                    if (g := self.grad(p)) is not None:
                        self._step_one(p, g, *hm.moments(p), self.grad_scale, self.found_inf)
                        stepped = True
                if stepped:
                    hm.finish(unit)

    def _hyper(self, group) -> AdamWHyper:
        beta1, beta2 = group["betas"]
        return AdamWHyper(
            lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"]
        )

    def _step_one(self, p, g, exp_avg, exp_avg_sq, grad_scale, found_inf) -> None:
        """One parameter's update (its step counter already advanced)."""
        s = self.state[p]
        tensors = [MasterTensors(p.data, g, s.get("master_low"), exp_avg, exp_avg_sq, s["step"])]
        adamw_master_step_(tensors, self._hyper(self._group_of[p]), grad_scale, found_inf, advance_steps=False,
                           check=False)  # fmt: skip

    @torch.no_grad()
    def _step_released(self, p: nn.Parameter) -> None:
        """Step `p` on its just-completed gradient and drop it: the backward's hook, with `in_backward`."""
        g, p.grad = p.grad, None
        check_grad(p, g)
        sq = torch.linalg.vector_norm(g, dtype=torch.float32).square()
        self._released_sq = sq if self._released_sq is None else self._released_sq.add_(sq)
        found_inf = (~torch.isfinite(sq)).float()  # this tensor's own skip flag, read on the device
        s, hm = self.state[p], self.host_moments
        advance_steps_([s["step"]], found_inf)
        if hm is not None and p in hm:
            self._step_one(p, g, *hm.moments(p), None, found_inf)
            hm.stepped(p)
        else:
            self._step_one(p, g, s["exp_avg"], s["exp_avg_sq"], None, found_inf)

    # -- checkpoints --------------------------------------------------------------------------------------------------

    def state_dict(self):
        """torch AdamW's state dict: the masters are the `model` component, not optimizer state. Offloaded moments
        are their host tensors, once every copy in flight has landed."""
        if self.host_moments is not None:
            self.host_moments.flush()
        full = super().state_dict()
        full["state"] = {i: {k: v for k, v in s.items() if k != "master_low"} for i, s in full["state"].items()}
        return full

    def load_state_dict(self, state_dict) -> None:
        """Copy into the existing fp32 state. (torch's `load_state_dict` would cast the moments to the parameters'
        dtype, bf16.)"""
        if self.host_moments is not None:
            self.host_moments.flush()  # nothing in flight, and no slot keeps moments that are about to change
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError("optimizer state: its parameter groups do not match this model's")
        by_id = {
            i: p
            for saved, group in zip(saved_groups, self.param_groups, strict=True)
            for i, p in zip(saved["params"], group["params"], strict=True)
        }
        with torch.no_grad():
            for i, saved in state_dict["state"].items():
                state = self.state[by_id[i]]
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    if state[key].data_ptr() != saved[key].data_ptr():
                        state[key].copy_(saved[key])
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


class MasterModelState(Stateful):
    """The `model` checkpoint component of a `MasterAdamW` run: the fp32 masters, under `get_model_state_dict`'s keys
    (what the FSDP path saves). Each master is a `deferred` entry: the checkpointer's planners join it when the writer
    reaches it and split a loaded one back into the parameter and its low bits as soon as it is read, so one master at
    a time is on the host (all of them at once are 4 bytes a parameter)."""

    def __init__(self, model: nn.Module, optimizer: MasterAdamW):
        self.model, self.optimizer = model, optimizer
        self.params = dict(model.named_parameters(remove_duplicate=False))

    def state_dict(self) -> dict[str, torch.Tensor]:
        def entry(p: nn.Parameter) -> torch.Tensor:
            return deferred(
                p.shape, torch.float32, lambda: self.optimizer.master(p), lambda v: self.optimizer.set_master(p, v)
            )

        state = get_model_state_dict(self.model)
        return {k: entry(self.params[k]) if k in self.params else v for k, v in state.items()}

    def load_state_dict(self, state_dict) -> None:
        with torch.no_grad():
            for key, value in state_dict.items():
                if deferred_of(value) is not None:
                    continue  # consumed as it was read
                if key in self.params:
                    self.optimizer.set_master(self.params[key], value)
                else:
                    self.model.get_buffer(key).copy_(value)

    def full_tensor(self, name: str) -> torch.Tensor:
        """One parameter's fp32 master (a new tensor), or a buffer, on the device (export, a tensor at a time)."""
        if name in self.params:
            return self.optimizer.master(self.params[name])
        return self.model.get_buffer(name)


def single_device_model(
    lm: nn.Module, device: torch.device, param_dtype: torch.dtype, groups, *, lr, betas, eps, in_backward=False,
    offload: str | int = "off",
) -> tuple[nn.Module, MasterAdamW]:  # fmt: skip
    """Move `lm` (fp32) to `device`, wrap it in `CausalLMLoss`, build the `MasterAdamW` over `groups` (a function of
    the model giving torch param groups; `in_backward`: stepped in the backward; `offload`: whose moments live on the
    host, `offload_units`), then cast the parameters to `param_dtype`."""
    from sftflow.tasks.train.host_moments import offload_units
    from sftflow.tasks.train.model import CausalLMLoss

    lm.to(device)
    root = CausalLMLoss(lm)
    optimizer = MasterAdamW(
        groups(root), lr=lr, betas=betas, eps=eps, in_backward=in_backward, offload=offload_units(lm, offload)
    )
    optimizer.cast_parameters(param_dtype)
    return root, optimizer
