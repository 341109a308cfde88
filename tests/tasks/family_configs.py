"""Tiny models of each family sftflow supports, built from the structure of each family's real `config.json`.

Widths, depths and vocabularies are shrunk; everything that makes a family different is kept: tied or untied heads,
qkv bias, q/k norms, sliding windows (shorter than the test documents, so they cut), per-layer window patterns,
scaled embeddings and attention, partial RoPE, layers without RoPE, and MoE routing. Each entry is
`model_type -> config fields`, and the real model it is shaped after.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sftflow.tasks.shapes import SHAPES

# The width every family shares here (`family-small` of `sftflow.tasks.shapes`); each family sets its depth.
SMALL = SHAPES["family-small"].fields()

FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    # meta-llama/Llama-3.1-8B: untied head, llama3 RoPE scaling.
    "llama3_untied": (
        "llama",
        dict(
            SMALL,
            num_hidden_layers=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # meta-llama/Llama-3.2-1B: tied head.
    "llama3_tied": ("llama", dict(SMALL, num_hidden_layers=2, head_dim=16, tie_word_embeddings=True)),
    # Qwen/Qwen2.5-0.5B: qkv bias, tied; here with the sliding window switched on for the upper layers.
    "qwen2_5": (
        "qwen2",
        dict(
            SMALL,
            num_hidden_layers=3,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    # Qwen/Qwen3-0.6B: q/k RMSNorm, head_dim decoupled from the width.
    "qwen3": ("qwen3", dict(SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)),
    # Qwen/Qwen3-30B-A3B: MoE with top-k routing; the router loss on, as fine-tuning recipes turn it on.
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            SMALL,
            num_hidden_layers=2,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
            tie_word_embeddings=False,
        ),
    ),
    # mistralai/Mistral-7B-v0.1: a sliding window on every layer.
    "mistral": ("mistral", dict(SMALL, num_hidden_layers=2, head_dim=16, sliding_window=8, tie_word_embeddings=False)),
    # google/gemma-3-1b-pt: sliding and global layers, query_pre_attn_scalar, scaled embeddings, (1 + w) norms,
    # separate RoPE bases for local and global layers.
    "gemma3": (
        "gemma3_text",
        dict(
            SMALL,
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            tie_word_embeddings=True,
        ),
    ),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv and gate_up projections, sliding window.
    "phi3": ("phi3", dict(SMALL, num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False)),
    # microsoft/Phi-4-mini-instruct: partial RoPE (3/4 of each head), tied.
    "phi4_mini": (
        "phi3",
        dict(SMALL, num_hidden_layers=2, partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=None),
    ),
    # HuggingFaceTB/SmolLM3-3B: every fourth layer without RoPE, tied.
    "smollm3": (
        "smollm3",
        dict(SMALL, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=True, rope_theta=5000000.0),
    ),
}


def family_config(name: str, vocab_size: int, head_dim: int | None = None):
    """The family's small config; `head_dim` widens its heads to that size (the head count kept)."""
    from transformers import AutoConfig

    model_type, fields = FAMILY_CONFIGS[name]
    if head_dim is not None:
        fields = dict(fields)
        if "head_dim" in fields:
            fields["head_dim"] = head_dim
        else:  # the head dim is the width over the heads
            fields["hidden_size"] = head_dim * fields["num_attention_heads"]
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **special, **fields)


def save_family_model(name: str, vocab_size: int, folder: Path, seed: int = 0, head_dim: int | None = None) -> Path:
    """A random-init model of the family, saved as a Hugging Face folder (safetensors), fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name, vocab_size, head_dim), dtype=torch.float32)
    # Random init gives near-uniform attention, where a window changes little; larger q/k weights sharpen it, so a
    # window (or its absence) moves the loss well past the test tolerance.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(key in pname for key in ("q_proj", "k_proj", "qkv_proj")) and p.ndim == 2:
                p.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
