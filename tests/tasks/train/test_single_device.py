"""`MasterAdamW` (the one-device path's optimizer) on small modules: fp32 gradient accumulation over bf16 micro-batch
gradients, the same update as the FSDP path's fused AdamW, and a state dict in torch AdamW's format."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from sftflow.kernels.adamw import split_master
from sftflow.tasks.train.config import OptimConfig
from sftflow.tasks.train.single_device import MasterAdamW
from sftflow.tasks.train.worker import build_optimizer, gradients, optimizer_step, param_groups

OPTIM = OptimConfig(
    lr=1e-2,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    grad_clip=1.0,
    max_nonfinite_steps=3,
    in_backward=False,
    offload="off",
)


def _net(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _master_adamw(net: nn.Module, dtype: torch.dtype) -> MasterAdamW:
    opt = MasterAdamW(param_groups(net, OPTIM), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps)
    opt.cast_parameters(dtype)
    return opt


def _loss(net: nn.Module, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
    return net(x.to(next(net.parameters()).dtype)).float().square().sum() * scale


def test_micro_batch_gradients_accumulate_in_fp32():
    net = _net()
    opt = _master_adamw(net, torch.bfloat16)
    singles = []
    for seed in (1, 2, 3):  # each micro-batch's own bf16 gradient
        _loss(net, seed).backward()
        singles.append([g.clone() for g in gradients(net, opt)])
        opt.zero_grad()
    _loss(net, 1).backward()
    held = gradients(net, opt)
    assert all(g.dtype == torch.bfloat16 for g in held)  # one micro-batch: autograd's tensor, no copy
    for seed in (2, 3):
        _loss(net, seed).backward()
    held = gradients(net, opt)
    assert all(p.grad is None for p in net.parameters())  # autograd never adds in bf16
    for got, *parts in zip(held, *singles, strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, parts[0].float() + parts[1].float() + parts[2].float())


@pytest.mark.parametrize("scale", [1e-3, 50.0])  # below and above the clip threshold
def test_same_update_as_fused_adamw_in_fp32(scale):
    ours, ref = _net(), _net()
    opt, ref_opt = _master_adamw(ours, torch.float32), build_optimizer(ref, OPTIM)
    assert all(opt.master(p).data_ptr() == p.data_ptr() for p in ours.parameters())  # fp32: its own master
    for seed in range(3):
        _loss(ours, seed, scale).backward()
        _loss(ref, seed, scale).backward()
        norm, ref_norm = optimizer_step(ours, opt, OPTIM.grad_clip), optimizer_step(ref, ref_opt, OPTIM.grad_clip)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_parameters_follow_fp32_masters():
    net = _net()
    fp32 = [p.detach().clone() for p in net.parameters()]
    opt = _master_adamw(net, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert all(opt.state[p]["master_low"].dtype == torch.int16 for p in net.parameters())
    assert all(torch.equal(opt.master(p), w) for p, w in zip(net.parameters(), fp32, strict=True))  # exact
    _loss(net, 0).backward()
    optimizer_step(net, opt, OPTIM.grad_clip)
    for p, w in zip(net.parameters(), fp32, strict=True):
        master = opt.master(p)
        assert master.dtype == torch.float32 and not torch.equal(master, w)  # updated
        assert torch.equal(p.detach(), split_master(master)[0])
        assert not torch.equal(master, p.detach().float())  # the master keeps fp32 detail


def test_optimizer_is_freed_with_its_last_reference():
    """The gradient hooks must not keep the optimizer (and its state) alive after the run lets go of it."""
    net = _net()
    opt = _master_adamw(net, torch.bfloat16)
    _loss(net, 0).backward()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    _loss(net, 1).backward()  # the hooks left behind do nothing: the gradient stays on the parameter
    assert all(p.grad is not None for p in net.parameters())


def test_state_dict_is_adamws_and_loads_into_fp32_state():
    net = _net()
    opt = _master_adamw(net, torch.bfloat16)
    _loss(net, 0).backward()
    optimizer_step(net, opt, OPTIM.grad_clip)
    saved = opt.state_dict()
    ref = build_optimizer(_net(), OPTIM)
    assert saved["param_groups"][0].keys() == ref.state_dict()["param_groups"][0].keys()
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["state"].values())
    saved = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()},
        "param_groups": saved["param_groups"],
    }
    other = _net(1)
    fresh = _master_adamw(other, torch.bfloat16)
    fresh.load_state_dict(saved)
    for p, q in zip(net.parameters(), other.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert fresh.state[q][key].dtype == torch.float32
            assert torch.equal(fresh.state[q][key], opt.state[p][key]), key


def test_refuses_low_precision_parameters():
    net = _net().to(torch.bfloat16)
    with pytest.raises(ValueError, match="build it on fp32 parameters"):
        MasterAdamW(param_groups(net, OPTIM), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def test_auto_picks_single_only_for_one_cuda_device():
    from sftflow.tasks.train.config import parallel_path

    assert parallel_path("auto", 1, "cuda") == "single"
    assert parallel_path("auto", 2, "cuda") == "fsdp"
    assert parallel_path("auto", 1, "cpu") == "fsdp"
    assert parallel_path("single", 1, "cpu") == "single"
    with pytest.raises(ValueError, match="one process"):
        parallel_path("single", 2, "cpu")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_training_follows_fp32_masters_with_a_bf16_copy(device):
    """30 steps of a bf16 model: `MasterAdamW` (the Triton kernel on CUDA) against the textbook mixed-precision
    loop, torch's fused AdamW on separate fp32 masters and a fresh bf16 copy of them for each step's forward.

    The first step starts from the same bf16 weights, so both see the same gradients, and the masters after it
    agree to float32 rounding: a wrong update (bias correction, clipping, decay) shows there. After that the two
    loops drift apart on every device: a last-bit difference in a master (the update's summation order, which the
    CPU's instruction set changes too: AVX2 and AVX-512 machines differ) flips a bf16 rounding of the parameter,
    and the next steps amplify it. On an H200 they part from about step 14 at this lr (1e-2); `MasterAdamW` with
    the PyTorch reference step drifts as far as with the Triton kernel (loss 3.3e-3 vs 4.3e-3 relative at worst,
    masters 2.4e-3 vs 2.6e-3 of their largest value; `benchmarks/RESULTS.md`), so all 30 steps are held to that
    drift with room, 2e-2 and 1e-2, on the CPU as on CUDA."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)
    masters = copy.deepcopy(net)
    compute = copy.deepcopy(net).to(torch.bfloat16)
    opt, ref_opt = _master_adamw(net, torch.bfloat16), build_optimizer(masters, OPTIM)
    for step in range(30):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step)).to(device, torch.bfloat16)
        loss = net(x).float().square().mean()
        loss.backward()
        optimizer_step(net, opt, OPTIM.grad_clip)
        opt.zero_grad()
        ref_loss = compute(x).float().square().mean()
        ref_loss.backward()
        for m, c in zip(masters.parameters(), compute.parameters(), strict=True):
            m.grad, c.grad = c.grad.float(), None
        optimizer_step(masters, ref_opt, OPTIM.grad_clip)
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, c in zip(masters.parameters(), compute.parameters(), strict=True):
                c.copy_(m)
        if step == 0:
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
            for p, m in zip(net.parameters(), masters.parameters(), strict=True):
                torch.testing.assert_close(opt.master(p), m.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=1e-6)
    for p, m in zip(net.parameters(), masters.parameters(), strict=True):
        assert (opt.master(p) - m).abs().max() <= 1e-2 * m.abs().max()


