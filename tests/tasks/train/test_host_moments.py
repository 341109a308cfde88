"""AdamW moments in host memory (`train.optimizer_offload`): the same steps as moments on the device, whatever order
the units' gradients come in, with the optimizer after the backward or in it; the same state in checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sftflow.tasks.train.activations import spread
from sftflow.tasks.train.config import OptimConfig
from sftflow.tasks.train.host_moments import HOST_HEADROOM, HostMoments, check_host_room, describe_units, offload_units
from sftflow.tasks.train.single_device import MasterAdamW
from sftflow.tasks.train.worker import optimizer_step, param_groups

OPTIM = OptimConfig(
    lr=1e-2,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    grad_clip=None,
    max_nonfinite_steps=3,
    in_backward=False,
    offload="off",
)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _net(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(5)]).to(device)


def _optimizer(net, dtype, in_backward=False, offload=None) -> MasterAdamW:
    opt = MasterAdamW(param_groups(net, OPTIM), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                      in_backward=in_backward, offload=offload)  # fmt: skip
    opt.cast_parameters(dtype)
    return opt


def _train(net, opt, steps: int, gaps: bool = False) -> list[float]:
    device = next(net.parameters()).device
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(device, next(net.parameters()).dtype)
        out = net[:-1](x)
        last = net[-1][0]
        if gaps and step == 2:  # the last block's bias gets no gradient: its unit ends the step half stepped
            out = torch.tanh(out @ last.weight.T + last.bias.detach())
        elif not (gaps and step == 3):  # at step 3 the last block gets none at all
            out = net[-1](out)
        loss = out.float().square().mean()
        loss.backward()
        optimizer_step(net, opt, None)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _units(net, order: str) -> list[list[nn.Parameter]]:
    units = [list(block.parameters()) for block in net]  # forward order: the prefetch guesses wrong
    return units[::-1] if order == "backward" else units


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("order", ["backward", "forward"])
def test_offloaded_moments_step_as_moments_on_the_device(device, in_backward, order):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref, ours = _net(device), _net(device)
    ref_opt = _optimizer(ref, dtype, in_backward)
    units = _units(ours, order)
    opt = _optimizer(ours, dtype, in_backward, offload=units[:4])  # 4 of 5 blocks: 2 slots, reused and spared
    want = _train(ref, ref_opt, 6, gaps=True)
    got = _train(ours, opt, 6, gaps=True)
    assert got == want
    hm = opt.host_moments
    assert len(hm.slots) == 2
    state = opt.state_dict()  # waits for the copies back
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), ref_opt.master(q))
        held = opt.state[p]
        if p in hm:
            assert held["exp_avg"].device.type == "cpu" and held["exp_avg"] is hm.host(p)[0]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(held[key].to(device), ref_opt.state[q][key]), key
    assert state["state"].keys() == ref_opt.state_dict()["state"].keys()


def test_checkpointed_state_loads_into_offloaded_moments():
    ref, ours = _net("cpu"), _net("cpu")
    ref_opt = _optimizer(ref, torch.float32)
    _train(ref, ref_opt, 3)
    saved = ref_opt.state_dict()
    saved = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()},
             "param_groups": saved["param_groups"]}  # fmt: skip
    ours.load_state_dict(ref.state_dict())
    opt = _optimizer(ours, torch.float32, offload=_units(ours, "backward"))
    _train(ours, opt, 1)  # slots hold moments now; the load must not leave them stale
    opt.load_state_dict(saved)
    ours.load_state_dict(ref.state_dict())
    assert _train(ours, opt, 3) == _train(ref, ref_opt, 3)


def test_units_follow_the_backward_and_cover_what_they_say():
    from sftflow.tasks.train.model import build_model

    lm = build_model("tiny-llama", vocab_size=256, packed=False)
    layers = lm.model.layers
    everything = offload_units(lm, "all")
    flat = [p for u in everything for p in u]
    assert len(flat) == len({id(p) for p in flat}) == len(list(lm.parameters()))
    assert everything[0] == [lm.lm_head.weight] or everything[0] == [lm.model.norm.weight]
    assert everything[-1] == [lm.model.embed_tokens.weight]
    two = offload_units(lm, 2)
    chosen = [layers[i] for i in spread(2, len(layers))]
    assert two == [list(layer.parameters()) for layer in chosen[::-1]]
    assert offload_units(lm, "off") == offload_units(lm, 0) == []


def test_spare_slots_are_dropped_after_their_unit():
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    hm = HostMoments([[p] for p in params], torch.device("cpu"), slots=2)
    views = [hm.moments(p) for p in params]  # three units in at once: the third gets a spare
    for (m, v), k in zip(views, (1.0, 2.0, 3.0), strict=True):
        m.fill_(k)
        v.fill_(-k)
    for p in params:
        hm.stepped(p)
    assert [hm.host(p)[0][0].item() for p in params] == [1.0, 2.0, 3.0]
    assert [hm.host(p)[1][0].item() for p in params] == [-1.0, -2.0, -3.0]
    assert all(u.slot is None or not u.slot.spare for u in hm.units) and len(hm.slots) == 2


def test_host_moments_are_views_of_one_exact_buffer():
    """Every parameter's two moments are disjoint views of one buffer of exactly 2 x the offloaded parameters."""
    params = [nn.Parameter(torch.zeros(shape)) for shape in [(3, 5), (7,), (2, 2, 2), (1,)]]
    hm = HostMoments([params[:2], params[2:]], torch.device("cpu"))
    assert hm.flat.numel() == 2 * sum(p.numel() for p in params)
    for k, p in enumerate(params):
        for j, moment in enumerate(hm.host(p)):
            assert moment.shape == p.shape and moment.untyped_storage().data_ptr() == hm.flat.data_ptr()
            moment.fill_(10 * k + j + 1)
    assert torch.equal(hm.flat.sort().values.unique_consecutive(return_counts=True)[1],
                       torch.tensor([p.numel() for p in params for _ in range(2)]))  # fmt: skip
    assert describe_units(hm.units) == f"2 units, 0.0M parameters, {hm.flat.numel() * 4 / 2**30:.1f} GiB on the host"


