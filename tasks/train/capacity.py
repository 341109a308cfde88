"""The longest packed row a training run fits on its GPUs: `plan.tokens_per_rank: auto`.

The plan fixes the row length before training starts, so the memory estimate the worker's `activation_checkpointing:
auto` uses (`sftflow.tasks.train.activations`) runs here on the run's settings instead: the model built on the meta
device (no weights read), LoRA adapters injected as the worker injects them, the state of the training path the worker
will take on `num_ranks` GPUs, and the checkpointing mode asked for. `auto` plans for rows that fit without
checkpointing, the fastest per token; ask for `activation_checkpointing: full` to plan the longest rows a GPU holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from sftflow.tasks.train.activations import checkpointing_label, max_row_tokens, state_bytes
from sftflow.tasks.train.config import parallel_path

log = logging.getLogger("sftflow.plan")
GIB = 2**30


@dataclass(frozen=True)
class RowCapacity:
    tokens: int  # the longest row that fits, a multiple of 1024
    mode: str  # the activation checkpointing it was sized for (`checkpointing_label`)
    parallel: str  # the training path it was sized for: single or fsdp
    free_bytes: int  # the device memory it was sized against
    state_bytes: float  # weights, masters, moments and gradients per device

    def describe(self) -> str:
        return (
            f"tokens_per_rank auto: {self.tokens:,} tokens (activation checkpointing {self.mode}, {self.parallel} "
            f"path, {self.state_bytes / GIB:.1f} GiB of weights and optimizer state in {self.free_bytes / GIB:.1f} "
            "GiB)"
        )


def planned_memory(train, num_ranks: int) -> tuple[str, str | int, float, bool]:
    """What `plan.tokens_per_rank: auto` sizes rows for, before the rows (and so the launch's choices) exist: the
    training path on `num_ranks` GPUs, and the activation checkpointing, memory budget and offload the rows are
    planned with. `auto` plans for rows that fit without checkpointing (the fastest per token) at a budget of 1 and
    without offload, which the launch may still turn on; a setting that was made is planned with as it is (a budget
    only for compiled layers: `compile: auto` compiles on GPUs)."""
    parallel = parallel_path(train.parallel, num_ranks, "cuda")  # sized for the GPUs that will train
    mode = "off" if train.memory.activation_checkpointing == "auto" else train.memory.activation_checkpointing
    budget = train.memory.activation_memory_budget
    budget = 1.0 if budget == "auto" or train.memory.compile == "off" else budget
    offload = train.memory.activation_offload is True and mode != "off"
    return parallel, mode, budget, offload


def model_state_bytes(
    lm: nn.Module,
    quantize: str,
    parallel: str,
    world_size: int,
    accumulating: bool,
    released: bool = False,
    offload: str | int = "off",
) -> float:
    """`state_bytes` of `lm` as built for training (a meta model will do): its trained and frozen parameters, the
    frozen ones at the size `quantize` holds them in, on `parallel` over `world_size` ranks (`released`: stepped in
    the backward; `offload`: `train.optimizer.offload`)."""
    from sftflow.tasks.train.host_moments import offloaded_numel
    from sftflow.tasks.train.model import decoder_layers
    from sftflow.tasks.train.quantize import frozen_weight_bytes

    return state_bytes(
        trained_params=sum(p.numel() for p in lm.parameters() if p.requires_grad),
        frozen_bytes=frozen_weight_bytes(lm, quantize),
        parallel=parallel,
        world_size=world_size,
        total_params=sum(p.numel() for p in lm.parameters()),
        num_layers=len(decoder_layers(lm)),
        accumulating=accumulating,
        largest_trained=max((p.numel() for p in lm.parameters() if p.requires_grad), default=0) if released else None,
        offloaded=offloaded_numel(lm, offload) if parallel == "single" else (0, 0),
    )


def device_free_bytes(memory_gib: float | None) -> int:
    """`memory_gib` when given, else what this machine's first GPU has free, read as a training run's launch reads
    it (`resolved.detect_hardware`)."""
    if memory_gib is not None:
        return int(memory_gib * GIB)
    if not torch.cuda.is_available():
        raise ValueError(
            "plan.tokens_per_rank: auto sizes rows for the training GPUs' memory, and this machine has no GPU to "
            "ask; set plan.device_memory_gib (free GiB on one training GPU: ~139 on an idle H200, ~79 on an 80 GB "
            "H100) or give plan.tokens_per_rank as a number"
        )
    from sftflow.tasks.train.hardware import detect_hardware

    return detect_hardware("cuda", 1).memory


def row_capacity(
    train,
    num_ranks: int,
    memory_gib: float | None = None,
    vocab_size: int | None = None,
    accumulating: bool = False,
) -> RowCapacity:
    """The longest row `train` (the run config's `train` section) fits on each of `num_ranks` GPUs; `accumulating`:
    a step adds up several micro-batches (fp32 gradients on one GPU)."""
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.lora import apply_lora
    from sftflow.tasks.train.model import PRESETS, model_config

    free = device_free_bytes(memory_gib)
    stand_in = max(vocab_size or 0, 256) if train.model in PRESETS else vocab_size
    try:
        config = model_config(train.model, vocab_size=stand_in, overrides=train.model_overrides)
    except OSError as err:
        raise ValueError(
            f"plan.tokens_per_rank: auto reads the model's config, and train.model {train.model!r} has none here "
            f"({err}); give a local folder or config.json, or plan.tokens_per_rank as a number"
        ) from err
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
        if train.lora is not None:
            apply_lora(lm, train.lora, train.model)
    parallel, mode, budget, offload = planned_memory(train, num_ranks)
    state = model_state_bytes(
        lm, train.quantize, parallel, num_ranks, accumulating, train.optimizer.in_backward, train.optimizer.offload
    )
    tokens = max_row_tokens(config, mode, state, free, offload=offload, budget=budget)
    limit = getattr(config, "max_position_embeddings", None)
    if limit:
        tokens = min(tokens, limit // 1024 * 1024 or limit)
    if tokens <= 0:
        more = "" if mode == "full" else "; train.memory.activation_checkpointing: full leaves more room, or "
        raise ValueError(
            f"plan.tokens_per_rank: auto: {train.model}'s weights and optimizer state (~{state / GIB:.1f} GiB a GPU "
            f"on the {parallel} path) leave no room for a row of 1,024 tokens in {free / GIB:.1f} GiB"
            f"{more or '; '}train LoRA (train.lora) or on more GPUs (train.nproc)"
        )
    label = checkpointing_label(mode, config.num_hidden_layers)
    capacity = RowCapacity(tokens=tokens, mode=label, parallel=parallel, free_bytes=free, state_bytes=state)
    log.info(capacity.describe())
    return capacity
