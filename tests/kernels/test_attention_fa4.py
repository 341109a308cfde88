"""The FlashAttention-4 backend: where the dispatch picks it (CPU, from availability alone), its ops' fake and flop
registrations (CPU, fake tensors), and on a Hopper GPU with flash-attn-4 installed, forward and backward against the
fp64 reference, opcheck, and compiled layers that hold it in their graph."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch

from sftflow.kernels import attention as attn
from sftflow.kernels.attention import varlen_attention
from sftflow.kernels.attention_fa4 import NO_WINDOW, head_dim_reason, unavailable_reason

from .test_attention import assert_matches_fp64, make_inputs


def _fa4_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and bool(importlib.util.find_spec("flash_attn.cute"))


def _fa4_runs() -> bool:
    return torch.cuda.is_available() and unavailable_reason(torch.device("cuda"), torch.bfloat16) is None


needs_fa4 = pytest.mark.skipif(not _fa4_runs(), reason="needs flash-attn-4 on an sm_90+ GPU")


def test_without_flash_attn_4_the_dispatch_says_why_and_falls_back(monkeypatch, caplog):
    """Where FlashAttention-4 cannot run (not installed, no CUDA, fp32, an older GPU), the dispatch skips it with the
    reason in its log line and takes the next backend; forcing it names the reason."""
    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    reason = unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert reason is not None and ("not installed" in reason or "needs CUDA" in reason)
    if not _fa4_installed():
        assert "pip install flash-attn-4" in reason
    assert "fp16/bf16" in (unavailable_reason(torch.device("cuda"), torch.float32) if _fa4_installed() else "fp16/bf16")
    attn.dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="sftflow.kernels"):
        choice = attn.select_backend("cpu", torch.float32, head_dim=64)
    assert choice.name == "sdpa"
    monkeypatch.setenv("SFTFLOW_ATTENTION", "flash_attn_4")
    with pytest.raises(ValueError, match="SFTFLOW_ATTENTION='flash_attn_4' cannot run on cpu"):
        attn.select_backend("cpu", torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_cuda_prefers_flash_attn_4_then_triton_by_head_dim(monkeypatch, caplog):
    """The CUDA order where FlashAttention-4 is available: first for the head dims it takes, Triton for the others
    (here FlashAttention-4's availability stands in for a Hopper GPU; the real check runs in the GPU tests)."""
    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    monkeypatch.delenv("SFTFLOW_FA4_DETERMINISTIC", raising=False)
    monkeypatch.setitem(attn.BACKENDS, "flash_attn_4", lambda device, dtype: None)
    attn.dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="sftflow.kernels"):
        assert attn.select_backend("cuda", torch.bfloat16, head_dim=128).name == "flash_attn_4"
    assert "attention backend: flash_attn_4 (first available for cuda/bfloat16" in caplog.text
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=64).name == "flash_attn_4"
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=256).name == "triton"  # deterministic: Triton wins
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=12).name == "triton"  # not a multiple of 8
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=80).name == "triton"  # FA4's backward is wrong there
    assert "flash_attn_4: FlashAttention-4 is used at head dims" in attn.last_backend().reason
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=512).name not in ("flash_attn_4", "triton")
    monkeypatch.setenv("SFTFLOW_ATTENTION", "triton")
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=128).name == "triton"


def test_head_dims_flash_attn_4_takes():
    """Only the head dims whose gradients were checked on a GPU: flash-attn-4 4.0.0b36's sm_90 backward is wrong at
    16, 48 and 80 (`VERIFIED_HEAD_DIMS`), which real models use (Phi-2's 80), so those go to the Triton kernels."""
    cpu = torch.device("cpu")  # read as sm_90's rules
    for D in (32, 64, 96, 128):
        assert head_dim_reason(D, cpu) is None
    for D in (16, 48, 80, 100, 512):
        assert "the ones whose gradients sftflow checked" in head_dim_reason(D, cpu)


