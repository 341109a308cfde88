"""The throughput benchmark's setup: model presets (from `sftflow.tasks.shapes`), the mock data and its plan, the
batches each mode trains on, and the helpers every mode uses."""

from __future__ import annotations

import gc
import math
import os
import re
import socket

import numpy as np
import torch
from torch import nn

from sftflow.tasks.shapes import SHAPES

# The presets by their command-line names, shapes of `sftflow.tasks.shapes`: llama1b (Llama-3.2-1B-shaped, the
# default), llama8b (Llama-3.1-8B-shaped), mistral1b (the 1B shape as Mistral, sliding-window attention on every
# layer: with `--sliding-window 0` the same model with full attention), qwen1.5b (Qwen2.5-1.5B's shape, another ratio
# of MLP to hidden width, for the activation estimate's calibration), phi3mini (Phi-3-mini's: multi-head K/V, for the
# activation estimate's per-family fractions) and tiny (CPU plumbing runs).
PRESET_SHAPES = {
    "llama1b": "llama3.2-1b",
    "llama8b": "llama3.1-8b",
    "mistral1b": "mistral-1b",
    "qwen1.5b": "qwen2.5-1.5b",
    "phi3mini": "phi3-mini",
    "tiny": "tiny-tied",
}
PRESETS = {preset: SHAPES[name] for preset, name in PRESET_SHAPES.items()}
PAD_ID = 0
MODES = ("A", "B", "C", "Cl", "Cn", "Cnac", "Cac", "Clac", "D", "De", "Df", "Dsel", "Dac", "L", "Lp", "Lpac", "Q")
MULTI_GPU_MODES = {"B", "C", "Cac", "Clac"}  # the FSDP baselines, under torchrun --nproc-per-node N
COUNTED_MODE = re.compile(r"D(\d+)(?:b(\d*\.?\d+))?")  # D<N>[b<budget>]: N checkpointed layers, that budget
LORA_RANK = 16  # on every linear layer of the decoder, alpha = 2 * rank
BASELINE_ATTENTION = "bench_torch_varlen"


# ---------------------------------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(device: str):
    """A world of one (what torchrun --nproc-per-node 1 gives the worker), then the worker's own `init_distributed`."""
    from sftflow.tasks.train.fsdp import init_distributed

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return init_distributed(device)


def llama_config(preset: str, sliding_window: int | None = None):
    """The preset's config; `sliding_window` (0 for none) overrides a windowed preset's window."""
    from transformers import AutoConfig

    fields = PRESETS[preset].fields()
    model_type = PRESETS[preset].family
    if sliding_window is not None:
        if "sliding_window" not in fields:
            raise ValueError(f"--sliding-window: preset {preset} has no sliding-window attention")
        fields["sliding_window"] = sliding_window or None
    return AutoConfig.for_model(model_type, **fields)


def make_data(args, vocab_size: int, rows_needed: int, num_ranks: int = 1):
    """Mock documents and a plan with at least `rows_needed` steps of one `args.row_tokens`-token row per rank."""
    from sftflow.tasks.plan.planner import PlanConfig, plan
    from sftflow.tasks.train.mock import MockConfig, MockDataset, sample_lengths

    def mock(n: int) -> MockConfig:
        return MockConfig(
            num_docs=n,
            vocab_size=vocab_size,
            median_length=args.median_length,
            sigma=args.sigma,
            min_length=args.min_length,
            max_length=args.max_length,
            loss_spans=True,
            seed=args.seed,
        )

    mean_len = float(sample_lengths(mock(4096)).mean())
    num_docs = int(math.ceil(1.3 * rows_needed * num_ranks * args.row_tokens / mean_len)) + 16
    dataset = MockDataset(mock(num_docs))
    config = PlanConfig(num_ranks=num_ranks, tokens_per_rank=args.row_tokens, micro_batches_per_step=1, seed=args.seed)
    arrays, stats = plan(dataset.lengths, dataset.loss_token_counts, config)
    if arrays.num_steps < rows_needed:
        raise ValueError(f"plan has {arrays.num_steps} steps; the benchmark needs {rows_needed}")
    return dataset, arrays, stats


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def free_everything(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def free_everything_but_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_params(lm: nn.Module) -> int:
    """Decoder-layer parameters plus the LM head's (V x H) matmul, counted once even when tied."""
    from sftflow.tasks.train.model import decoder_layers

    layers = sum(p.numel() for layer in decoder_layers(lm) for p in layer.parameters())
    return layers + lm.get_output_embeddings().weight.numel()


def shard_like_worker(root: nn.Module, lm: nn.Module, env, param_dtype: torch.dtype) -> nn.Module:
    """The worker's FSDP2 wrapping (`sftflow.tasks.train.fsdp.shard_model`) around a baseline's own root module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sftflow.tasks.train.model import decoder_layers

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(lm):
        fully_shard(layer, mesh=env.mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(root, mesh=env.mesh, mp_policy=mp, reshard_after_forward=False)
    return root


def compile_layers(lm: nn.Module) -> None:
    """Regional compilation: each decoder layer's forward; FSDP's hooks stay outside the compiled region."""
    from sftflow.tasks.train.model import decoder_layers

    for layer in decoder_layers(lm):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def dynamo_stats() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")}
    except Exception as err:  # diagnostics only
        return {"error": repr(err)}


# ---------------------------------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------------------------------


def packed_rows(plan, dataset, steps: int, rank: int = 0) -> list[dict]:
    """`rank`'s rows of the plan's first `steps` steps through the worker's packed collator (the rows D trains on)."""
    from sftflow.tasks.train.collate import collate, packed_collator
    from sftflow.tasks.train.data import plan_row

    fns = packed_collator(PAD_ID)
    return [collate([dataset[int(i)] for i in plan_row(plan, s, 0, rank)], fns) for s in range(steps)]


def step_totals(plan, dataset, steps: int) -> list[tuple[int, float]]:
    """(tokens, sum of squared document lengths) of each of the first `steps` steps over every rank: what a step of
    a multi-GPU baseline trains, known from the plan without a collective."""
    from sftflow.tasks.train.data import plan_row

    totals = []
    for s in range(steps):
        lengths = np.concatenate([dataset.lengths[plan_row(plan, s, 0, r)] for r in range(plan.num_ranks)])
        lengths = lengths.astype(np.float64)
        totals.append((int(lengths.sum()), float((lengths**2).sum())))
    return totals


def padded_batches(plan, dataset, steps: int, batch_size: int) -> list[dict]:
    """TRL's default: the same document stream, `batch_size` documents per batch, padded to the longest. Labels in
    Hugging Face's convention (unshifted: the model shifts them)."""
    from sftflow.tasks.train.collate import IGNORE_INDEX, collate, padded_collator

    fns = padded_collator(PAD_ID)
    order = plan.doc_ids[: steps * batch_size]
    batches = []
    for s in range(steps):
        docs = [dataset[int(i)] for i in order[s * batch_size : (s + 1) * batch_size]]
        batch = collate(docs, fns)
        hf_labels = torch.full_like(batch["labels"], IGNORE_INDEX)
        hf_labels[:, 1:] = batch["labels"][:, :-1]  # ours: labels[t] is the target of t; HF: labels[t] is token t
        batch["hf_labels"] = hf_labels
        batches.append(batch)
    return batches


def batch_tokens(batch: dict) -> tuple[int, float]:
    lengths = batch["doc_lengths"].double()
    return int(lengths.sum()), float((lengths**2).sum())
