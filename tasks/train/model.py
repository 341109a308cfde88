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

import contextlib
import logging
import math
import sys
from pathlib import Path

import torch
from torch import nn

from sftflow.kernels.attention import varlen_attention
from sftflow.kernels.cross_entropy import linear_cross_entropy
from sftflow.tasks.train.collate import IGNORE_INDEX
from sftflow.tasks.train.families import KNOWN_ATTENTION_KWARGS, check_config, router_aux_loss_coef
from sftflow.tasks.train.weights import CheckpointFiles, grow_vocabulary, meta_model, shard_loadable

log = logging.getLogger(__name__)

ATTENTION_NAME = "sftflow_varlen"
PRESETS = ("tiny-llama",)


def _window(module, kwargs) -> int | None:
    """The layer's sliding window, read as the model hands it over: the `sliding_window` keyword (Mistral, Phi-3,
    Qwen2/3, Gemma 3 pass it, None on full-attention layers), else the attention module's attribute."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return None if window is None else int(window)


def _packed_qkv(module, query, key, value, dropout, kwargs):
    """q (T, H, D), k and v (T, K, D), cu_seqlens, max_seqlen and the sliding window of one packed row, checked."""
    unknown = sorted(k for k, v in kwargs.items() if k not in KNOWN_ATTENTION_KWARGS and v is not None)
    if unknown:
        raise ValueError(
            f"attention '{ATTENTION_NAME}': {type(module).__name__} passes {unknown}, which the varlen attention does "
            "not implement; train this model with plan mode 'padded'"
        )
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
    # squeeze, not [0]: a select's backward writes the gradient into a zero-filled (1, H, T, D) buffer with a strided
    # copy, for q, k and v of every layer (a memory-bound pass per tensor); a squeeze's backward is a view.
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
    return q, k, v, cu_seqlens, max_seqlen, _window(module, kwargs)


def sftflow_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Hugging Face attention function: `query` (1, H, T, D), `key`/`value` (1, K, T, D) -> ((1, T, H, D), None)."""
    q, k, v, cu_seqlens, max_seqlen, window = _packed_qkv(module, query, key, value, dropout, kwargs)
    out_THD = varlen_attention(q, k, v, cu_seqlens, max_seqlen, scaling, window)
    return out_THD.unsqueeze(0), None


def in_graph_attention(backend: str):
    """`sftflow_varlen_attention` on one backend whose kernels are `torch.library` ops (`flash_attn_4`, `triton`),
    without the dispatch: the op is what a compiled layer traces into its graph (`sftflow.tasks.train.compile`)."""
    if backend == "flash_attn_4":
        from sftflow.kernels.attention_fa4 import fa4_varlen_attention as attend
    elif backend == "triton":
        from sftflow.kernels.attention_triton import triton_varlen_attention as attend
    else:
        raise ValueError(f"attention backend {backend!r} has no torch.library op to trace")

    def sftflow_varlen_attention_op(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q, k, v, cu_seqlens, max_seqlen, window = _packed_qkv(module, query, key, value, dropout, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])  # varlen_attention's default
        return attend(q, k, v, cu_seqlens, max_seqlen, scale, window).unsqueeze(0), None

    return sftflow_varlen_attention_op


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, sftflow_varlen_attention)


def _attn_implementation(packed: bool) -> str:
    if packed:
        register_attention()
        return ATTENTION_NAME
    return "sdpa"


def model_config(spec: str, *, vocab_size: int | None, overrides: dict | None = None):
    """The Hugging Face config of `spec` (a preset, a config.json, a local folder or a hub id), without weights."""
    from transformers import AutoConfig

    overrides = dict(overrides or {})
    if spec == "tiny-llama":
        from sftflow.tasks.tiny import tiny_llama_config

        if vocab_size is None:
            raise ValueError("model='tiny-llama' needs the vocabulary size of the data or a tokenizer")
        return tiny_llama_config(vocab_size, **overrides)
    return AutoConfig.from_pretrained(spec, **overrides)


