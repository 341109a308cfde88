"""The model-shape registry (`sftflow.tasks.shapes`) gives each named shape exactly the config fields its users wrote
out by hand before there was one registry: a benchmark figure or a test tolerance made on a shape stays about the same
model."""

from __future__ import annotations

import pytest

from sftflow.tasks.shapes import SHAPES, shape

LLAMA1B = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5,
)  # fmt: skip

# name -> (model_type, every config field), as written before the registry
WRITTEN = {
    "llama3.2-1b": ("llama", LLAMA1B),
    "llama3.1-8b": ("llama", dict(LLAMA1B, hidden_size=4096, num_hidden_layers=32, head_dim=128,
                                  intermediate_size=14336, tie_word_embeddings=False)),
    "mistral-1b": ("mistral", dict(LLAMA1B, sliding_window=4096)),
    # Mistral-7B's heads (benchmarks/sliding_window.py)
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                                   tie_word_embeddings=False, sliding_window=4096, rope_theta=10000.0,
                                   max_position_embeddings=32768, rms_norm_eps=1e-5)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
                                   rms_norm_eps=1e-6)),
    "phi3-mini": ("phi3", dict(hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                               intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False, rope_theta=10000.0,
                               max_position_embeddings=8192, rms_norm_eps=1e-5)),
    "llama-1024x8": ("llama", dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=64, intermediate_size=4096,
                                   tie_word_embeddings=False, max_position_embeddings=8192)),
    "llama-128x2": ("llama", dict(vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                                  max_position_embeddings=8192, tie_word_embeddings=False)),
    "llama-64x2": ("llama", dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False,
                                 max_position_embeddings=8192)),
    "llama-512x4": ("llama", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                           rms_norm_eps=1e-5)),
    "tiny-tied": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                                max_position_embeddings=1024, rms_norm_eps=1e-5)),
    "family-small": ("llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)),
}  # fmt: skip


def test_every_shape_is_pinned():
    assert set(SHAPES) == set(WRITTEN)


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_shape_gives_the_fields_written_before(name):
    family, fields = WRITTEN[name]
    assert shape(name).family == family
    assert shape(name).fields() == fields
    structural = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"}  # fmt: skip
    assert shape(name).structure() == {"model_type": family, **{k: v for k, v in fields.items() if k in structural}}


def test_the_config_is_the_family_s_with_the_shape_and_the_overrides():
    config = shape("qwen2.5-1.5b").config(vocab_size=100, num_hidden_layers=2)
    assert config.model_type == "qwen2"
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (100, 2, 1536)
    assert config.num_key_value_heads == 2 and config.rms_norm_eps == 1e-6


def test_shapes_are_frozen_and_unknown_names_say_what_is_known():
    with pytest.raises(AttributeError):
        shape("tiny").hidden = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        shape("tiny").extra["rms_norm_eps"] = 1.0  # type: ignore[index]
    with pytest.raises(KeyError, match="llama3.2-1b"):
        shape("llama-9t")


def test_tiny_llama_config_is_the_tiny_shape():
    from sftflow.tasks.tiny import tiny_llama_config

    config = tiny_llama_config(97, num_hidden_layers=3)
    assert (config.vocab_size, config.num_hidden_layers) == (97, 3)
    assert (config.hidden_size, config.intermediate_size) == (64, 128)
    assert (config.num_key_value_heads, config.max_position_embeddings, config.rms_norm_eps) == (2, 2048, 1e-5)
    assert config.tie_word_embeddings is False
