"""rotary (RoPE keeping the projections' layout) against Llama's own apply_rotary_pos_emb: values and gradients, for the
reference and the Triton kernel (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sftflow.kernels.rope import rotary, rotary_reference

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def llama_rope(q_BHTD, cos_BTD, sin_BTD):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q_BHTD, q_BHTD, cos_BTD, sin_BTD)[0]


def inputs(B, T, H, D, dtype, device, seed=0):
    """x as Hugging Face passes it: a (B, H, T, D) view of a (B, T, H, D) tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    angles = torch.randn(B, T, D // 2, generator=g, dtype=torch.float64) * 3
    # Llama duplicates the frequencies over the two halves; give the halves different values anyway (the kernel
    # reads both), and scale them as attention_scaling does.
    cos = torch.cat([angles.cos(), (angles * 1.3).cos()], -1) * 0.9
    sin = torch.cat([angles.sin(), (angles * 1.3).sin()], -1) * 0.9
    return (t.to(device=device, dtype=dtype) for t in (x, cos, sin))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("B", "T", "H", "D"), [(1, 7, 4, 8), (2, 5, 3, 10), (1, 33, 8, 64), (1, 1, 1, 2)])
def test_matches_llama_rope_forward_and_backward(backend, B, T, H, D, device, monkeypatch):
    monkeypatch.setenv("SFTFLOW_ROPE", backend)
    x, cos, sin = inputs(B, T, H, D, torch.float32, device)
    x.requires_grad_()
    grad_out = torch.randn(B, H, T, D, dtype=torch.float32, device=device)
    out = rotary(x, cos, sin)
    (gx,) = torch.autograd.grad(out, x, grad_out)

    ref_x = x.detach().double().cpu().requires_grad_()
    ref = llama_rope(ref_x, cos.double().cpu(), sin.double().cpu())
    (ref_gx,) = torch.autograd.grad(ref, ref_x, grad_out.double().cpu())
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx.double().cpu(), ref_gx, rtol=1e-5, atol=1e-6)
    assert out.stride() == x.stride()  # the projections' memory layout is kept


def test_reference_is_exact_in_float64_and_passes_gradcheck():
    x, cos, sin = inputs(2, 4, 3, 6, torch.float64, "cpu")
    assert torch.equal(rotary_reference(x, cos, sin), llama_rope(x, cos, sin))
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rotary(t, cos, sin), (x,))


def test_bad_shapes_are_value_errors():
    x, cos, sin = inputs(1, 4, 2, 6, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not \\(B, H, T, D\\)"):
        rotary(x, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="odd"):
        rotary(x[..., :5], cos[..., :5], sin[..., :5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_bf16_on_gpu():
    x, cos, sin = inputs(1, 4096, 32, 64, torch.bfloat16, "cuda")  # (B, H, T, D) view, (B, T, H, D) memory
    out = rotary(x, cos, sin)
    ref = rotary_reference(x.double(), cos.double(), sin.double())
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2, err
