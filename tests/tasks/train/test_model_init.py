"""Where a model built from its config draws its random weights: on the GPU where they fit, else on the CPU."""

from __future__ import annotations

import pytest
import torch

from sftflow.tasks.train.model import build_model, count_params, init_device, model_config

VOCAB = 97


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def test_without_a_gpu_random_weights_are_drawn_on_the_cpu_as_before():
    config = model_config("tiny-llama", vocab_size=VOCAB)
    assert init_device(config, None) == torch.device("cpu")
    assert init_device(config, torch.device("cpu")) == torch.device("cpu")
    torch.manual_seed(0)
    plain = _weights(build_model("tiny-llama", vocab_size=VOCAB, packed=True))
    torch.manual_seed(0)
    placed = build_model("tiny-llama", vocab_size=VOCAB, packed=True, device=torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in placed.parameters())
    assert _weights(placed).keys() == plain.keys()
    assert all(torch.equal(w, plain[name]) for name, w in _weights(placed).items())


def test_a_gpu_draws_them_only_with_room_for_the_weights_and_their_bf16_copy(monkeypatch):
    """6 bytes a parameter (fp32 weights and the one-GPU path's bf16 copy) within 90% of the free memory."""
    config = model_config("tiny-llama", vocab_size=VOCAB)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n_params, _ = count_params(AutoModelForCausalLM.from_config(config))
    gpu = torch.device("cuda", 1)
    for free, want in ((int(6 * n_params / 0.9) + 16, gpu), (6 * n_params, torch.device("cpu"))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
        assert init_device(config, gpu) == want, free


@pytest.mark.gpu
def test_random_weights_drawn_on_the_gpu_are_seeded_and_initialised_as_on_the_cpu():
    """On the GPU the same seed gives the same weights; each tensor is initialised as transformers does on the CPU
    (norms at one, the same spread elsewhere), and RoPE's buffers equal the CPU's."""
    cuda = torch.device("cuda")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model("tiny-llama", vocab_size=VOCAB, packed=True, device=cuda))
    torch.manual_seed(0)
    cpu = build_model("tiny-llama", vocab_size=VOCAB, packed=True)
    first, second, on_cpu = (_weights(m) for m in (*models, cpu))
    assert all(p.device.type == "cuda" for p in models[0].parameters())
    for name, want in on_cpu.items():
        got = first[name]
        assert torch.equal(got, second[name]), name
        assert torch.isfinite(got).all(), name
        if "norm" in name:
            assert torch.equal(got, want), name
        else:
            assert not torch.equal(got, want), name  # drawn by the GPU's generator, not copied from the CPU
            assert got.std().item() == pytest.approx(want.std().item(), rel=0.15), name
    for (name, got), (_, want) in zip(models[0].named_buffers(), cpu.named_buffers(), strict=True):
        torch.testing.assert_close(got.cpu(), want, msg=name)