def test_a_host_without_room_for_the_moments_is_refused_before_allocating():
    check_host_room(1 << 30, None)  # no /proc/meminfo: nothing to check against
    check_host_room(1 << 30, (1 << 30) + HOST_HEADROOM)
    with pytest.raises(MemoryError, match=r"take 60\.0 GiB of host memory, and this host has 50\.0 GiB available"):
        check_host_room(60 << 30, 50 << 30)


@pytest.mark.gpu
def test_host_moments_are_pinned_at_their_exact_size():
    """Registered at their size, not drawn from torch's caching host allocator (which rounds each tensor up to a
    power of two), and pinned as long as a view of them (the optimizer's state) lives."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = [nn.Parameter(torch.zeros(3, 1000, device="cuda")), nn.Parameter(torch.zeros(5, device="cuda"))]
    hm = HostMoments([params], torch.device("cuda"))
    assert hm.flat.untyped_storage().nbytes() == 2 * 3005 * 4 and hm.flat.is_pinned()
    assert all(m.is_pinned() for p in params for m in hm.host(p))
    view = hm.host(params[1])[1]
    del hm
    assert view.is_pinned()
    view.copy_(torch.ones(5, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    assert view.tolist() == [1.0] * 5


@pytest.mark.gpu
@pytest.mark.parametrize("in_backward", [False, True])
def test_offloaded_moments_leave_the_device(in_backward):
    """8 layers of 2048 x 2048: 256 MiB of moments, of which two layers' slots (64 MiB) stay on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    peaks, losses = {}, {}
    for offload in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda()
        units = [[layer.weight] for layer in reversed(net)] if offload else None
        opt = _optimizer(net, torch.bfloat16, in_backward, offload=units)
        x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
        losses[offload] = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            loss = net(x).float().square().mean()
            loss.backward()
            optimizer_step(net, opt, None)
            opt.zero_grad()
            losses[offload].append(loss.item())
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated()
        # `loss` too: its graph's leaf nodes hold this network's weights, which would otherwise count in the next peak
        del net, opt, x, loss
    assert losses[True] == losses[False]
    moments = 8 * 2048 * 2048 * 8
    assert peaks[False] - peaks[True] >= 0.6 * moments, peaks


def test_tied_embeddings_step_once_a_step():
    """Gemma's and small Qwens' head is their embedding: its gradient adds up from two uses, and the hook that steps
    it in the backward must fire once, after both."""
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.tiny import tiny_llama_config

    losses = {}
    for mode in ("after", "in backward", "in backward, moments on the host"):
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(tiny_llama_config(128, tie_word_embeddings=True))
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
        offload = offload_units(lm, "all") if "host" in mode else None
        opt = _optimizer(lm, torch.bfloat16, in_backward=mode != "after", offload=offload)
        losses[mode] = []
        for step in range(4):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = lm(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer_step(lm, opt, None)
            opt.zero_grad()
            losses[mode].append(loss.item())
    assert losses["in backward"] == losses["after"] == losses["in backward, moments on the host"]
