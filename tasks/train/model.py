"""Model building: a Hugging Face causal LM with sftflow's varlen attention, wrapped so the loss is computed inside
the FSDP root's forward.

Packed rows hold several documents back to back. Attention must never cross a document boundary, so a packed model
runs the attention function registered here as `"sftflow_varlen"`: Hugging Face passes `cu_seq_lens_q` and
`max_length_q` (forwarded from the base model's `**kwargs`) through to it, and it calls
`sftflow.kernels.attention.varlen_attention` (block-diagonal causal). Position ids reset at each document, so RoPE sees
every document from position 0. A padded plan uses the model's stock `sdpa` with an attention mask instead.

`CausalLMLoss` is the module FSDP wraps as its root: `forward` runs the base model to the final hidden states and then
the fused linear + cross-entropy kernel on `lm_head.weight`. Inside the root's forward FSDP has all-gathered the root's
own parameters (embeddings, final norm, LM head), so reading `lm_head.weight` there gives the full, unsharded weight,
and its gradient is reduce-scattered by the root's post-backward hook like any other root parameter. This also works
for tied embeddings, where the head and the embedding are one parameter of the same unit. The (T, V) logits are never
materialised.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn

from sftflow.kernels.attention import varlen_attention
from sftflow.kernels.cross_entropy import linear_cross_entropy
from sftflow.tasks.train.collate import IGNORE_INDEX

log = logging.getLogger(__name__)

ATTENTION_NAME = "sftflow_varlen"
PRESETS = ("tiny-llama",)
# Config fields that change the logits after the LM head; the fused loss does not apply them, so refuse such models.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _packed_qkv(module, query, key, value, dropout, kwargs):
    """q (T, H, D), k and v (T, K, D), cu_seqlens and max_seqlen of one packed row, checked."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_seqlen = kwargs.get("max_length_q")
    if cu_seqlens is None or max_seqlen is None:
        raise ValueError(
            f"attention '{ATTENTION_NAME}' needs cu_seq_lens_q and max_length_q (a packed row); refusing to attend "
            "across documents. Pass them to the model's forward, or build the model for padded mode."
        )
    if query.shape[0] != 1:
        raise ValueError(f"attention '{ATTENTION_NAME}' takes one packed row, got batch size {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention '{ATTENTION_NAME}' has no dropout; set the model's attention_dropout to 0")
    if getattr(module, "sliding_window", None):
        raise ValueError(f"attention '{ATTENTION_NAME}' does not implement sliding windows ({type(module).__name__})")
    # squeeze, not [0]: a select's backward writes the gradient into a zero-filled (1, H, T, D) buffer with a strided
    # copy, for q, k and v of every layer (~0.5 ms of a 1B-model step on an H200); a squeeze's backward is a view.
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
    return q, k, v, cu_seqlens, max_seqlen


def sftflow_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Hugging Face attention function: `query` (1, H, T, D), `key`/`value` (1, K, T, D) -> ((1, T, H, D), None)."""
    q, k, v, cu_seqlens, max_seqlen = _packed_qkv(module, query, key, value, dropout, kwargs)
    out_THD = varlen_attention(q, k, v, cu_seqlens, max_seqlen, scaling)
    return out_THD.unsqueeze(0), None


def sftflow_varlen_attention_op(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`sftflow_varlen_attention` on the Triton backend, without the dispatch: its `torch.library` op is what a
    compiled layer traces into its graph (`sftflow.tasks.train.compile`)."""
    from sftflow.kernels.attention_triton import triton_varlen_attention

    q, k, v, cu_seqlens, max_seqlen = _packed_qkv(module, query, key, value, dropout, kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])  # varlen_attention's default
    return triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale).unsqueeze(0), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sftflow_varlen_attention)


def _attn_implementation(packed: bool) -> str:
    if packed:
        register_attention()
        return ATTENTION_NAME
    return "sdpa"


def build_model(spec: str, *, vocab_size: int | None, packed: bool, overrides: dict | None = None) -> nn.Module:
    """A causal LM in fp32 on CPU (FSDP moves it to the mesh's device): from a preset, a config.json, a local
    folder or a hub id. Call `torch.manual_seed` first: every rank must build identical random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = _attn_implementation(packed)
    overrides = dict(overrides or {})
    if spec == "tiny-llama":
        from sftflow.tasks.tiny import tiny_llama_config

        if vocab_size is None:
            raise ValueError("model='tiny-llama' needs the vocabulary size of the data or a tokenizer")
        model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size, **overrides), attn_implementation=attn)
    elif spec.endswith(".json") and Path(spec).is_file():
        config = AutoConfig.from_pretrained(spec, **overrides)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec, attn_implementation=attn, dtype=torch.float32, **overrides)
    model = model.to(torch.float32)
    check_model(model, packed=packed, vocab_size=vocab_size, spec=spec)
    return model


def check_model(model: nn.Module, *, packed: bool, vocab_size: int | None, spec: str) -> None:
    config = model.config
    if packed and not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"model {spec!r} ({type(model).__name__}) cannot run a custom attention function, so packed rows would "
            "attend across documents; make the plan with mode='padded'"
        )
    for name in _UNSUPPORTED_LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"model {spec!r}: config.{name}={getattr(config, name)} is not supported by the fused loss"
            )
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(f"model {spec!r} has vocab_size={config.vocab_size} but the data has ids up to {vocab_size}")
    if getattr(config, "attention_dropout", 0.0):
        log.warning("model %r: attention_dropout=%s is ignored by varlen attention", spec, config.attention_dropout)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the classes named in `_no_split_modules`), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no `_no_split_modules`)")
    return layers


class CausalLMLoss(nn.Module):
    """FSDP root: the summed masked cross-entropy of a (packed or padded) micro-batch.

    `labels` are pre-shifted (see `sftflow.tasks.train.collate`): `labels[t]` is the target of position `t`.
    Returns the *sum* over trained targets (an fp32 scalar, a graph-connected zero when nothing is trained); the
    training step divides by the step's global trained-token count.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]

    def forward(
        self, input_ids, position_ids, labels, attention_mask=None, cu_seqlens=None, max_seqlen=None, loss_rows=None
    ):
        attn_kwargs = {}
        if cu_seqlens is not None:
            attn_kwargs = dict(
                cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen
            )
        out = self.lm.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **attn_kwargs,
        )
        weight = self.lm.get_output_embeddings().weight
        return linear_cross_entropy(out.last_hidden_state, weight, labels, rows=loss_rows)


def model_batch(batch: dict, device: torch.device, vocab_size: int | None = None) -> dict:
    """The tensors `CausalLMLoss.forward` takes, moved to `device` without a host sync.

    `max_seqlen` stays a Python int, and `loss_rows` (the flat positions with a target, found by the collator) come
    with the batch, their targets checked against `vocab_size` here on the CPU: on the device both would be host
    syncs in the loss. On CUDA the tensors are pinned first, so their copies queue behind the device's work instead
    of waiting for it.
    """
    keys = ("input_ids", "position_ids", "labels", "attention_mask", "cu_seqlens", "loss_rows")
    if vocab_size is not None and batch["loss_rows"].numel():
        targets = batch["labels"].reshape(-1)[batch["loss_rows"]]
        bad = targets[(targets < 0) | (targets >= vocab_size)]
        if bad.numel():
            raise ValueError(f"labels: value {int(bad[0])} is outside [0, {vocab_size}) and is not {IGNORE_INDEX}")
    pin = device.type == "cuda"
    out = {k: (batch[k].pin_memory() if pin else batch[k]).to(device, non_blocking=True) for k in keys if k in batch}
    if "cu_seqlens" in batch:
        out["max_seqlen"] = int(batch["max_seqlen"])
    return out


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, parameters that take part in matmuls), counting shared tensors once.

    The input embedding is a lookup, not a matmul, so it is left out of the second count; but with tied embeddings
    the same matrix is also the LM head, a (T, D) x (D, V) matmul, so then it counts.
    """
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return total, total - embed + (embed if tied else 0)


def attention_width(config) -> int:
    """Query heads x head dim: the width of the attention matmuls (FLOP estimates)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim
