"""The model families sftflow trains on packed rows exactly as Hugging Face computes them, and how they differ.

A family is listed here only when a test shows that its packed loss and gradients equal the sum of Hugging Face's own
`eager` forward over each document alone (`tests/tasks/train/test_families.py`). Everything the worker reads about a
family comes from this table and the model's config; a model outside the table, or with a config feature the worker
does not reproduce, is refused before launch with a message naming the model, the feature and the way out.

What differs between the listed families, and where it is handled:

- Sliding-window attention, per layer (Mistral and Phi-3 on every layer, Gemma 3 on five of six, Qwen2/3 and SmolLM3
  when configured): the model passes `sliding_window` to its attention function, and `sftflow_varlen_attention`
  hands it to the kernels.
- q/k norms (Qwen3), qkv bias (Qwen2), fused qkv (Phi-3), layers without RoPE (SmolLM3), partial RoPE (Phi-4-mini):
  the model's own modules; sftflow replaces only the attention function.
- Attention scaling (`query_pre_attn_scalar`), embedding scaling and (1 + w) norms (Gemma 3): the model's own modules;
  the attention function takes the model's `scaling`.
- The router's load-balancing loss (Qwen3-MoE): `CausalLMLoss` adds `router_aux_loss_coef` times the model's own
  `load_balancing_loss_func`, as the model's forward does when `output_router_logits` is set.
- Tied embeddings (Llama 3.2 1B/3B, small Qwen2.5, Gemma 3, SmolLM3): the fused loss reads the head weight, which is
  the embedding.

Padded plans (`plan.mode: padded`) run the model's stock attention with its own masks, so any causal LM trains exactly
there (slower); only the logit transforms below stay refused, because the fused loss does not apply them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    router_aux_loss: bool = False


FAMILIES: tuple[Family, ...] = (
    Family(name="Llama (Llama 2/3.x, SmolLM2, TinyLlama)", model_types=("llama",)),
    Family(name="Qwen2 / Qwen2.5", model_types=("qwen2",)),
    Family(name="Qwen3", model_types=("qwen3",)),
    Family(name="Qwen3-MoE", model_types=("qwen3_moe",), router_aux_loss=True),
    Family(name="Mistral", model_types=("mistral",)),
    Family(name="Gemma 3 (text)", model_types=("gemma3_text",)),
    Family(name="Phi-3 / Phi-4", model_types=("phi3",)),
    Family(name="SmolLM3", model_types=("smollm3",)),
)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}

# Config fields that change the logits after the LM head: the fused loss does not apply them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# Attention features the varlen kernels do not implement.
ATTENTION_FEATURES = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "use_bidirectional_attention": "bidirectional attention",
}
# Keyword arguments a model may pass to its attention function that sftflow's varlen attention either uses or that do
# not change the result (dropout is checked separately). Anything else is refused at the first forward instead of
# being dropped.
KNOWN_ATTENTION_KWARGS = frozenset(
    {
        "sliding_window",
        "scaling",
        "dropout",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "use_cache",
        "cache_position",
        "is_causal",
    }
)


def family_of(config) -> Family | None:
    return _BY_MODEL_TYPE.get(getattr(config, "model_type", None))


def supported_names() -> str:
    return ", ".join(f.name for f in FAMILIES)


def _unset(value) -> bool:
    return value in (None, False, 0, 1, 1.0)


def config_problems(config, *, packed: bool) -> list[str]:
    """Why the worker cannot train a model of `config` exactly as Hugging Face computes it (empty when it can)."""
    kind = getattr(config, "model_type", "?")
    problems = []
    for name in LOGIT_TRANSFORMS:
        if not _unset(getattr(config, name, None)):
            problems.append(
                f"config.{name}={getattr(config, name)}: a logit transform the fused cross-entropy does not apply"
            )
    if not packed:
        return problems
    if family_of(config) is None:
        problems.append(
            f"model_type '{kind}' is not one of the families whose packed loss sftflow has checked against Hugging "
            f"Face ({supported_names()}); train it with plan mode 'padded', which runs the model's own attention"
        )
        return problems
    for name, what in ATTENTION_FEATURES.items():
        value = getattr(config, name, None)
        if value not in (None, False):
            problems.append(f"config.{name}={value}: {what} is not implemented by the varlen attention kernels")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        problems.append(
            f"config.attention_dropout={dropout}: the varlen attention has no dropout; set train.model_overrides "
            "{attention_dropout: 0.0}"
        )
    return problems


def check_config(config, *, packed: bool, spec: str) -> None:
    """Raise a `ValueError` naming the model, every feature it cannot reproduce, and the way out."""
    problems = config_problems(config, packed=packed)
    if problems:
        arch = ",".join(getattr(config, "architectures", None) or [getattr(config, "model_type", "?")])
        raise ValueError(f"model {spec!r} ({arch}) cannot be trained exactly: " + "; ".join(problems))


def router_aux_loss_coef(config) -> float | None:
    """The weight of the router's load-balancing loss that the model's own forward adds to its loss, or None."""
    family = family_of(config)
    if family is None or not family.router_aux_loss or not getattr(config, "output_router_logits", False):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) or None
