"""What a worker says when the device (or, on a CPU, the host) runs out of memory: where it happened, what the run
asked for next to sftflow's estimate, and the settings that leave more room.

A retry would train the same rows with the same settings and run out again, so the worker reports it as a user error
(`worker.USER_ERROR`): the launcher raises it as one line and the train stage is not retried.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from sftflow.tasks.train.activations import (
    OVERHEAD_BYTES,
    USABLE_FRACTION,
    checkpointing_label,
    max_row_tokens,
    peak_bytes,
)
from sftflow.tasks.train.launch import ALLOC_CONF_VARS

GIB = 2**30


class OutOfMemory(ValueError):
    """The run does not fit its device with these settings (a `ValueError`: retrying cannot help)."""


@dataclass
class MemoryPicture:
    """What the worker chose for a run's memory, kept for the report should it run out anyway."""

    model_config: object  # the Hugging Face config (layers, hidden sizes) the activation estimate reads
    tokens_per_rank: int
    parallel: str  # "single" or "fsdp"
    world_size: int
    checkpointing: str | int  # as applied: off, selective, full, or a number of layers
    offload: bool  # checkpointed inputs wait in host memory
    compiled: bool  # the decoder layers are compiled (the memory budget applies to them)
    budget: float  # the compiled layers' activation memory budget
    state_bytes: float  # weights, masters, moments and gradients on one device (`model_state_bytes`)
    free_bytes: int | None  # what the device had free before the model was built (None on a CPU)
    optimizer_in_backward: bool
    optimizer_offload: str | int
    lora: bool


@dataclass
class MemoryWatch:
    """Where the worker is (`where`) and, once the model is built, what it chose (`picture`): turns an out-of-memory
    error raised inside `with watch:` into `OutOfMemory` with the report."""

    rank: int
    device: str | None = None  # set once the process group is up
    where: str = "while building the model"
    picture: MemoryPicture | None = field(default=None)

    def __enter__(self) -> MemoryWatch:
        return self

    def __exit__(self, kind, err, tb) -> None:
        if err is not None and is_out_of_memory(err):
            raise OutOfMemory(report(err, self.rank, self.device, self.where, self.picture)) from err


def is_out_of_memory(err: BaseException) -> bool:
    """A CUDA allocation that failed (`torch.OutOfMemoryError`), or the CPU allocator's failure, which torch raises
    as a plain RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err)
    )


def expandable_segments() -> bool:
    """Whether this process's CUDA allocator grows segments in place (the launcher's default; a user may turn it
    off through either of torch's variables)."""
    settings = ",".join(os.environ.get(name, "") for name in ALLOC_CONF_VARS).replace(" ", "").lower()
    return "expandable_segments:true" in settings


def _torch_says(err: BaseException) -> str:
    """The part of torch's message that sizes the failure: what was asked for and what the device had."""
    text = " ".join(str(err).split())
    asked = re.search(r"Tried to allocate [^.]*\.(?:\d+ \w+\.)?", text)
    device = re.search(r"GPU \d+ has a total capacity of .*? is free\.", text)
    cpu = re.search(r"you tried to allocate \d+ bytes", text)
    parts = [m.group(0).rstrip(".") for m in (asked, device, cpu) if m is not None]
    # Memory the caching allocator holds in blocks too small for the request: fragmentation, which torch's
    # expandable segments avoid (rows of varying length make it likelier).
    idle = re.search(r"([\d.]+) (\w+) is reserved by PyTorch but unallocated", text)
    if idle is not None and idle.group(2) in ("GiB", "TiB") and float(idle.group(1)) >= 1:
        held = f"{idle.group(1)} {idle.group(2)} reserved but unallocated"
        if expandable_segments():
            parts.append(f"{held} (fragmentation, with expandable segments already on)")
        else:
            parts.append(f"{held} (fragmentation: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    return "; ".join(parts) if parts else text[:200]


def more_room(p: MemoryPicture) -> list[str]:
    """The settings that would leave more room, leaving out those the run already has."""
    options = []
    layers = p.model_config.num_hidden_layers
    label = checkpointing_label(p.checkpointing, layers)
    if label != "full":
        options.append("train.memory.activation_checkpointing: full")
    if label != "off" and not p.offload and p.free_bytes is not None:
        options.append("train.memory.activation_offload: true")
    if p.compiled and p.budget >= 1 and label != "full":
        options.append("train.memory.activation_memory_budget: 0.99 (recompute the layers' elementwise outputs)")
    if p.parallel == "single" and not p.lora:
        if not p.optimizer_in_backward:
            options.append("train.optimizer.in_backward: true (no gradient memory; no clipping)")
        if p.optimizer_offload == "off":
            options.append("train.optimizer.offload: all (AdamW moments in host memory)")
    options.append(f"a smaller plan.tokens_per_rank (now {p.tokens_per_rank:,}; auto sizes it to the GPU)")
    if not p.lora:
        options.append("train.lora")
    options.append("more GPUs (train.nproc, train.nnodes)")
    return options


def report(err: BaseException, rank: int, device: str | None, where: str, p: MemoryPicture | None) -> str:
    """One line: where the run ran out, torch's sizes, sftflow's estimate for these settings, and what to change."""
    kind = "GPU" if isinstance(err, torch.OutOfMemoryError) else "host"
    line = f"out of {kind} memory on rank {rank}{f' ({device})' if device else ''} {where}: {_torch_says(err)}"
    if p is None:  # before any row: the weights (and what the optimizer adds) are what does not fit
        return line + (
            "; the model does not fit before any row is trained: train.lora or train.quantize: nf4, or more GPUs "
            "(FSDP shards the weights)"
        )
    config = p.model_config
    label = checkpointing_label(p.checkpointing, config.num_hidden_layers)
    need = peak_bytes(config, p.checkpointing, p.tokens_per_rank, p.state_bytes, p.offload, p.budget)
    activations = need - p.state_bytes - OVERHEAD_BYTES
    line += (
        f". Rows of {p.tokens_per_rank:,} tokens, activation checkpointing {label}, {p.parallel} path on "
        f"{p.world_size} process(es); sftflow's estimate: {p.state_bytes / GIB:.1f} GiB of weights and optimizer "
        f"state + {activations / GIB:.1f} GiB of activations + {OVERHEAD_BYTES / GIB:.0f} GiB "
        f"overhead = {need / GIB:.1f} GiB"
    )
    if p.free_bytes is not None:
        line += f", against {USABLE_FRACTION * p.free_bytes / GIB:.1f} GiB usable of {p.free_bytes / GIB:.1f} free"
        full = max_row_tokens(config, "full", p.state_bytes, p.free_bytes, offload=p.offload, budget=p.budget)
        if label != "full" and full > 0:
            line += f" (with full checkpointing rows up to {full:,} tokens fit)"
    return line + ". More room: " + "; ".join(more_room(p))