def test_head_dim_256_goes_to_flash_attn_4_only_without_the_deterministic_mode(monkeypatch):
    """At 256 FlashAttention-4's deterministic backward measured slower than the Triton kernels on an H100, its
    default one faster: the dispatch follows the measurement."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("SFTFLOW_FA4_DETERMINISTIC", raising=False)
    assert "runs slower than the Triton kernels" in head_dim_reason(256, cpu)
    monkeypatch.setenv("SFTFLOW_FA4_DETERMINISTIC", "0")
    assert head_dim_reason(256, cpu) is None


def test_the_fa4_ops_have_fake_kernels_and_count_their_flops():
    """Compiled graphs trace the ops with fake tensors (no GPU, no flash-attn-4 needed), and the flop counter and the
    recompute choice see their cost as the Triton ops'."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    T, H, K, D = 4096, 8, 2, 64
    with FakeTensorMode():
        q, k, cu = torch.empty(T, H, D), torch.empty(T, K, D), torch.zeros(3, dtype=torch.int32)
        with FlopCounterMode(display=False) as forward:
            o, lse = torch.ops.sftflow.fa4_varlen_attention(q, k, k, cu, 1024, 0.125, NO_WINDOW)
        with FlopCounterMode(display=False) as windowed:
            torch.ops.sftflow.fa4_varlen_attention(q, k, k, cu, 1024, 0.125, 256)
        with FlopCounterMode(display=False) as backward:
            dq, dk, dv = torch.ops.sftflow.fa4_varlen_attention_backward(o, q, k, k, o, lse, cu, 1024, 0.125, NO_WINDOW)
    assert o.shape == (T, H, D) and lse.shape == (H, T) and lse.dtype == torch.float32
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, K, D)
    assert forward.get_total_flops() == 2 * 2 * T * H * D * 512
    assert windowed.get_total_flops() == 2 * 2 * T * H * D * 128
    assert backward.get_total_flops() == 5 * forward.get_total_flops() // 2


