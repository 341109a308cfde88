"""The master-weight AdamW step: the reference against torch's AdamW, and the Triton kernel (TRITON_INTERPRET=1 on
CPU, CUDA when present) against the reference, with bf16 parameters (fp32 master split into the parameter and its
low bits) and fp32 parameters, clipping and the non-finite skip."""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch

from sftflow.kernels.adamw import (
    AdamWHyper,
    MasterTensors,
    adamw_master_step_,
    advance_steps_,
    join_master,
    split_master,
)

REFERENCE = partial(adamw_master_step_, backend="reference")
TRITON = partial(adamw_master_step_, backend="triton")

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
SIZES = [1, 17, 4095, 4097 * 3, (33, 65)]


def test_split_master_is_exact_and_rounds_to_nearest():
    g = torch.Generator().manual_seed(0)
    # exact ties (low half 0x8000) on both sides of even and odd bf16 values, both signs; subnormals; extremes
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40818000, -0x407F8000], dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.0e38, -3.0e38, 1.00390625, 1.01171875])
    scale = 10.0 ** torch.randint(-30, 30, (100_000,), generator=g)
    for master in (torch.randn(100_000, generator=g) * scale, special, ties):
        param, low = split_master(master)
        assert param.dtype == torch.bfloat16 and low.dtype == torch.int16
        assert torch.equal(join_master(param, low).view(torch.int32), master.view(torch.int32))  # every bit
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(param[~tie], master[~tie].to(torch.bfloat16))  # torch's cast, away from ties
        away = param[tie].float().abs() > master[tie].abs()
        assert away.all()  # ties round away from zero
        # a chunk at a time (the default chunk holds these whole): the same bits, across every chunk boundary
        for got, want in zip(split_master(master.view(-1), chunk=4097), (param, low), strict=True):
            assert torch.equal(got.view(torch.int16), want.view(-1).view(torch.int16))
        assert torch.equal(join_master(param, low, chunk=4097).view(torch.int32), master.view(torch.int32))
    master = torch.randn(33, 65, generator=g)
    param, low = split_master(master, chunk=100)
    assert param.shape == low.shape == (33, 65)
    assert torch.equal(join_master(param, low, chunk=100).view(torch.int32), master.view(torch.int32))


def _state(shape, split: bool, device, seed):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(shape, generator=g).to(device)
    param, low = split_master(master) if split else (master, None)
    zeros = torch.zeros_like(master)
    return MasterTensors(param, torch.empty(0), low, zeros, zeros.clone(), torch.zeros((), device=device))


def _grads(shape, dtype, device, steps, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randn(shape, generator=g) * (1 + 10 * s)).to(device=device, dtype=dtype) for s in range(steps)]


def _run(step_fn, shape, split, device, grad_scales, found_infs, seed=0):
    t = _state(shape, split, device, seed)
    grads = _grads(shape, t.param.dtype, device, len(grad_scales), seed)
    for grad, scale, inf in zip(grads, grad_scales, found_infs, strict=True):
        scale = None if scale is None else torch.tensor(scale, device=device)
        inf = None if inf is None else torch.tensor(inf, device=device)
        step_fn([MasterTensors(t.param, grad, t.low, t.exp_avg, t.exp_avg_sq, t.step)], HYPER, scale, inf)
    return t