def _in_backward(net: nn.Module, dtype: torch.dtype) -> MasterAdamW:
    opt = MasterAdamW(param_groups(net, OPTIM), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, in_backward=True)
    opt.cast_parameters(dtype)
    return opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stepping_in_the_backward_is_the_step_after_it(dtype):
    """Without clipping, each parameter stepped as its gradient is made ends where the step after the backward puts
    it, bit for bit, and no gradient outlives its parameter's step."""
    ours, ref = _net(), _net()
    opt, ref_opt = _in_backward(ours, dtype), _master_adamw(ref, dtype)
    held_during_backward = []
    last = list(ours.parameters())[0]  # the first layer's weight: its gradient is made last
    last.register_hook(lambda g: held_during_backward.append([p.grad for p in ours.parameters()]) or g)
    for seed in range(4):
        _loss(ours, seed).backward()
        _loss(ref, seed).backward()
        want_norm = optimizer_step(ref, ref_opt, None)
        norm = optimizer_step(ours, opt, None)
        torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)  # summed in another order
        assert not opt.gradients() and all(p.grad is None for p in ours.parameters())
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(opt.master(p), ref_opt.master(q))
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][key], ref_opt.state[q][key]), key
    # when the last gradient is made, every other parameter has stepped and let its gradient go
    assert all(g is None for grads in held_during_backward for g in grads)


def test_a_non_finite_gradient_stops_only_its_own_tensor():
    net = _net()
    opt = _in_backward(net, torch.bfloat16)
    params = list(net.parameters())
    before = [(opt.master(p).clone(), opt.state[p]["exp_avg"].clone()) for p in params]
    params[2].register_hook(lambda g: g * float("nan"))  # the second layer's weight
    _loss(net, 0).backward()
    assert not torch.isfinite(optimizer_step(net, opt, None))  # reported: the run counts the step as non-finite
    for i, (p, (master, exp_avg)) in enumerate(zip(params, before, strict=True)):
        kept = i == 2
        assert torch.equal(opt.master(p), master) == kept, i
        assert torch.equal(opt.state[p]["exp_avg"], exp_avg) == kept, i
        assert opt.state[p]["step"].item() == (0 if kept else 1), i


def test_stepping_in_the_backward_refuses_to_clip():
    net = _net()
    opt = _in_backward(net, torch.float32)
    _loss(net, 0).backward()
    with pytest.raises(ValueError, match="cannot clip"):
        optimizer_step(net, opt, 1.0)


@pytest.mark.gpu
def test_stepping_in_the_backward_never_holds_all_gradients():
    """On a GPU the step's peak memory drops by most of the bf16 gradients (8 layers of 2048 x 2048: 64 MiB), the
    Triton kernel stepping each tensor as it goes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    peaks = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda()
        opt = MasterAdamW(param_groups(net, OPTIM), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, in_backward=in_backward)
        opt.cast_parameters(torch.bfloat16)
        x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # the second step's peak: allocator warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            net(x).float().square().mean().backward()
            norm = optimizer_step(net, opt, None)
            opt.zero_grad()
            torch.cuda.synchronize()
        assert torch.isfinite(norm)
        peaks[in_backward] = torch.cuda.max_memory_allocated()
        del net, opt
    grads = 8 * 2048 * 2048 * 2
    assert peaks[False] - peaks[True] >= 0.5 * grads, peaks  # 7/8 of them, less a transient fp32 copy at most
