"""The named model shapes that the tiny models, the benchmarks and the tests build: one registry, so that a shape
called the same in two places is the same model.

A `Shape` is a Hugging Face config's structure (family, width, depth, heads, MLP width, vocabulary, head size, tied
head) plus the other fields that a user of the shape sets (`extra`: RoPE base, norm epsilon, windows, positions).
A field left `None` is left out of the config, so the family's default applies, as it did where the shape was
written out by hand. Nothing here imports transformers until a config is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType


@dataclasses.dataclass(frozen=True)
class Shape:
    family: str  # the config's `model_type`
    hidden: int
    layers: int | None
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int | None = None  # None: given where the model is built (a tokenizer's size)
    head_dim: int | None = None  # None: the family's default (hidden / heads)
    tied: bool | None = None  # None: the family's default
    extra: Mapping = dataclasses.field(default_factory=dict)  # other config fields, as set

    def __post_init__(self):
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    def structure(self) -> dict:
        """`model_type` and the structural fields that are set, as config keyword arguments."""
        fields = dict(
            model_type=self.family,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
        )
        return {k: v for k, v in fields.items() if v is not None}

    def fields(self, **overrides) -> dict:
        """The config keyword arguments (without `model_type`): the structure, `extra`, then `overrides`."""
        fields = self.structure()
        del fields["model_type"]
        return {**fields, **self.extra, **overrides}

    def config(self, **overrides):
        """The Hugging Face config of this shape (`overrides` on top)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.family, **self.fields(**overrides))

    def replace(self, **changes) -> Shape:
        return dataclasses.replace(self, **changes)


# meta-llama/Llama-3.2-1B's structure (1.24B parameters, tied head), as the benchmarks train it at random init.
LLAMA3_2_1B = Shape(
    "llama", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, head_dim=64, tied=True,
    extra=dict(rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
)  # fmt: skip

SHAPES: dict[str, Shape] = {
    "llama3.2-1b": LLAMA3_2_1B,
    # Llama-3.1-8B's shape (untied head; the llama3 RoPE scaling left out: it changes no cost)
    "llama3.1-8b": LLAMA3_2_1B.replace(hidden=4096, layers=32, head_dim=128, intermediate=14336, tied=False),
    # The 1B shape as Mistral (sliding-window attention on every layer)
    "mistral-1b": LLAMA3_2_1B.replace(family="mistral", extra=dict(LLAMA3_2_1B.extra, sliding_window=4096)),
    # Mistral-7B-v0.1's shape (a 4096-token window on every layer): the sliding-window attention benchmark's heads
    "mistral-7b": Shape(
        "mistral", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=32000, head_dim=128,
        tied=False,
        extra=dict(sliding_window=4096, rope_theta=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-5),
    ),
    # Qwen2.5-1.5B's shape: an MLP 5.8 times the width, biased q/k/v, 2 KV heads
    "qwen2.5-1.5b": Shape(
        "qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True,
        extra=dict(rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    ),
    # Phi-3-mini's shape: multi-head K/V, fused qkv and gate_up projections
    "phi3-mini": Shape(
        "phi3", hidden=3072, layers=32, heads=32, kv_heads=32, intermediate=8192, vocab=32064, tied=False,
        extra=dict(rope_theta=10000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    ),
    # A small real-shaped Llama (hidden 1024, 8 layers, vocab 32k): the GPU worker check and the GPU training smoke
    "llama-1024x8": Shape(
        "llama", hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=4096, vocab=32000, head_dim=64, tied=False,
        extra=dict(max_position_embeddings=8192),
    ),
    # The same at a width and vocabulary a CPU trains in seconds (the GPU training smoke's plumbing check)
    "llama-128x2": Shape(
        "llama", hidden=128, layers=2, heads=16, kv_heads=8, intermediate=512, vocab=1000, head_dim=8, tied=False,
        extra=dict(max_position_embeddings=8192),
    ),
    # The GPU worker check's CPU plumbing model
    "llama-64x2": Shape(
        "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, head_dim=16, tied=False,
        extra=dict(max_position_embeddings=8192),
    ),
    # A small Llama to write and load as a checkpoint on a CPU (the checkpoint-loading benchmark)
    "llama-512x4": Shape(
        "llama", hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=32000, tied=False
    ),
    # `sftflow.tasks.tiny.tiny_llama_config`: trains on two CPU cores in seconds per step; the vocabulary is the
    # tokenizer's
    "tiny": Shape(
        "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tied=False,
        extra=dict(max_position_embeddings=2048, rms_norm_eps=1e-5),
    ),
    # The tiny width with a tied head and a vocabulary of 512 (the throughput benchmark's CPU smoke model)
    "tiny-tied": Shape(
        "llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, head_dim=16, tied=True,
        extra=dict(max_position_embeddings=1024, rms_norm_eps=1e-5),
    ),
    # The width the test suite's model families share (tests/tasks/family_configs.py); each family sets its depth
    "family-small": Shape(
        "llama", hidden=64, layers=None, heads=4, kv_heads=2, intermediate=96, extra=dict(max_position_embeddings=512)
    ),
}  # fmt: skip


def shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}") from None