@pytest.mark.parametrize("shape", SIZES)
def test_reference_is_torch_adamw(shape):
    """fp32 parameters (the parameter is the master): the same trajectory as torch.optim.AdamW, clipping included
    (torch's fused AdamW divides by `grad_scale` as this step does)."""
    t = _state(shape, False, "cpu", 0)
    p = torch.nn.Parameter(t.param.clone())
    opt = torch.optim.AdamW([p], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps, weight_decay=0.1)
    for grad, scale in zip(_grads(shape, torch.float32, "cpu", 3, 0), (None, 4.0, 1.5), strict=True):
        p.grad = grad / (1 if scale is None else scale)
        opt.step()
        s = None if scale is None else torch.tensor(scale)
        REFERENCE([MasterTensors(t.param, grad, None, t.exp_avg, t.exp_avg_sq, t.step)], HYPER, s)
    torch.testing.assert_close(t.param, p.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(t.exp_avg_sq, opt.state[p]["exp_avg_sq"], rtol=1e-6, atol=0)
    assert float(t.step) == 3.0


def test_reference_split_master_follows_the_fp32_trajectory():
    """bf16 parameter + low bits: the joined master is the fp32 run's parameter, bit for bit."""
    fp32 = _run(REFERENCE, 4097, False, "cpu", [None, 2.0, 1.0], [None, 0.0, 0.0])
    split = _state(4097, True, "cpu", 0)
    grads = _grads(4097, torch.float32, "cpu", 3, 0)
    for grad, scale in zip(grads, (None, 2.0, 1.0), strict=True):
        s = None if scale is None else torch.tensor(scale)
        REFERENCE([MasterTensors(split.param, grad, split.low, split.exp_avg, split.exp_avg_sq, split.step)], HYPER, s)
    assert torch.equal(join_master(split.param, split.low), fp32.param)
    assert torch.equal(split.param, split_master(fp32.param)[0])


@needs_triton
@pytest.mark.parametrize("split", [True, False], ids=["bf16-split", "fp32"])
@pytest.mark.parametrize("shape", SIZES)
def test_triton_matches_reference(shape, split, device):
    scales, infs = [None, 3.0, 2.0, 1.0], [None, 0.0, 1.0, 0.0]  # the third step is skipped
    want = _run(REFERENCE, shape, split, device, scales, infs)
    got = _run(TRITON, shape, split, device, scales, infs)
    assert float(got.step) == float(want.step) == 3.0
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=2e-6, atol=1e-7, msg=name)
    master = join_master(got.param, got.low)
    torch.testing.assert_close(master, join_master(want.param, want.low), rtol=2e-6, atol=1e-7)
    if split:
        # parameter + low bits are the split of the master (round to nearest, ties away from zero)
        assert torch.equal(got.param, split_master(master)[0])
        assert torch.equal(got.low, split_master(master)[1])


@needs_triton
def test_found_inf_leaves_everything_untouched(device):
    t = _run(TRITON, 4097, True, device, [None], [0.0])
    before = {k: getattr(t, k).clone() for k in ("param", "low", "exp_avg", "exp_avg_sq", "step")}
    grad = torch.full((4097,), float("nan"), device=device, dtype=torch.bfloat16)
    TRITON(
        [MasterTensors(t.param, grad, t.low, t.exp_avg, t.exp_avg_sq, t.step)],
        HYPER,
        torch.tensor(2.0, device=device),
        torch.tensor(1.0, device=device),
    )
    for key, value in before.items():
        assert torch.equal(getattr(t, key), value), key


def test_dispatch_checks_dtypes_and_shapes():
    t = _state(8, True, "cpu", 0)
    bad = MasterTensors(t.param, torch.zeros(8), None, t.exp_avg, t.exp_avg_sq, t.step)
    with pytest.raises(ValueError, match="expected a bf16 param with int16 low bits"):
        adamw_master_step_([bad], HYPER)
    bad = MasterTensors(t.param, torch.zeros(8), t.low, t.exp_avg.double(), t.exp_avg_sq, t.step)
    with pytest.raises(ValueError, match="must be fp32"):
        adamw_master_step_([bad], HYPER)
    bad = MasterTensors(t.param, torch.zeros(9), t.low, t.exp_avg, t.exp_avg_sq, t.step)
    with pytest.raises(ValueError, match="shapes differ"):
        adamw_master_step_([bad], HYPER)


def test_advancing_the_step_counters_reads_nothing_on_the_host(host_reads):
    """The counters advance on the device (by 0 when `found_inf` is set): a host read there was a sync that held the
    optimizer back until the whole backward had run on the GPU."""
    steps = [torch.zeros(()) for _ in range(3)]
    with host_reads() as reads:
        advance_steps_(steps, torch.zeros(1))
        advance_steps_(steps, torch.ones(1))
        advance_steps_(steps)
    assert reads == []
    assert [s.item() for s in steps] == [2.0, 2.0, 2.0]


@needs_triton
def test_master_adamw_step_reads_nothing_on_the_host(host_reads, monkeypatch, device):
    from sftflow.tasks.train.single_device import MasterAdamW

    monkeypatch.setenv("SFTFLOW_ADAMW", "triton")
    model = torch.nn.Linear(16, 8, device=device)
    optimizer = MasterAdamW(
        [{"params": list(model.parameters()), "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8
    )
    optimizer.cast_parameters(torch.bfloat16)
    model(torch.randn(4, 16, dtype=torch.bfloat16, device=device)).square().sum().backward()
    optimizer.found_inf = torch.zeros(1, device=device)
    optimizer.grad_scale = torch.tensor(2.0, device=device)
    before = model.weight.detach().clone()
    with host_reads() as reads:
        optimizer.step()
    assert reads == []
    assert not torch.equal(model.weight, before)