# ---------------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_fa4
def test_flash_attn_4_is_the_default_on_this_gpu(monkeypatch):
    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    assert attn.select_backend("cuda", torch.bfloat16, head_dim=128).name == "flash_attn_4"
    assert attn.select_backend("cuda", torch.float32, head_dim=128).name == "triton"  # fp32: FA4 takes half only


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 300])
def test_flash_attn_4_bf16_matches_fp64(D, group, window):
    """GQA as GQA, windows shorter than documents, one-token documents, D up to 256: forward and backward against
    the fp64 per-document reference, as the Triton kernels are held."""
    doc_lengths = [700, 1, 129, 64, 2000, 37]
    H = 8
    q, k, v, cu = make_inputs(doc_lengths, H, H // group, D, "cuda", dtype=torch.bfloat16, seed=D + group)
    o = varlen_attention(q, k, v, cu, max(doc_lengths), window=window, backend="flash_attn_4")
    assert_matches_fp64(o, q, k, v, doc_lengths, D**-0.5, tol=1e-2, window=window)


@pytest.mark.gpu
@needs_fa4
def test_flash_attn_4_many_one_token_documents_and_a_window_of_one():
    doc_lengths = [1] * 37 + [90, 1, 3]
    q, k, v, cu = make_inputs(doc_lengths, 8, 2, 128, "cuda", dtype=torch.bfloat16, seed=7)
    for window in (None, 1, 2):
        o = varlen_attention(q, k, v, cu, max(doc_lengths), scale=0.1, window=window, backend="flash_attn_4")
        assert_matches_fp64(o, q, k, v, doc_lengths, 0.1, tol=1e-2, window=window)
        q.grad = k.grad = v.grad = None


@pytest.mark.gpu
@needs_fa4
def test_fa4_op_passes_opcheck_and_compiles_without_a_graph_break():
    from sftflow.kernels.attention_fa4 import fa4_attention_op

    g = torch.Generator().manual_seed(0)
    T, H, K, D = 300, 8, 2, 64
    q, k, v = (torch.randn(T, n, D, generator=g).cuda().bfloat16().requires_grad_() for n in (H, K, K))
    cu = torch.tensor([0, 130, 131, T], dtype=torch.int32, device="cuda")
    # The schema, autograd and fake registrations; the compiled comparison below stands in for opcheck's AOT test,
    # which holds gradients to bf16's last bit, and dQ's atomics do not sum in a fixed order.
    torch.library.opcheck(
        fa4_attention_op,
        (q, k, v, cu, 169, 0.125, 100),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )

    def attend(q, k, v):
        return fa4_attention_op(q, k, v, cu, 169, 0.125, 100)[0]

    expected = varlen_attention(q, k, v, cu, 169, 0.125, window=100, backend="flash_attn_4")
    want = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
    torch._dynamo.reset()
    try:
        out = torch.compile(attend, fullgraph=True, dynamic=True)(q, k, v)
        got = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # dQ is summed with atomics: order may differ


@pytest.mark.gpu
@needs_fa4
def test_compiled_layers_hold_flash_attn_4_in_their_graph(monkeypatch):
    """A compiled tiny Llama on FlashAttention-4 by default: one graph per layer (no break at the attention), and
    the loss of the eager model on the same backend."""
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface

    from sftflow.tasks.train.collate import collate, packed_collator
    from sftflow.tasks.train.compile import attention_in_graph, compile_layers
    from sftflow.tasks.train.model import ATTENTION_NAME, CausalLMLoss, build_model, decoder_layers, model_batch

    monkeypatch.delenv("SFTFLOW_ATTENTION", raising=False)
    build_model("tiny-llama", vocab_size=100, packed=True)  # registers the attention function
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, AttentionInterface[ATTENTION_NAME])
    overrides = dict(head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    dev = torch.device("cuda")
    g = np.random.default_rng(0)
    docs = [(g.integers(0, 100, n), np.array([[n // 3, n]], dtype=np.int32)) for n in (70, 1, 120, 50)]
    batch = model_batch(collate(docs, packed_collator()), dev)

    def run(compiled: bool):
        torch.manual_seed(0)
        lm = build_model("tiny-llama", vocab_size=100, packed=True, overrides=overrides).to(dev, torch.bfloat16)
        if compiled:
            assert attention_in_graph(decoder_layers(lm), dev, torch.bfloat16) == "flash_attn_4"
            torch._dynamo.reset()
            counters.clear()
            assert compile_layers(decoder_layers(lm), device=dev, dtype=torch.bfloat16)
        loss = CausalLMLoss(lm)(**batch)
        loss.backward()
        if compiled:
            assert not counters["graph_break"], dict(counters["graph_break"])
        assert attn.last_backend() is None or attn.last_backend().name == "flash_attn_4"
        return loss.detach().float()

    try:
        eager, compiled = run(False), run(True)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_fa4
def test_flash_attn_4_backward_is_deterministic_by_default(monkeypatch):
    """Two backwards of the same step give the same gradients bit for bit (GQA, where dK/dV are summed across the
    group too), as sftflow's other GPU kernels do, so a resumed run repeats the uninterrupted one."""
    monkeypatch.delenv("SFTFLOW_FA4_DETERMINISTIC", raising=False)
    doc_lengths = [3000, 1, 900, 4000]
    q, k, v, cu = make_inputs(doc_lengths, 16, 2, 128, "cuda", dtype=torch.bfloat16, seed=11)
    do = torch.randn_like(q)
    grads = []
    for _ in range(3):
        o = varlen_attention(q, k, v, cu, max(doc_lengths), backend="flash_attn_4")
        grads.append(torch.autograd.grad(o, (q, k, v), do))
    for again in grads[1:]:
        for a, b in zip(grads[0], again, strict=True):
            assert torch.equal(a, b)