def preflight(
    spec: str, *, packed: bool, overrides: dict | None = None, lora=None, vocab_size: int | None = None
) -> None:
    """The model checks the worker makes, run before launching it: from the config alone (no weights are read), so a
    model the worker would refuse fails here with one located line instead of after torchrun has started."""
    # A preset's vocabulary comes from the data inside the worker; its structure is all that is checked here. The
    # stand-in vocabulary must hold the config's BOS/EOS ids, or transformers prints a warning on every launch.
    stand_in = max(vocab_size or 0, 256) if spec in PRESETS else None
    config = model_config(spec, vocab_size=stand_in, overrides=overrides)
    check_config(config, packed=packed, spec=spec)
    if lora is not None and spec not in PRESETS and vocab_size is not None and vocab_size > config.vocab_size:
        # Grown rows start at the mean embedding; with the embeddings and head frozen they would stay there, and
        # the model could never learn to read or write the template's own tokens.
        raise ValueError(
            f"{spec}: the data's tokenizer has {vocab_size - config.vocab_size} tokens the model lacks (its template "
            "adds them), and LoRA keeps the embeddings frozen, so they could not be learned; use the model's own "
            "template (data.render.template: auto) or train without train.lora"
        )
    if lora is not None and not isinstance(lora.targets, str):
        from transformers import AutoModelForCausalLM

        from sftflow.tasks.train.lora import check_targets

        with torch.device("meta"):
            check_targets(AutoModelForCausalLM.from_config(config), lora, spec)


def init_device(config, device: torch.device | None) -> torch.device:
    """Where a model built from its config draws its random weights: on `device` when it is a GPU with room for the
    fp32 weights and a bf16 copy of them (what the one-GPU path holds while it casts), else on the CPU. Drawing an 8B
    model's normal values took about two minutes on 16 CPU cores; a GPU writes its 32 GB at memory speed. Every rank
    seeds its generators alike first (`torch.manual_seed` seeds the GPUs' too), so the ranks' weights are identical
    either way."""
    if device is None or device.type != "cuda":
        return torch.device("cpu")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n_params, _ = count_params(AutoModelForCausalLM.from_config(config))
    free, _ = torch.cuda.mem_get_info(device)
    return device if 6 * n_params <= 0.9 * free else torch.device("cpu")


