"""The training step's pieces: clipping and non-finite skipping folded into the fused AdamW, and regional compilation
(with the T-major RoPE) giving the eager model's loss and gradients."""

from __future__ import annotations

import math
import sys
import types
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from sftflow.tasks.train.collate import collate, packed_collator
from sftflow.tasks.train.compile import compile_layers, patch_rope_layout, resolve_compile
from sftflow.tasks.train.config import OptimConfig
from sftflow.tasks.train.model import CausalLMLoss, build_model, decoder_layers, model_batch
from sftflow.tasks.train.worker import build_optimizer, optimizer_step

CPU = torch.device("cpu")
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


def _backward(net: nn.Module, scale: float) -> None:
    x = torch.linspace(-1, 1, 30).reshape(5, 6)
    (net(x).square().sum() * scale).backward()


@pytest.mark.parametrize("scale", [1e-3, 50.0])  # below and above the clip threshold
def test_fused_clip_equals_clip_grad_norm_then_adamw(scale):
    ours, ref = _net(), _net()
    opt = build_optimizer(ours, OPTIM)
    groups = [
        {"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": OPTIM.weight_decay},
        {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    ref_opt = torch.optim.AdamW(groups, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, foreach=False)
    for _ in range(3):
        _backward(ours, scale)
        _backward(ref, scale)
        norm = optimizer_step(ours, opt, OPTIM.grad_clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), OPTIM.grad_clip)
        ref_opt.step()
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        # clip_grad_norm_ divides by (norm + 1e-6); the fused step by norm exactly
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_non_finite_gradient_skips_the_whole_update():
    net = _net()
    opt = build_optimizer(net, OPTIM)
    _backward(net, 1.0)
    optimizer_step(net, opt, OPTIM.grad_clip)
    opt.zero_grad()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()}
    _backward(net, 1.0)
    next(net.parameters()).grad[0, 0] = float("nan")
    norm = optimizer_step(net, opt, OPTIM.grad_clip)
    assert not torch.isfinite(norm)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p in net.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[id(p)][k]), k  # moments and the step counter too
    opt.zero_grad()
    _backward(net, 1.0)  # and the next finite step updates again
    optimizer_step(net, opt, OPTIM.grad_clip)
    assert any(not torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_compile_auto_is_cuda_only():
    assert resolve_compile("auto", torch.device("cuda")) is True
    assert resolve_compile("auto", CPU) is False
    assert resolve_compile("layers", CPU) is True
    assert resolve_compile("off", torch.device("cuda")) is False


def test_rope_patch_only_replaces_a_function_it_reproduces(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = build_model("tiny-llama", vocab_size=50, packed=True)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    assert patch_rope_layout(decoder_layers(model)[0])
    assert modeling_llama.apply_rotary_pos_emb._sftflow_tmajor

    # A family whose RoPE rotates only part of the head (as some models do) must be left alone.
    def partial_rope(q, k, cos, sin, unsqueeze_dim=1):
        half = q.shape[-1] // 2
        c, s = cos.unsqueeze(unsqueeze_dim)[..., :half], sin.unsqueeze(unsqueeze_dim)[..., :half]

        def rot(x):
            rotated = x[..., :half] * c + modeling_llama.rotate_half(x[..., :half]) * s
            return torch.cat([rotated, x[..., half:]], -1)

        return rot(q), rot(k)

    fake = types.ModuleType("sftflow_test_partial_rope")
    fake.apply_rotary_pos_emb, fake.rotate_half = partial_rope, modeling_llama.rotate_half
    layer_cls = type("FakeLayer", (nn.Module,), {"__module__": fake.__name__})
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert not patch_rope_layout(layer_cls())
    assert fake.apply_rotary_pos_emb is partial_rope


def test_compiled_layers_give_the_eager_loss_and_gradients(monkeypatch):
    """`compile="layers"` on CPU (inductor): same loss and gradients as eager on a packed row of several documents;
    a second row of another length reuses the dynamic-shape graph."""
    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama

    from sftflow.tasks.train.model import ATTENTION_NAME, register_attention

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    register_attention()
    original_attention = AttentionInterface._global_mapping[ATTENTION_NAME]
    rng = np.random.default_rng(0)

    def row(lengths):
        docs = [(rng.integers(0, 100, n), np.array([[n // 3, n]], dtype=np.int32)) for n in lengths]
        return model_batch(collate(docs, packed_collator()), CPU)

    rows = [row([7, 1, 12, 5]), row([9, 16])]

    def run(compiled: bool):
        torch.manual_seed(0)
        lm = build_model("tiny-llama", vocab_size=100, packed=True)
        if compiled:
            torch._dynamo.reset()
            compile_layers(decoder_layers(lm))
        model = CausalLMLoss(lm)
        out = []
        for batch in rows:
            model.zero_grad()
            loss = model(**batch)
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if compiled:  # the layers really ran through dynamo, and the second row length did not recompile
            from torch._dynamo.utils import counters

            assert counters["stats"]["unique_graphs"] >= 1
            assert not counters["recompiles"], dict(counters["recompiles"])
        return out

    try:
        eager, compiled = run(False), run(True)
    finally:
        AttentionInterface.register(ATTENTION_NAME, original_attention)
        torch._dynamo.reset()
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@torch.library.custom_op("sftflow_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # no register_fake: dynamo cannot trace a call of it


class _Uncompilable(nn.Module):
    def forward(self, x):
        return _no_fake(x) + 1


@pytest.mark.parametrize("strict", [True, False])
def test_compile_auto_falls_back_to_eager_where_compile_fails(strict, monkeypatch):
    import torch._dynamo.config as dynamo_config
    from transformers import AttentionInterface

    from sftflow.tasks.train.model import ATTENTION_NAME, register_attention

    register_attention()
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, AttentionInterface[ATTENTION_NAME])
    torch._dynamo.reset()
    layer = _Uncompilable()
    x = torch.arange(3.0)
    with dynamo_config.patch(suppress_errors=False):  # restores the global setting compile_layers changes
        compile_layers([layer], strict=strict)
        if strict:
            with pytest.raises(Exception, match="fake"):
                layer(x)
        else:
            assert torch.equal(layer(x), x * 2 + 1)
    torch._dynamo.reset()


class _Batches:
    """Stands in for RankBatches: records which steps were collated; step 3's data is broken."""

    def __init__(self):
        self.collated = []

    def __call__(self, step):
        self.collated.append(step)
        if step == 3:
            raise ValueError("data.pbin: record 7: bad loss span")
        return [{"step": step}]


def test_prefetch_collates_the_next_step_and_defers_its_errors():
    from sftflow.tasks.train.worker import Prefetch

    plan = types.SimpleNamespace(step_loss_tokens=np.array([5, 5, 0, 5, 5]))
    batches = _Batches()
    prefetch = Prefetch(batches, plan, total_steps=5)
    assert prefetch.take(0) == [{"step": 0}]  # nothing made ahead: collated now
    prefetch.collate(1)
    assert prefetch.take(1) == [{"step": 1}] and batches.collated == [0, 1]  # made ahead, not again
    prefetch.collate(2)  # a step without trained tokens is skipped by the loop: nothing to make
    assert batches.collated == [0, 1]
    prefetch.collate(3)  # the error stays with step 3 ...
    with pytest.raises(ValueError, match="record 7"):
        prefetch.take(3)  # ... and surfaces when step 3 runs
    prefetch.collate(4)
    assert prefetch.take(2) == [{"step": 2}]  # a different step than the one made ahead: collated now
    prefetch.collate(5)  # past the last step: nothing
    assert prefetch.ready is None


def test_prefetch_stages_the_model_inputs_with_the_batches(gloo_world_of_one):
    """With `stage`, the micro-batches made ahead carry their model inputs, and the step trains on them exactly as
    on inputs made at the step."""
    from sftflow.tasks.train import worker

    docs = [(np.arange(9) % 100, np.array([[3, 9]], dtype=np.int32)), (np.arange(5) + 7, np.array([[0, 5]]))]
    plan = types.SimpleNamespace(step_loss_tokens=np.array([10, 10]))
    stage = partial(worker.stage_inputs, device=CPU, vocab_size=100)
    prefetch = worker.Prefetch(lambda step: [collate(docs, packed_collator())], plan, total_steps=2, stage=stage)
    prefetch.collate(1)
    staged = prefetch.take(1)
    assert set(staged[0]["device_inputs"]) >= {"input_ids", "labels", "loss_rows", "cu_seqlens", "max_seqlen"}
    totals = []
    for batches in (staged, [collate(docs, packed_collator())]):
        torch.manual_seed(0)
        model = CausalLMLoss(build_model("tiny-llama", vocab_size=100, packed=True))
        opt = build_optimizer(model, OPTIM)
        totals.append(worker.train_step(model, opt, batches, 10, 1.0, CPU))
        totals.append([p.detach().clone() for p in model.parameters()])
    assert totals[0] == totals[2]
    assert all(torch.equal(a, b) for a, b in zip(totals[1], totals[3], strict=True))


@pytest.fixture
def gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_step_runs_host_work_once_before_its_totals(gloo_world_of_one):
    from sftflow.tasks.train import worker

    torch.manual_seed(0)
    lm = build_model("tiny-llama", vocab_size=100, packed=True)
    model = CausalLMLoss(lm)
    opt = build_optimizer(model, OPTIM)
    docs = [(np.arange(9) % 100, np.array([[3, 9]], dtype=np.int32))]
    batch = collate(docs, packed_collator())
    calls = []
    totals = worker.train_step(model, opt, [batch], 6, 1.0, CPU, host_work=lambda: calls.append(opt.state != {}))
    assert calls == [True]  # once, after the optimizer step was issued
    assert totals.targets == 6 and totals.tokens == 9 and math.isfinite(totals.loss_sum)


def test_packed_attention_backward_copies_no_input_gradient():
    """Hugging Face hands the attention function (1, H, T, D) views. Taking `query[0]` is a select, whose backward
    writes each gradient into a zero-filled buffer through a strided copy (q, k and v of every layer); a squeeze's
    backward is a view."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from sftflow.tasks.train.model import sftflow_varlen_attention

    T, H, K, D = 12, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, n, D, generator=g).requires_grad_() for n in (H, K, K))  # the projections' layout
    cu = torch.tensor([0, 5, T], dtype=torch.int32)
    out, _ = sftflow_varlen_attention(
        SimpleNamespace(), *(x.transpose(1, 2) for x in (q, k, v)), None, cu_seq_lens_q=cu, max_length_q=7
    )
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Ops():
        out.square().sum().backward()
    assert "aten::select_backward" not in ops
    assert out.shape == (1, T, H, D) and all(x.grad.shape == x.shape for x in (q, k, v))
    # document 1 never sees document 0: its queries' gradients do not reach document 0's keys and values
    q.grad = k.grad = v.grad = None
    out, _ = sftflow_varlen_attention(
        SimpleNamespace(), *(x.transpose(1, 2) for x in (q, k, v)), None, cu_seq_lens_q=cu, max_length_q=7
    )
    out[:, 5:].sum().backward()
    assert torch.count_nonzero(k.grad[:, :5]) == 0 and torch.count_nonzero(v.grad[:, :5]) == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_queued_step_reads_the_totals_the_synchronous_step_reads(gloo_world_of_one, device):
    """The worker queues step s + 1 before it reads step s's totals (`queue_step`; on CUDA through a pinned copy and
    an event); what it reads then, and the weights it leaves, are those of the step run with its sync at the end
    (`train_step`, what the benchmarks time)."""
    from sftflow.tasks.train import worker

    device = torch.device(device)
    docs = [(np.arange(9) % 100, np.array([[3, 9]], dtype=np.int32)), (np.arange(5) + 7, np.array([[0, 5]]))]
    results, weights = [], []
    for queued in (False, True):
        torch.manual_seed(0)
        model = CausalLMLoss(build_model("tiny-llama", vocab_size=100, packed=True, device=device).to(device))
        opt = build_optimizer(model, OPTIM)
        steps = []
        for _ in range(3):  # every step queued before the one before it is read, as the worker does
            batches = [collate(docs, packed_collator())]
            if queued:
                steps.append(worker.queue_step(model, opt, batches, 10, 1.0, device))
            else:
                steps.append(worker.train_step(model, opt, batches, 10, 1.0, device))
        results.append([s.result() if queued else s for s in steps])
        weights.append([p.detach().cpu().clone() for p in model.parameters()])
    assert results[0] == results[1]
    assert results[0][0].targets == 10 and results[0][0].tokens == 14
    assert len({r.loss_sum for r in results[0]}) == 3  # each step saw the update of the one before
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
