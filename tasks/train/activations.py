"""Activation checkpointing: keep fewer activations for the backward and recompute them, so longer rows fit.

Each Hugging Face decoder layer is a `GradientCheckpointingLayer`: with its `gradient_checkpointing` flag set, its
call runs under `torch.utils.checkpoint` (non-reentrant), so only the layer's input is kept and the layer is run
again in the backward. That composes with what runs inside the layer (compiled forward, the Triton attention op,
FSDP2's hooks on the layer) because the checkpoint wraps the whole call. Modes:

- `full`: every decoder layer; activation memory drops to about one layer's input per layer, for ~1/3 more compute;
- `selective`: every `every`-th layer (default 2: half the layers), half the saving for half the cost;
- `off`;
- `auto`: off on a CPU; on a GPU, `full` when the estimated activations of a planned row do not fit in the memory
  the model, gradients and optimizer state leave (`needs_checkpointing`), else off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("sftflow.train")


def needs_checkpointing(config, row_tokens: int, trained_params: int, frozen_bytes: float, free_bytes: int) -> bool:
    """Whether activations of a `row_tokens` row likely exceed what is left of `free_bytes` (a GPU's memory) after
    weights (2 bytes), fp32 masters and AdamW moments (12 bytes) and gradients (4 bytes) of the trained parameters,
    and the frozen weights as held (`frozen_bytes`: 2 per bf16 weight, ~0.52 per NF4 one). The estimate, per token
    and layer, is the bf16 tensors a Llama-style layer keeps for its backward: ~10 hidden-sized (norm inputs, q, k, v,
    attention output, residuals) and ~4 intermediate-sized (gate, up, activation, product); it is rough, and
    `activation_checkpointing: full|off` overrides it."""
    hidden, inter = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    per_token = 2 * (10 * hidden + 4 * inter) * config.num_hidden_layers
    state = 18 * trained_params + frozen_bytes
    return row_tokens * per_token > 0.8 * (free_bytes - state)


def apply_activation_checkpointing(layers: list[nn.Module], mode: str, every: int = 2) -> int:
    """Turn checkpointing on for the decoder `layers` (all for `full`, every `every`-th for `selective`); returns how
    many. The layers' `gradient_checkpointing` flag is what transformers' `gradient_checkpointing_enable` sets."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    if mode == "off":
        return 0
    chosen = layers if mode == "full" else layers[::every]
    for layer in chosen:
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(
                f"{type(layer).__name__} cannot checkpoint its activations (not a transformers "
                "GradientCheckpointingLayer); set train.activation_checkpointing: off"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    return len(chosen)


def resolve_activation_checkpointing(
    mode: str, device: torch.device, config, row_tokens: int, trained_params: int, frozen_bytes: float
) -> str:
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "off"
    free, _ = torch.cuda.mem_get_info(device)
    chosen = "full" if needs_checkpointing(config, row_tokens, trained_params, frozen_bytes, free) else "off"
    log.info("activation checkpointing auto: %s for rows of %d tokens", chosen, row_tokens)
    return chosen
