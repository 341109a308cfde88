"""Activation checkpointing: the same loss and gradients with fewer saved activations, on both training paths. A
2-rank FSDP run with it is checked against the reference run of `test_train_runs.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftflow.tasks.train.activations import apply_activation_checkpointing, needs_checkpointing
from sftflow.tasks.train.collate import collate, packed_collator
from sftflow.tasks.train.model import CausalLMLoss, build_model, decoder_layers, model_batch

OVERRIDES = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)


def _step(mode: str, device: str = "cpu", compiled: bool = False):
    """Loss, gradients and bytes of tensors saved for the backward, of one packed row."""
    torch.manual_seed(0)
    lm = build_model("tiny-llama", vocab_size=97, packed=True, overrides=OVERRIDES)
    if device != "cpu":
        from sftflow.tasks.train.compile import compile_layers

        lm = lm.to(device=device, dtype=torch.bfloat16)
        if compiled:
            torch._dynamo.reset()
            compile_layers(decoder_layers(lm), strict=True, device=torch.device(device), dtype=torch.bfloat16)
    assert apply_activation_checkpointing(decoder_layers(lm), mode) == {"off": 0, "selective": 2, "full": 4}[mode]
    model = CausalLMLoss(lm).train()
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, 97, n), np.array([[1, n]], dtype=np.int32)) for n in (40, 7, 61, 25)]
    batch = model_batch(collate(docs, packed_collator()), torch.device(device), 97)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(saved)


def test_checkpointed_layers_give_the_same_loss_and_gradients_and_save_less():
    loss, grads, saved = _step("off")
    for mode in ("selective", "full"):
        got_loss, got_grads, got_saved = _step(mode)
        assert torch.equal(got_loss, loss), mode
        for name, grad in grads.items():
            assert torch.equal(got_grads[name], grad), (mode, name)
        assert got_saved < saved, mode
    assert _step("full")[2] < _step("selective")[2]


@pytest.mark.gpu
def test_checkpointing_composes_with_compiled_layers_and_the_triton_attention_on_a_gpu():
    from sftflow.kernels.attention import last_backend

    loss, grads, saved = _step("off", "cuda", compiled=True)
    assert last_backend().name in ("triton", "flash_attn")
    got_loss, got_grads, got_saved = _step("full", "cuda", compiled=True)
    assert got_saved < saved
    torch.testing.assert_close(got_loss, loss, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=2e-2, atol=2e-2 * grad.abs().max().item(), msg=name)


def test_auto_turns_it_on_when_a_row_would_not_fit():
    from transformers import AutoConfig

    llama8b = AutoConfig.for_model(
        "llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=128256
    )
    llama1b = AutoConfig.for_model("llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16)
    h200 = 141 * 10**9
    assert needs_checkpointing(llama8b, 16384, 8_000_000_000, 0, h200)  # full fine-tuning: the state alone is ~144 GB
    assert not needs_checkpointing(llama1b, 16384, 1_240_000_000, 0, h200)
    assert needs_checkpointing(llama1b, 131072, 1_240_000_000, 0, h200)  # 128k-token rows
    assert not needs_checkpointing(llama8b, 4096, 40_000_000, 2 * 8_000_000_000, h200)  # LoRA: a bf16 frozen base
    # 16k rows of an 8B LoRA: over the line with the base in bf16, under it with the base in NF4 (QLoRA).
    assert needs_checkpointing(llama8b, 16384, 40_000_000, 2 * 8_000_000_000, h200)
    assert not needs_checkpointing(llama8b, 16384, 40_000_000, 0.52 * 7_000_000_000 + 2 * 1_000_000_000, h200)


def test_frozen_weights_count_at_the_bytes_they_are_held_in():
    """bf16: 2 bytes each; QLoRA: NF4's ~0.52 for the frozen linears it quantises (not the head or the embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftflow.tasks.train.quantize import NF4_BYTES_PER_WEIGHT, frozen_linear_names, frozen_weight_bytes

    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100
    )
    lm = AutoModelForCausalLM.from_config(config)
    lm.requires_grad_(False)
    total = sum(p.numel() for p in lm.parameters())
    linears = sum(lm.get_submodule(n).weight.numel() for n in frozen_linear_names(lm))
    assert 0 < linears < total - lm.get_output_embeddings().weight.numel()
    assert frozen_weight_bytes(lm, "none") == 2 * total
    assert frozen_weight_bytes(lm, "nf4") == pytest.approx(2 * (total - linears) + NF4_BYTES_PER_WEIGHT * linears)
    assert 0.515 < NF4_BYTES_PER_WEIGHT < 0.517