def build_model(
    spec: str,
    *,
    vocab_size: int | None,
    packed: bool,
    overrides: dict | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """A causal LM in fp32: from a preset, a config.json, a local folder or a hub id. Call `torch.manual_seed` first:
    every rank must build identical random weights. Random weights (presets, config.json) are drawn on `device` where
    it is a GPU with room for them (`init_device`); everything else is built on the CPU (FSDP moves it to the mesh's
    device)."""
    from transformers import AutoModelForCausalLM

    attn = _attn_implementation(packed)
    if spec in PRESETS or (spec.endswith(".json") and Path(spec).is_file()):
        config = model_config(spec, vocab_size=vocab_size, overrides=overrides)
        # Under a device context transformers allocates the parameters there and runs its initialisation on them
        # (without `device`, a caller's own device context holds).
        with contextlib.nullcontext() if device is None else init_device(config, device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    else:
        overrides = dict(overrides or {})
        model = AutoModelForCausalLM.from_pretrained(spec, attn_implementation=attn, dtype=torch.float32, **overrides)
        if vocab_size is not None and model.config.vocab_size < vocab_size:
            old = grow_vocabulary(model, vocab_size)
            log.info("%s: embeddings grown from %d to %d rows for the tokens the template added", spec, old, vocab_size)
    model = model.to(torch.float32)
    check_model(model, packed=packed, vocab_size=vocab_size, spec=spec)
    return model


def build_training_model(
    spec: str,
    *,
    vocab_size: int | None,
    packed: bool,
    overrides: dict | None = None,
    device: torch.device | None = None,
) -> tuple[nn.Module, CheckpointFiles | None]:
    """The model the worker trains, and where its weights are when they are still to be read.

    A local Hugging Face folder with safetensors weights is built on the meta device, and the checkpoint files come
    back with it: `sftflow.tasks.train.weights.materialize` reads each rank's rows once the model is sharded. Anything
    else (presets, config.json, hub ids, non-safetensors checkpoints, and tensors that transformers converts on load
    in ways other than a rename or a stack of experts) is `build_model`'s fp32 model (random weights drawn on
    `device` where they fit there), and None.
    """
    files = CheckpointFiles.find(spec) if Path(spec).is_dir() else None
    if files is None:
        return build_model(spec, vocab_size=vocab_size, packed=packed, overrides=overrides, device=device), None
    config = model_config(spec, vocab_size=vocab_size, overrides=overrides)
    if vocab_size is not None and config.vocab_size < vocab_size:
        # Tokens a template writes were added to the tokenizer: the embeddings (and an untied head) get rows for
        # them, filled with the mean of the checkpoint's rows when it is read (`weights._grown_rows`).
        log.info(
            "%s: embeddings grown from %d to %d rows for the tokens the template added",
            spec,
            config.vocab_size,
            vocab_size,
        )
        config.vocab_size = vocab_size
    lm = meta_model(config, _attn_implementation(packed))
    missing = shard_loadable(lm, files)
    if missing:
        log.info(
            "%s: the checkpoint names tensors differently from the model (%s, ...); loading it whole on each rank",
            spec,
            ", ".join(missing[:3]),
        )
        return build_model(spec, vocab_size=vocab_size, packed=packed, overrides=overrides), None
    check_model(lm, packed=packed, vocab_size=vocab_size, spec=spec)
    return lm, files


def check_model(model: nn.Module, *, packed: bool, vocab_size: int | None, spec: str) -> None:
    config = model.config
    check_config(config, packed=packed, spec=spec)
    if packed and not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"model {spec!r} ({type(model).__name__}) cannot run a custom attention function, so packed rows would "
            "attend across documents; make the plan with mode='padded'"
        )
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(f"model {spec!r} has vocab_size={config.vocab_size} but the data has ids up to {vocab_size}")


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

    def __init__(self, lm: nn.Module, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.lm = lm
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]
        self.router_aux_loss_coef = router_aux_loss_coef(lm.config)
        # Set where parameters of two dtypes meet in one matmul (fp32 LoRA adapters on a bf16 base): the decoder then
        # computes in this dtype, as FSDP's mixed precision casts them where the model is sharded.
        self.autocast_dtype = autocast_dtype
        # When set, each forward also keeps its trained tokens' losses and hits (`last_row_stats`, (2, n)) for the
        # per-source and per-tag breakdown of the training loss.
        self.keep_row_stats = False
        self.last_row_stats: torch.Tensor | None = None

    def forward(
        self, input_ids, position_ids, labels, attention_mask=None, cu_seqlens=None, max_seqlen=None, loss_rows=None
    ):
        attn_kwargs = {}
        if cu_seqlens is not None:
            attn_kwargs = dict(
                cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen
            )
        if self.router_aux_loss_coef is not None:
            attn_kwargs["output_router_logits"] = True
        autocast = (
            torch.autocast(input_ids.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            out = self.lm.base_model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=False,
                **attn_kwargs,
            )
        weight = self.lm.get_output_embeddings().weight
        if self.keep_row_stats:
            loss_sum, self.last_row_stats = linear_cross_entropy(
                out.last_hidden_state, weight, labels, rows=loss_rows, row_stats=True
            )
        else:
            loss_sum = linear_cross_entropy(out.last_hidden_state, weight, labels, rows=loss_rows)
        if self.router_aux_loss_coef is not None:
            loss_sum = loss_sum + self._router_loss(out.router_logits, attention_mask, labels, loss_rows)
        return loss_sum

    def _router_loss(self, router_logits, attention_mask, labels, loss_rows) -> torch.Tensor:
        """The model's own load-balancing loss over this micro-batch's tokens, times its coefficient, as a sum over
        trained targets: the step divides by its trained-token count, so a step of one micro-batch gets exactly the
        `loss + router_aux_loss_coef * aux_loss` of the model's forward, and several get the token-weighted mean."""
        config = self.lm.config
        balance = sys.modules[type(self.lm).__module__].load_balancing_loss_func
        aux = balance(router_logits, config.num_experts, config.num_experts_per_tok, attention_mask)
        targets = loss_rows.numel() if loss_rows is not None else (labels != IGNORE_INDEX).sum()
        return self.router_aux_loss_coef * aux * targets


def model_batch(batch: dict, device: torch.device, vocab_size: int | None = None) -> dict:
    """The tensors `CausalLMLoss.forward` takes, moved to `device` without a host sync.

    `max_seqlen` stays a Python int, and `loss_rows` (the flat positions with a target, found by the collator) come
    with the batch, their targets checked against `vocab_size` here on the CPU: on the device both would be host
    syncs in the loss. On CUDA the tensors are pinned first, so their copies queue behind the device's work instead
    of waiting for it.
    """
    keys = ("input_ids", "position_ids", "labels", "attention_mask", "cu_seqlens", "loss_rows", "loss_row_cells")
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


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal attention), as the model applies it: by `layer_types`
    where the config has them (Qwen2/3, Gemma 3, SmolLM3), else `sliding_window` on every layer (Mistral, Phi-3).
    For FLOP counts; `tests/tasks/train/test_families.py` holds it to the windows the layers hand the attention."""
    window = getattr(config, "sliding_window", None)
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return [window] * config.num_hidden_layers


def attention_width(config) -> int:
    """Query heads x head dim: the width of the attention matmuls (FLOP estimates)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim
