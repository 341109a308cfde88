"""End-to-end training throughput on one GPU: sftflow's training step against what users run today.

    python benchmarks/train_throughput.py [--modes A,B,C,D,De] [--out DIR]        # the 1B training benchmark (H200)
    python benchmarks/train_throughput.py --gpu-check DIR                         # the worker check
    python benchmarks/train_throughput.py --preset tiny --device cpu --modes A,D  # CPU smoke run (plumbing only)
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --preset llama8b --modes Cac  # a baseline on 2 GPUs

Model: Llama-3.2-1B-shaped (`--preset llama1b`, the default), random init (hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 8192, vocab 128256, tied embeddings); `--preset llama8b` is Llama-3.1-8B-shaped (hidden 4096, 32
layers, intermediate 14336, head dim 128, untied head). Data: `MockDataset` documents, lengths lognormal (median 600,
sigma 1, clipped to [16, 4096]), loss spans train about half of each document's tokens. The rows come from
`sftflow.tasks.plan.planner.plan` (16,384 tokens per row, one row per optimizer step, one rank).

Modes, all in one process, all with the same model init, fp32 master weights, bf16 compute, the worker's AdamW
(`build_optimizer`), gradient clipping at 1.0, one optimizer step per micro-batch. B, C and D are wrapped like the
worker (FSDP2 `fully_shard` per decoder layer and on the root, world size 1, bf16 params / fp32 reduce):

- **A** (TRL's default collator, as the HF Trainer runs it on one GPU): the plain model under bf16 autocast, batches
  of 8 documents padded to the longest, HF `sdpa` attention with a padding mask, HF's loss on materialised logits
  (`model(..., labels=...)`, mean over the batch's trained tokens). A batch that runs out of memory is skipped and
  counted (`oom_steps`).
- **B** (best assembly of libraries): the same packed rows as D, torch `varlen_attn` registered as a transformers
  attention function, Liger's fused linear cross-entropy (sum / trained tokens).
- **C**: B plus `torch.compile(dynamic=True)` of each decoder layer's forward (regional compilation).
- **Cl** / **Cn** (the one-GPU peers, as their users run them: no FSDP, the plain fp32 model under bf16 autocast,
  torch `varlen_attn`, torch's fused AdamW): Cl with Liger's full Llama kernel set (`apply_liger_kernel_to_llama`:
  RoPE, RMSNorm, SwiGLU and the fused linear CE), eager (torch 2.11's dynamo fails on Liger's RMSNorm function under
  autocast); Cn with Liger's fused linear CE and compiled decoder layers; **Cnac**: Cn with transformers' gradient
  checkpointing on every decoder layer, for rows whose activations do not fit a GPU without it.
- **Cac**: C plus transformers' gradient checkpointing on every decoder layer (`gradient_checkpointing_enable`,
  non-reentrant), how its users fit long rows or big models.
- **Clac**: Cac with Liger's full Llama kernel set (RoPE, RMSNorm, SwiGLU beside the fused linear CE): the strongest
  peer for a model whose fp32 weights and moments need FSDP's mixed precision rather than autocast (an 8B on one GPU).
- **D** (sftflow): the worker's own step, imported, not copied: `build_model`, the worker's default `compile="auto"`
  (on CUDA: each decoder layer's forward through `torch.compile(dynamic=True)`, sftflow's attention under
  `torch.compiler.disable`, RoPE in the projections' layout), the worker's default `parallel="auto"` (`parallelize`:
  on one GPU, no FSDP: bf16 parameters and `MasterAdamW` with fp32 masters) and
  `sftflow.tasks.train.worker.train_step` (`RankBatches` rows through the collators; `CausalLMLoss`: sftflow varlen
  attention + fused linear CE, loss / the plan's step trained-token count; clip folded into the optimizer kernel;
  one host sync for the step's statistics), then the scheduler and `MetricsLogger`.
- **De**: D with `compile="off"` (eager), to show what compilation buys.
- **Df**: D with `parallel="fsdp"` (FSDP2 at world size 1 and torch's fused AdamW, D before the one-device path).
- **L** / **Lp**: LoRA, rank 16 on every linear layer of the decoder: L is D with `train.lora` (the worker's
  `apply_lora`, frozen bf16 base, fp32 adapters and their fused AdamW); Lp is the common peer setup (`mode_lora_peer`:
  `peft.get_peft_model` on the bf16 model, autocast, torch `varlen_attn`, Liger's fused CE, compiled layers).
- **Q**: QLoRA, L with `train.quantize: nf4` (the frozen base's linear layers in bitsandbytes NF4 with double
  quantisation, bf16 compute, the 4-bit matmuls outside the compiled graphs; `sftflow.tasks.train.quantize`).
- **Dsel** / **Dac**: D with `activation_checkpointing` `selective` (every second layer) / `full` (every layer), what
  longer rows cost in time for the memory they save.
- **D<N>** / **D<N>b<budget>** (e.g. `D4`, `D8b0.99`): D with N decoder layers checkpointed (spread as the worker
  spreads a count) and, after `b`, that `activation_memory_budget` instead of `--memory-budget`: the points that
  calibrate the activation estimate. Every D mode reports the estimate's peak (`estimated_peak_gib`, for the
  longest row it ran) next to the measured one.

Under torchrun (N ranks) only the FSDP baselines run (B, C, Cac, Clac): one plan of N rows a step, each rank its
own row, each rank's loss the mean over its rows' trained tokens with FSDP averaging the gradients (how their users
train); tokens/s counts every rank's tokens, MFU is over N GPUs, rank 0 reports. sftflow's side of such a comparison
is `benchmarks/workload.py NAME --set train.nproc=N`.

Timing: `torch.cuda.synchronize()` before and after each step, host clock; warm-up steps excluded; tokens are real
(non-pad) tokens. tokens/s is the median over the timed steps of tokens/step-time. MFU = (6 * N * tokens +
6 * layers * q_width * sum(doc_len^2)) / time / (measured bf16 matmul rate), N = decoder-layer parameters + LM head
(the head matmul runs even when it is tied to the embedding); 4 * N for the LoRA modes (frozen weights get no weight
gradient). tokens/s aggregate: total tokens over total timed wall time. Peak memory: `max_memory_allocated` over the
mode.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import gzip
import json
import math
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

LLAMA1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
)
PRESETS = {
    "llama1b": LLAMA1B,
    # Llama-3.1-8B's shape (untied head; the llama3 RoPE scaling left out: it changes no cost)
    "llama8b": dict(
        LLAMA1B,
        hidden_size=4096,
        num_hidden_layers=32,
        head_dim=128,
        intermediate_size=14336,
        tie_word_embeddings=False,
    ),
    # The 1B shape as Mistral (sliding-window attention on every layer): with `--sliding-window 0` the same model
    # with full attention, for what a window saves in training.
    "mistral1b": dict(LLAMA1B, model_type="mistral", sliding_window=4096),
    # Qwen2.5-1.5B's shape: another ratio of MLP to hidden width (5.8 against the Llamas' 4 and 3.5), biased q/k/v,
    # 2 KV heads, for the activation estimate's calibration.
    "qwen1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
    ),
    # Phi-3-mini's shape (multi-head K/V: its layer keeps 1.22x a Llama layer's fraction of the structural count on
    # CPU), for the activation estimate's per-family fractions on a GPU.
    "phi3mini": dict(
        model_type="phi3",
        hidden_size=3072,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        vocab_size=32064,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
    ),
}
PAD_ID = 0
CRASH_SHIM = Path(__file__).resolve().parents[1] / "tests" / "crash_shim"
MODES = ("A", "B", "C", "Cl", "Cn", "Cnac", "Cac", "Clac", "D", "De", "Df", "Dsel", "Dac", "L", "Lp", "Q")
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

    fields = dict(PRESETS[preset])
    model_type = fields.pop("model_type", "llama")
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


def matmul_tflops(device: torch.device, n: int = 8192) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
# baselines B and C: torch varlen_attn as a transformers attention function, Liger's fused linear cross-entropy
# ---------------------------------------------------------------------------------------------------------------------


def register_fa4_baseline_attention() -> str:
    """Register FlashAttention-4 as a peer's attention, the way its users call it: `flash_attn.cute`'s
    `flash_attn_varlen_func` in a transformers attention function, GQA native, outside the compiled graph (its
    autograd function does not trace)."""
    from flash_attn.cute import flash_attn_varlen_func
    from transformers import AttentionInterface

    @torch.compiler.disable
    def attend(q, k, v, cu, max_len, scaling):
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
            softmax_scale=scaling, causal=True,
        )[0]  # fmt: skip

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
        if torch.is_autocast_enabled("cuda"):  # as for torch varlen_attn below: RoPE promoted q and k to fp32
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (x.to(dtype) for x in (q, k, v))
        return attend(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scaling).unsqueeze(0), None

    AttentionInterface.register(BASELINE_ATTENTION, attention)
    return "FlashAttention-4 flash_attn_varlen_func (GQA native, outside the graph)"


def register_baseline_attention(device: torch.device, kind: str = "torch") -> str:
    """Register `bench_torch_varlen` (torch `varlen_attn`, causal within each document; `kind="fa4"`:
    FlashAttention-4). Returns what it runs.

    The signature is inspected here, once, so the function itself stays free of Python introspection (compile)."""
    from transformers import AttentionInterface

    if kind == "fa4":
        return register_fa4_baseline_attention()

    if device.type != "cuda":  # CPU plumbing runs only: the block-diagonal SDPA reference
        from sftflow.kernels.attention import varlen_attention

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            out = varlen_attention(
                query.squeeze(0).transpose(0, 1),
                key.squeeze(0).transpose(0, 1),
                value.squeeze(0).transpose(0, 1),
                kwargs["cu_seq_lens_q"],
                kwargs["max_length_q"],
                scaling,
                backend="sdpa",
            )
            return out.unsqueeze(0), None

        AttentionInterface.register(BASELINE_ATTENTION, attention)
        return "sdpa block-diagonal reference (CPU)"

    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        # squeeze, as sftflow's attention function does (a select's backward copies each gradient into zeros)
        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))
        if torch.is_autocast_enabled("cuda"):
            # RoPE's fp32 cos/sin promote q and k under autocast; a custom op is not autocast, so cast as HF's own
            # flash-attention path does
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (x.to(dtype) for x in (q, k, v))
        extra = dict(causal)
        if gqa:
            extra["enable_gqa"] = True
        elif q.shape[1] != k.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **extra)
        return out.unsqueeze(0), None

    AttentionInterface.register(BASELINE_ATTENTION, attention)
    return f"torch varlen_attn ({'enable_gqa' if gqa else 'repeated KV'}, {next(iter(causal))})"


def peer_step(
    model, optimizer, scheduler, b: dict, device, grad_clip: float, autocast: bool, params=None
) -> tuple[int, float]:
    """One optimizer step of a baseline on one packed row (`LigerRoot` returns the loss sum), as a training loop of
    its users runs it; `autocast`: bf16 autocast around the forward (fp32 weights); `params`: those clipped (default
    all of the model's)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss_sum = model(
            input_ids=b["input_ids"].to(device, non_blocking=True),
            position_ids=b["position_ids"].to(device, non_blocking=True),
            labels=b["labels"].to(device, non_blocking=True),
            cu_seqlens=b["cu_seqlens"].to(device, non_blocking=True),
            max_seqlen=int(b["max_seqlen"]),
        )
    (loss_sum / max(b["num_loss_tokens"], 1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters() if params is None else params, grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return batch_tokens(b)


@contextlib.contextmanager
def liger_llama_kernels(enabled: bool):
    """Liger's Llama kernels (RoPE, RMSNorm, SwiGLU; the fused linear CE is `LigerRoot`'s) for the models built inside.
    Liger patches the modeling module's classes and functions; they are restored afterwards so that the other modes
    of this process build the stock modules."""
    if not enabled:
        yield
        return
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    patched = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {attr: getattr(modeling_llama, attr) for attr in patched}
    try:
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
        )
        yield
    finally:
        for attr, value in saved.items():
            setattr(modeling_llama, attr, value)


class LigerRoot(nn.Module):
    """FSDP root for B/C: the base model to the final hidden states, then Liger's fused linear CE (sum)."""

    def __init__(self, lm: nn.Module, device: torch.device):
        super().__init__()
        self.lm = lm
        if device.type == "cuda":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            self.loss_name = "liger fused linear CE"
        else:  # CPU plumbing runs only

            def logits_ce(weight, hidden, labels):
                return nn.functional.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")

            self.loss = logits_ce
            self.loss_name = "F.cross_entropy on logits (CPU)"

    def forward(self, input_ids, position_ids, labels, cu_seqlens, max_seqlen):
        out = self.lm.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=max_seqlen,
            max_length_k=max_seqlen,
        )
        hidden = out.last_hidden_state
        weight = self.lm.get_output_embeddings().weight
        return self.loss(weight, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1))


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


# ---------------------------------------------------------------------------------------------------------------------
# the modes
# ---------------------------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, env, lm_config, dataset, plan, tflops):
        self.args, self.env, self.device = args, env, env.device
        self.lm_config, self.dataset, self.plan, self.tflops = lm_config, dataset, plan, tflops
        from sftflow.tasks.train.fsdp import compute_dtype

        self.param_dtype = compute_dtype(env, "auto")
        from sftflow.tasks.train import config as cfg

        self.on_oom = None
        self.peer_attention = "torch"  # a peer mode's attention: torch varlen_attn, or "fa4" (a mode named X@fa4)
        self.label = ""  # the mode as named on the command line (D@triton), for its files
        self.train_config = cfg.TrainConfig(data="unused", plan="unused", model="unused", out="unused")
        self.optim_c = cfg.optim_config(self.train_config)

    def build_lm(self, attn: str, packed_worker: bool) -> nn.Module:
        """Same seed and config for every mode; built directly on the device, as the worker draws random weights."""
        torch.manual_seed(self.args.seed)
        with torch.device(self.device):
            if packed_worker:
                from sftflow.tasks.train.model import build_model

                path = Path(self.args.tmp) / "model-config.json"
                self.lm_config.to_json_file(str(path))
                vocab_size = self.dataset.config.vocab_size
                return build_model(str(path), vocab_size=vocab_size, packed=True, device=torch.device(self.device))
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(self.lm_config, attn_implementation=attn).to(torch.float32)

    def optimizer(self, model):
        from sftflow.tasks.train.worker import build_optimizer

        optimizer = build_optimizer(model, self.optim_c)
        return optimizer, self.scheduler(optimizer)

    def scheduler(self, optimizer):
        from sftflow.tasks.train import config as cfg
        from sftflow.tasks.train.worker import lr_factor

        schedule = cfg.schedule_config(self.train_config, self.args.warmup + self.args.steps + 64)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, schedule))

    def timed(self, name: str, step_fn, warmup: int, steps: int, extra: dict) -> dict:
        """Run `warmup + steps` steps (`step_fn(i) -> (tokens, sum_sq_doc_lengths)`), synchronised timing."""
        times, tokens, sum_sq, oom = [], [], [], 0
        t_start = time.perf_counter()
        for i in range(warmup + steps):
            sync(self.device)
            t0 = time.perf_counter()
            try:
                n, sq = step_fn(i)
                sync(self.device)
            except torch.cuda.OutOfMemoryError:
                oom += 1
                print(f"[{name}] step {i}: CUDA out of memory; step skipped", flush=True)
                if self.on_oom is not None:
                    self.on_oom()
                free_everything_but_peak(self.device)
                continue
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
                tokens.append(n)
                sum_sq.append(sq)
            if i == warmup - 1:
                print(f"[{name}] warm-up done after {time.perf_counter() - t_start:.1f} s", flush=True)
        return self.summarise(name, times, tokens, sum_sq, oom, extra)

    def summarise(self, name, times, tokens, sum_sq, oom, extra) -> dict:
        per_step = [n / t for n, t in zip(tokens, times, strict=True)]
        flops = [
            self.matmul_factor * self.n_matmul * n + 6 * self.n_layers * self.width * sq
            for n, sq in zip(tokens, sum_sq, strict=True)
        ]
        gpus = self.env.world_size  # a multi-GPU baseline's tokens are every rank's
        mfu = [f / t / (gpus * self.tflops * 1e12) for f, t in zip(flops, times, strict=True)] if self.tflops else []
        result = {
            "mode": name,
            "timed_steps": len(times),
            "oom_steps": oom,
            "tokens_per_s": statistics.median(per_step) if per_step else None,
            "tokens_per_s_aggregate": sum(tokens) / sum(times) if times else None,
            "step_s_median": statistics.median(times) if times else None,
            "tokens_per_step_mean": statistics.mean(tokens) if tokens else None,
            "mfu": statistics.median(mfu) if mfu else None,
            "tflops_per_s": statistics.median([f / t / 1e12 for f, t in zip(flops, times, strict=True)])
            if times
            else None,
            "peak_gib": peak_gib(self.device),
            "reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else None,
            **extra,
        }
        print(f"[{name}] {json.dumps(result)}", flush=True)
        return result

    def set_shape(self, lm, lora: bool = False):
        from sftflow.tasks.train.model import attention_width

        # a frozen weight's matmuls run forward and for the input gradient only (4 of the 6 FLOPs per parameter)
        self.matmul_factor = 4 if lora else 6
        self.n_matmul = matmul_params(lm)
        self.n_layers = lm.config.num_hidden_layers
        self.width = attention_width(lm.config)

    # -- A ------------------------------------------------------------------------------------------------------------
    def mode_a(self) -> dict:
        """What the HF Trainer / TRL run on one GPU with bf16=True: the plain model with fp32 weights under bf16
        autocast (no FSDP), the same AdamW. A batch that runs out of memory is skipped and counted."""
        args = self.args
        batches = padded_batches(self.plan, self.dataset, args.warmup + args.steps, args.padded_batch)
        model = self.build_lm("sdpa", packed_worker=False)
        self.set_shape(model)
        optimizer, scheduler = self.optimizer(model)
        device = self.device
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

        def step(i):
            b = batches[i]
            with autocast:
                out = model(
                    input_ids=b["input_ids"].to(device, non_blocking=True),
                    attention_mask=b["attention_mask"].to(device, non_blocking=True),
                    labels=b["hf_labels"].to(device, non_blocking=True),
                    use_cache=False,
                )
            out.loss.backward()
            del out
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.optim_c.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return batch_tokens(b)

        self.on_oom = lambda: optimizer.zero_grad(set_to_none=True)
        padded = sum(b["input_ids"].numel() for b in batches[args.warmup :])
        real = sum(batch_tokens(b)[0] for b in batches[args.warmup :])
        extra = {
            "what": "HF sdpa + padding mask, 8 docs/batch padded to longest, HF loss on logits, bf16 autocast, no FSDP",
            "pad_efficiency": real / padded,
        }
        try:
            return self.timed("A", step, args.warmup, args.steps, extra)
        finally:
            self.on_oom = None

    # -- B / C --------------------------------------------------------------------------------------------------------
    def mode_bc(self, compiled: bool, checkpointing: bool = False, liger_all: bool = False) -> dict:
        args = self.args
        name = ("Cac" if checkpointing else "C") if compiled else "B"
        name = "Clac" if liger_all else name
        warmup = args.compile_warmup if compiled else args.warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps, rank=self.env.rank)
        totals = step_totals(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(self.device, self.peer_attention)
        with liger_llama_kernels(liger_all):
            lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False)
        self.set_shape(lm)
        if compiled:
            torch._dynamo.reset()
            compile_layers(lm)
        if checkpointing:  # what transformers users turn on: every decoder layer, non-reentrant
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        root = LigerRoot(lm, self.device)
        model = shard_like_worker(root, lm, self.env, self.param_dtype)
        optimizer, scheduler = self.optimizer(model)
        device = self.device

        def step(i):
            # each rank's loss is its own rows' mean, and FSDP averages the gradients: how its users train
            peer_step(model, optimizer, scheduler, rows[i], device, self.optim_c.grad_clip, autocast=False)
            return totals[i]

        extra = {
            "what": f"{attention}, "
            + ("Liger RoPE/RMSNorm/SwiGLU + " if liger_all else "")
            + root.loss_name
            + (", compiled layers (dynamic)" if compiled else "")
            + (", gradient checkpointing (every layer)" if checkpointing else "")
        }
        result = self.timed(name, step, warmup, args.steps, extra)
        if compiled:
            result["dynamo"] = dynamo_stats()
        return result

    # -- Cl: the one-GPU peer with Liger's full kernel set ---------------------------------------------------------
    def mode_one_gpu_peer(self, liger_all: bool, compiled: bool, checkpointing: bool = False) -> dict:
        name = ("Cl" if liger_all else "Cn") + ("ac" if checkpointing else "")
        if self.device.type != "cuda":
            raise ValueError(f"mode {name} needs CUDA (Liger's kernels)")
        args = self.args
        warmup = args.compile_warmup if compiled else args.warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(self.device, self.peer_attention)
        with liger_llama_kernels(liger_all):
            lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False)
        self.set_shape(lm)
        if compiled:
            torch._dynamo.reset()
            compile_layers(lm)
        if checkpointing:  # what transformers users turn on: every decoder layer, non-reentrant
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = LigerRoot(lm, self.device)
        c = self.optim_c
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=True
        )
        scheduler = self.scheduler(optimizer)
        device = self.device

        def step(i):
            return peer_step(model, optimizer, scheduler, rows[i], device, c.grad_clip, autocast=True)

        kernels = "Liger RoPE/RMSNorm/SwiGLU + " if liger_all else ""
        extra = {
            "what": f"no FSDP, fp32 weights + bf16 autocast, {kernels}{model.loss_name}, {attention}, "
            + ("compiled layers (dynamic), " if compiled else "eager, ")
            + ("gradient checkpointing (every layer), " if checkpointing else "")
            + "torch fused AdamW"
        }
        result = self.timed(name, step, warmup, args.steps, extra)
        if compiled:
            result["dynamo"] = dynamo_stats()
        return result

    # -- Lp: LoRA as its users run it -----------------------------------------------------------------------------
    def mode_lora_peer(self) -> dict:
        """LoRA the common way on one GPU: the Hugging Face model in bf16, `peft.get_peft_model` (rank 16 on all linear
        layers, adapters in fp32), bf16 autocast, the packed rows with torch `varlen_attn`, Liger's fused linear CE,
        compiled decoder layers, no FSDP, torch's fused AdamW over the adapters."""
        from peft import LoraConfig, get_peft_model

        args, device = self.args, self.device
        warmup = args.compile_warmup
        rows = packed_rows(self.plan, self.dataset, warmup + args.steps)
        attention = register_baseline_attention(device, self.peer_attention)
        lm = self.build_lm(BASELINE_ATTENTION, packed_worker=False).to(torch.bfloat16)
        self.set_shape(lm, lora=True)
        peft_config = LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        get_peft_model(lm, peft_config)  # injects the adapters into `lm` in place and freezes the rest
        torch._dynamo.reset()
        compile_layers(lm)
        root = LigerRoot(lm, device)
        trained = [p for p in root.parameters() if p.requires_grad]
        c = self.optim_c
        optimizer = torch.optim.AdamW(
            trained, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=device.type == "cuda"
        )
        scheduler = self.scheduler(optimizer)
        autocast = device.type == "cuda"

        def step(i):
            return peer_step(root, optimizer, scheduler, rows[i], device, c.grad_clip, autocast, params=trained)

        extra = {
            "what": f"peft LoRA r{LORA_RANK} all-linear on a bf16 model, bf16 autocast, {attention}, {root.loss_name}, "
            "compiled layers (dynamic), no FSDP",
            "trained_params": sum(p.numel() for p in trained),
        }
        result = self.timed("Lp", step, warmup, args.steps, extra)
        result["dynamo"] = dynamo_stats()
        return result

    # -- D / De -------------------------------------------------------------------------------------------------------
    def mode_d(
        self,
        name: str,
        profile_dir: Path | None,
        compile_mode: str = "auto",
        parallel: str = "auto",
        checkpointing: str | int = "off",
        lora: bool = False,
        quantize: bool = False,
        budget_override: float | None = None,
    ) -> dict:
        """The worker's step: `build_model`, the worker's `compile` and `parallel` settings (`parallelize`), and
        `sftflow.tasks.train.worker.train_step` on `RankBatches`, then the scheduler and `MetricsLogger` as the
        worker's loop runs them. `De` is the same with `compile="off"` (eager), `Df` with `parallel="fsdp"`."""
        from transformers.models.llama import modeling_llama

        from sftflow.tasks.train import config as cfg
        from sftflow.tasks.train.activations import (
            apply_activation_checkpointing,
            apply_memory_budget,
            peak_bytes,
            resolve_memory_budget,
        )
        from sftflow.tasks.train.capacity import model_state_bytes
        from sftflow.tasks.train.compile import compile_layers, resolve_compile
        from sftflow.tasks.train.config import parallel_path
        from sftflow.tasks.train.data import RankBatches
        from sftflow.tasks.train.metrics import MetricsLogger
        from sftflow.tasks.train.model import attention_width, count_params, decoder_layers
        from sftflow.tasks.train.worker import Prefetch, parallelize, stage_inputs, train_step

        args, env, plan = self.args, self.env, self.plan
        compiled = resolve_compile(compile_mode, env.device)
        warmup = args.compile_warmup if compiled else args.warmup
        lm = self.build_lm("", packed_worker=True)
        self.set_shape(lm, lora=lora)
        if lora:
            from sftflow.tasks.train.config import LoraSettings
            from sftflow.tasks.train.lora import apply_lora

            apply_lora(lm, LoraSettings(rank=LORA_RANK, targets="all-linear"), "benchmark")
        original_rope = modeling_llama.apply_rotary_pos_emb  # restored below, so C never runs with our RoPE fix
        # The compiled layers' `activation_memory_budget` as the worker resolves it, against the memory free before
        # the model was built (it is on the device already); the loop resets torch's 1 before every mode.
        parallel = parallel_path(parallel, env.world_size, env.device.type)
        state = model_state_bytes(lm, "nf4" if quantize else "none", parallel, env.world_size, accumulating=False)
        held = sum(t.nbytes for t in lm.parameters()) if env.device.type == "cuda" else 0
        free = torch.cuda.mem_get_info(env.device)[0] + held if env.device.type == "cuda" else None
        requested = args.memory_budget if args.memory_budget == "auto" else float(args.memory_budget)
        budget = resolve_memory_budget(requested, compiled, env.device, lm.config, args.row_tokens, state, free=free)
        if budget_override is not None:
            budget = budget_override
        apply_memory_budget(budget)
        if compiled:
            torch._dynamo.reset()
            compile_layers(decoder_layers(lm), device=env.device, dtype=self.param_dtype)
        apply_activation_checkpointing(decoder_layers(lm), checkpointing)  # after compiling, as the worker does
        batches = RankBatches(plan, self.dataset, rank=env.rank, world_size=env.world_size, pad_id=PAD_ID)
        model, optimizer, _ = parallelize(
            lm, env, parallel, self.param_dtype, self.optim_c, lora=lora, quantize=quantize
        )
        scheduler = self.scheduler(optimizer)
        _, n_dense = count_params(lm)
        metrics_path = Path(args.tmp) / f"metrics-{name}.jsonl"
        metrics = MetricsLogger(
            cfg.MetricsConfig(path=metrics_path, ema_alpha=0.9, log_every=10**9, peak_flops=None),
            is_main=True,
            total_steps=plan.num_steps,
            steps_per_epoch=plan.steps_per_epoch,
            num_devices=1,
            flops_per_token=6 * n_dense,
            attn_flops_per_sq_token=6 * lm.config.num_hidden_layers * attention_width(lm.config),
            resume_step=0,
        )
        timings: dict[str, list[float]] = {}

        def mark(key: str, t0: float, breakdown: bool) -> float:
            if not breakdown:
                return t0
            sync(env.device)
            now = time.perf_counter()
            timings.setdefault(key, []).append(now - t0)
            return now

        stage = partial(stage_inputs, device=env.device, vocab_size=getattr(model, "vocab_size", None))
        prefetch = Prefetch(batches, plan, plan.num_steps, stage=stage)

        row_tokens: list[int] = []  # every step's, warm-up included: the peak is over the whole mode

        def step(s, breakdown=False):
            # -- the worker's loop body (skip/NaN branches elided: never taken here) --
            t0 = time.perf_counter()
            step_loss_tokens = int(plan.step_loss_tokens[s])
            micro_batches = prefetch.take(s)  # collated during the previous step, as in the worker
            tb = mark("collate", t0, breakdown)
            result = train_step(
                model,
                optimizer,
                micro_batches,
                step_loss_tokens,
                self.optim_c.grad_clip,
                env.device,
                host_work=partial(prefetch.collate, s + 1),
            )
            tb = mark("train_step", tb, breakdown)
            row_tokens.append(result.tokens)  # one row a step here
            if result.targets != step_loss_tokens:
                raise AssertionError(f"step {s}: plan {step_loss_tokens} trained tokens, batches {result.targets}")
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            metrics.log(
                step=s + 1,
                epoch=0,
                loss=result.loss_sum / step_loss_tokens,
                grad_norm=result.grad_norm,
                lr=lr,
                trained_tokens=step_loss_tokens,
                tokens=result.tokens,
                sum_sq_doc_lengths=result.sum_sq_doc_lengths,
                seconds=time.perf_counter() - t0,
            )
            mark("scheduler_metrics", tb, breakdown)
            return result.tokens, result.sum_sq_doc_lengths

        from sftflow.kernels.attention import select_backend as attention_backend
        from sftflow.kernels.cross_entropy import select_backend as ce_backend

        dtype = self.param_dtype
        c = self.lm_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        extra = {
            "what": f"sftflow worker step: attention {attention_backend(env.device, dtype, head_dim).name}, "
            f"CE {ce_backend(env.device, dtype).name}, compile={compile_mode}, parallel={parallel}, "
            f"activation checkpointing {checkpointing}, activation memory budget {budget}"
            + (f", LoRA r{LORA_RANK} all-linear" if lora else "")
            + (", NF4 base (QLoRA)" if quantize else "")
            + (" (compiled layers, T-major RoPE)" if compiled else " (eager)"),
        }
        try:
            result = self.timed(name, step, warmup, args.steps, extra)
            if row_tokens:
                longest = max(row_tokens)
                estimate = peak_bytes(lm.config, checkpointing, longest, state, budget=budget)
                result.update(row_tokens_max=longest, estimated_peak_gib=estimate / 2**30, memory_budget=budget)
                print(f"[{name}] estimated peak {estimate / 2**30:.2f} GiB for a {longest}-token row", flush=True)
            if compiled:
                result["dynamo"] = dynamo_stats()
            losses = [json.loads(line)["loss"] for line in metrics_path.read_text().splitlines()]
            result["loss_first_last"] = [losses[0], losses[-1]]
            first_extra = warmup + args.steps
            if name == "D" and args.breakdown_steps and first_extra + args.breakdown_steps <= plan.num_steps:
                for s in range(first_extra, first_extra + args.breakdown_steps):
                    step(s, breakdown=True)
                result["breakdown_ms_median"] = {k: 1e3 * statistics.median(v) for k, v in timings.items()}
                first_extra += args.breakdown_steps
            wanted = profile_dir is not None and name in ("D", "Df") and args.profile_steps
            if wanted and first_extra + args.profile_steps <= plan.num_steps:
                profiled = range(first_extra, first_extra + args.profile_steps)
                result["profile"] = profile_steps(
                    step, profiled, env.device, profile_dir / f"profile_{self.label.replace('@', '-')}.txt", args.trace
                )
            return result
        finally:
            modeling_llama.apply_rotary_pos_emb = original_rope


def device_gaps(events, top: int = 12) -> tuple[float, float, list[dict]]:
    """From the profiler's events: device busy time (the union of kernel and memcpy intervals, user annotations
    left out), device idle time between the first and last kernel, and the longest idle gaps with the kernels on
    either side (where the host kept the device waiting)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    if not spans:
        return 0.0, 0.0, []
    busy = idle = 0.0
    gaps = []
    start, end, name = spans[0]
    for s, e, n in spans[1:]:
        if s > end:
            busy += end - start
            idle += s - end
            gaps.append({"ms": (s - end) / 1e3, "after": name[:80], "before": n[:80]})
            start = s
        if e > end:
            end, name = e, n
    busy += end - start
    gaps.sort(key=lambda g: -g["ms"])
    return busy / 1e3, idle / 1e3, gaps[:top]


def profile_steps(step_fn, steps, device: torch.device, path: Path, trace: bool = False) -> dict:
    """torch.profiler over a few steps: the top kernels by device time, device busy and idle time, the longest idle
    gaps, and device time per kernel group."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        for s in steps:
            step_fn(s)
        sync(device)
    wall = time.perf_counter() - t0
    if trace:  # host and device timelines (chrome://tracing, perfetto), for where the device waits on the host
        trace_path = path.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace_path))
        with open(trace_path, "rb") as src, gzip.open(f"{trace_path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace_path.unlink()
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = averages.table(sort_by=sort_key, row_limit=60, max_name_column_width=90)
    kernels = []
    for event in averages:  # device-side events only (kernels, memcpys): operator rows repeat their kernels' time
        t = getattr(event, "self_device_time_total", 0) or 0
        if t > 0 and event.device_type != torch.autograd.DeviceType.CPU and not event.is_user_annotation:
            kernels.append((event.key, t / 1e3))
    groups: dict[str, float] = {}
    for key, t in kernels:
        k = key.lower()
        if "flash_attn" in k:  # FlashAttention-4's CuTe kernels, whose names also hold "cutlass" and "sm90"
            group = "attention"
        elif "nccl" in k or "memcpy" in k or "memset" in k or "copy" in k:
            group = "copies/nccl"
        elif "gemm" in k or "nvjet" in k or "cutlass" in k or "sm90" in k or "xmma" in k or "cublas" in k:
            group = "matmul (cuBLAS)"
        elif any(w in k for w in ("attn", "attention", "flash", "fwd_kernel", "bwd_dq", "bwd_dkdv", "bwd_delta")):
            group = "attention"
        elif "ce_" in k or "cross" in k or "softmax" in k:
            group = "cross-entropy / softmax"
        elif "triton_" in k and "fused" in k:
            group = "inductor fused (compiled layers)"
        elif "adam" in k or "foreach" in k or "multi_tensor" in k:
            group = "optimizer / foreach"
        elif "triton" in k:
            group = "other triton"
        else:
            group = "other kernels"
        groups[group] = groups.get(group, 0.0) + t
    n = len(steps)
    busy_ms, idle_ms, gaps = device_gaps(prof.events()) if device.type == "cuda" else (0.0, 0.0, [])
    summary = {
        "steps": n,
        "wall_ms_per_step": 1e3 * wall / n,
        "device_busy_ms_per_step": busy_ms / n,
        "device_idle_ms_per_step": idle_ms / n,
        "groups_ms_per_step": {k: round(v / n, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "longest_idle_gaps": gaps,
    }
    path.write_text(json.dumps(summary, indent=2) + "\n\n" + table + "\n")
    print(f"[profile] {json.dumps(summary)}", flush=True)
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# the worker GPU check: the real worker under torchrun, crash after a checkpoint, resume
# ---------------------------------------------------------------------------------------------------------------------


def gpu_check(
    work: Path,
    steps=30,
    crash_after=20,
    timeout_s=150.0,
    device="cuda",
    out: Path | None = None,
    nproc: int = 1,
    model: str = "small",
) -> dict:
    """Train a small real-shaped Llama (8 layers, hidden 1024, vocab 32k; bf16 on CUDA) with `sftflow`'s worker
    under torchrun: a checkpoint every 10 steps, a SIGKILL after step `crash_after` (the test suite's crash hook,
    `tests/crash_shim`), then a `--resume` run to `steps`. `device="cpu"` shrinks everything (a plumbing check of
    this function only). `model="llama1b"`: the throughput benchmark's 1B model instead, one uninterrupted run (for
    1 vs 2 GPU scaling)."""
    from transformers import LlamaConfig

    from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
    from sftflow.tasks.train.config import TrainConfig, write_run_json
    from sftflow.tasks.train.mock import MockConfig, MockDataset, write_mock_index

    work.mkdir(parents=True, exist_ok=True)
    small = device == "cpu"
    big = model == "llama1b"
    vocab, row = (512, 256) if small else (PRESETS["llama1b"]["vocab_size"] if big else 32000, 16384)
    mock = MockConfig(
        num_docs=(320 if small else 900) * nproc,  # the same steps for any nproc: weak scaling
        vocab_size=vocab,
        median_length=24 if small else 600,
        sigma=1.0,
        min_length=4 if small else 16,
        max_length=96 if small else 4096,
        loss_spans=True,
    )
    dataset = MockDataset(mock)
    arrays, _ = plan(
        dataset.lengths,
        dataset.loss_token_counts,
        PlanConfig(num_ranks=nproc, tokens_per_rank=row, micro_batches_per_step=1),
    )
    (work / "plan").mkdir(exist_ok=True)
    save_plan(arrays, work / "plan" / "plan.npz")
    model_json = work / "model.json"
    if big:
        llama_config("llama1b").to_json_file(str(model_json))
    else:
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64 if small else 1024,
            num_hidden_layers=2 if small else 8,
            num_attention_heads=4 if small else 16,
            num_key_value_heads=2 if small else 8,
            head_dim=16 if small else 64,
            intermediate_size=128 if small else 4096,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        ).to_json_file(str(model_json))
    run_dir = work / "run"
    config = TrainConfig(
        data=str(write_mock_index(mock, work / "data")),
        plan=str(work / "plan"),
        model=str(model_json),
        out=str(run_dir),
        max_steps=steps,
        checkpoint_every=0 if big else 10,
        export=not big,
        keep_last=2,
        warmup_steps=3,
        lr=3e-4,
        device=device,
        num_threads=1 if small else None,
    )
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    logs = []

    def attempt(cfg, fault: str | None) -> tuple[int, float, str]:
        # The launcher's input manifests need sftflow.tasks.train.launch, which imports prefect (absent on the GPU
        # machine); the worker does not read them.
        from sftflow.tasks.train.resolved import resolve_run

        resolved = resolve_run(cfg).to_json()
        write_run_json(cfg, {"note": "benchmarks/train_throughput.py gpu check"}, run_dir / "run.json", resolved)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["-m", "sftflow.tasks.train.worker", str(run_dir)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("SFTFLOW_TEST_CRASH", None)
        if fault:  # the test suite's crash hook (tests/crash_shim), loaded by the workers at start-up
            env["SFTFLOW_TEST_CRASH"] = fault
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CRASH_SHIM), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        out = proc.stdout + proc.stderr
        logs.append(out)
        return proc.returncode, time.perf_counter() - t0, out

    if big:  # one run, no crash: only the throughput matters here
        code1, wall1 = None, 0.0
        code2, wall2, out2 = attempt(config, None)
    else:
        code1, wall1, out1 = attempt(config, f"crash_after_step={crash_after}")
        code2, wall2, out2 = attempt(config.model_copy(update={"resume": True}), None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_logged = [r["step"] for r in records]
    peak = [line for line in out2.splitlines() if "peak memory" in line]
    resumed = [line for line in out2.splitlines() if "resumed" in line]
    warm = 6 if big else 3  # compiled layers (the default on CUDA) take a few steps to settle
    timed = [r for r in records if r["step"] > warm and r["step"] not in (crash_after + 1,)]
    hf = run_dir / "hf"
    result = {
        "nproc": nproc,
        "first_attempt_exit": code1,
        "first_attempt_wall_s": round(wall1, 1),
        "resume_exit": code2,
        "resume_wall_s": round(wall2, 1),
        "resume_line": resumed[0] if resumed else None,
        "steps_logged": steps_logged,
        "steps_ok": steps_logged == list(range(1, steps + 1)),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]] if records else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
        "mfu_median_worker_estimate": statistics.median(r["mfu"] for r in timed) if timed and timed[0]["mfu"] else None,
        "peak_memory_line": peak[0] if peak else None,
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
        "hf_export": sorted(p.name for p in hf.iterdir()) if hf.is_dir() else None,
    }
    if code2 == 0 and hf.is_dir():
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(str(hf))
        result["hf_reload_params"] = sum(p.numel() for p in reloaded.parameters())
    for folder in (work, out):
        if folder is not None:
            (folder / f"gpu_check{nproc}_log.txt").write_text("\n\n===== resume =====\n\n".join(logs))
            (folder / f"gpu_check{nproc}_metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    print(f"[gpu-check] {json.dumps(result)}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------------


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "liger_kernel"):
        try:
            from importlib.metadata import version

            out[name] = version(name.replace("_", "-"))
        except Exception:
            out[name] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def markdown(report: dict) -> str:
    results = {r["mode"]: r for r in report["results"] if r.get("tokens_per_s")}
    a, b = results.get("A"), results.get("B")
    lines = [
        "| mode | what | tokens/s (median) | aggregate tokens/s | MFU | peak GiB | × A | × B | timed steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if not r.get("tokens_per_s"):
            lines.append(f"| {r['mode']} | failed: {r.get('error', '?')[:120]} | | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        xa = f"{tps / a['tokens_per_s']:.2f}" if a else "-"
        xb = f"{tps / b['tokens_per_s']:.2f}" if b else "-"
        lines.append(
            f"| {r['mode']} | {r['what']} | {tps:,.0f} | {r['tokens_per_s_aggregate']:,.0f} | {mfu} | {peak} | "
            f"{xa} | {xb} | {r['timed_steps']}" + (f" ({r['oom_steps']} OOM)" if r.get("oom_steps") else "") + " |"
        )
    return "\n".join(lines) + "\n"


# A mode's @suffix: the sftflow attention backend it forces (sdpa: the CPU reference)
ATTENTIONS = {"fa4": "flash_attn_4", "triton": "triton", "torch": "torch", "sdpa": "sdpa"}


def known_mode(mode: str) -> bool:
    base, at, attention = mode.partition("@")
    return (base in MODES or COUNTED_MODE.fullmatch(base) is not None) and (not at or attention in ATTENTIONS)


def sftflow_mode(base: str) -> bool:
    return base.startswith("D") or base in ("L", "Q")


@contextlib.contextmanager
def mode_attention(bench: Bench, base: str, attention: str):
    """A mode named `X@fa4` / `X@triton` / `X@torch` / `X@sdpa` runs with that attention: sftflow's modes (D..., L,
    Q) through `SFTFLOW_ATTENTION` (the dispatch's override), the peers through their registered attention function
    (`fa4`: FlashAttention-4's own varlen function, as its users call it; `torch`: torch varlen_attn)."""
    if not attention:
        yield
        return
    if not sftflow_mode(base):
        if attention not in ("fa4", "torch"):
            raise ValueError(f"mode {base}@{attention}: a peer runs @fa4 or @torch")
        bench.peer_attention = attention
        try:
            yield
        finally:
            bench.peer_attention = "torch"
        return
    with mock.patch.dict(os.environ, {"SFTFLOW_ATTENTION": ATTENTIONS[attention]}):
        yield


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--modes",
        default="D,B,A,C,De",
        help=f"comma-separated, in order: some of {','.join(MODES)}, or D<N>[b<budget>] (N layers checkpointed); "
        "a suffix @fa4, @triton or @torch sets the mode's attention (D@triton: sftflow with its Triton kernels, "
        "Cn@fa4: the peer with FlashAttention-4)",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama1b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sliding-window", type=int, default=None, help="window of a windowed preset (0: full attention)")
    p.add_argument("--row-tokens", type=int, default=16384)
    p.add_argument("--padded-batch", type=int, default=8)
    p.add_argument("--median-length", type=int, default=600)
    p.add_argument("--sigma", type=float, default=1.0, help="of the lognormal document lengths")
    p.add_argument("--min-length", type=int, default=16)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--compile-warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--memory-budget",
        default="auto",
        help="the D modes' train.activation_memory_budget: auto (resolved as the worker does: 1 where the row fits "
        "without checkpointing, else 0.99) or a number in (0, 1]",
    )
    p.add_argument("--breakdown-steps", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", action="store_true", help="also write the profiled steps' chrome trace (.trace.json.gz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining modes after this many seconds")
    p.add_argument("--out", default=None, help="folder for train_throughput.json/.md and profiles")
    p.add_argument("--gpu-check", default=None, metavar="DIR", help="run the worker check in DIR first")
    p.add_argument("--gpu-check-only", action="store_true")
    p.add_argument("--gpu-check-nproc", default="1", help="comma-separated process counts for the worker check")
    p.add_argument("--gpu-check-model", choices=("small", "llama1b"), default="small")
    p.add_argument("--gpu-check-steps", type=int, default=30)
    p.add_argument("--gpu-check-timeout", type=float, default=150.0, help="seconds per torchrun attempt")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "args": vars(args),
        "results": [],
    }
    if args.gpu_check:
        checks = {}
        for nproc in (int(n) for n in args.gpu_check_nproc.split(",")):
            try:
                work = Path(args.gpu_check) / f"nproc{nproc}"
                checks[nproc] = gpu_check(
                    work,
                    device=args.device,
                    out=out,
                    nproc=nproc,
                    model=args.gpu_check_model,
                    steps=args.gpu_check_steps,
                    timeout_s=args.gpu_check_timeout,
                )
            except Exception as err:
                traceback.print_exc()
                checks[nproc] = {"error": repr(err)}
        report["gpu_check"] = checks
        one, two = checks.get(1, {}).get("tokens_per_s_median"), checks.get(2, {}).get("tokens_per_s_median")
        if one and two:
            report["gpu_check_scaling_efficiency_2gpu"] = two / (2 * one)
            print(f"[gpu-check] 2-GPU scaling efficiency {two / (2 * one):.3f}", flush=True)
        if out is not None:
            (out / "train_throughput.json").write_text(json.dumps(report, indent=2))
        if args.gpu_check_only:
            return report

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = {m for m in modes if not known_mode(m)}
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {sorted(unknown)}; expected some of {list(MODES)}")
    env = init_single_process(args.device)
    if env.world_size > 1:
        # Under torchrun: the FSDP baselines on every rank, each its own rows of one plan; rank 0 reports.
        if {m.partition("@")[0] for m in modes} - MULTI_GPU_MODES:
            raise ValueError(
                f"--modes: on {env.world_size} ranks only {sorted(MULTI_GPU_MODES)} run (sftflow's own multi-GPU "
                "step is benchmarks/workload.py with --set train.nproc=N)"
            )
        if env.rank != 0:
            out = None
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the process's life
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    lm_config = llama_config(args.preset, args.sliding_window)
    rows_needed = max(args.warmup, args.compile_warmup) + args.steps + args.breakdown_steps + args.profile_steps
    dataset, plan_arrays, stats = make_data(args, lm_config.vocab_size, rows_needed, env.world_size)
    report["data"] = {
        "docs": len(dataset),
        "mean_length": float(dataset.lengths.mean()),
        "trained_fraction": float(dataset.loss_token_counts.sum() / dataset.lengths.sum()),
        "plan_efficiency": stats.efficiency,
        "plan_steps": plan_arrays.num_steps,
    }
    report["matmul_tflops"] = matmul_tflops(env.device)
    print(f"[setup] {json.dumps({k: report[k] for k in ('versions', 'data', 'matmul_tflops')})}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        bench = Bench(args, env, lm_config, dataset, plan_arrays, report["matmul_tflops"])
        runners = {
            "A": bench.mode_a,
            "B": partial(bench.mode_bc, compiled=False),
            "C": partial(bench.mode_bc, compiled=True),
            "Cl": partial(bench.mode_one_gpu_peer, liger_all=True, compiled=False),
            "Cn": partial(bench.mode_one_gpu_peer, liger_all=False, compiled=True),
            "Cnac": partial(bench.mode_one_gpu_peer, liger_all=False, compiled=True, checkpointing=True),
            "Cac": partial(bench.mode_bc, compiled=True, checkpointing=True),
            "Clac": partial(bench.mode_bc, compiled=True, checkpointing=True, liger_all=True),
            "D": partial(bench.mode_d, "D", out),
            "De": partial(bench.mode_d, "De", out, compile_mode="off"),
            "Df": partial(bench.mode_d, "Df", out, parallel="fsdp"),
            "Dsel": partial(bench.mode_d, "Dsel", out, checkpointing="selective"),
            "Dac": partial(bench.mode_d, "Dac", out, checkpointing="full"),
            "L": partial(bench.mode_d, "L", out, lora=True),
            "Lp": bench.mode_lora_peer,
            "Q": partial(bench.mode_d, "Q", out, parallel="single", lora=True, quantize=True),
        }
        from sftflow.tasks.train.activations import apply_memory_budget

        for mode in modes:
            base, _, attention = mode.partition("@")
            if counted := COUNTED_MODE.fullmatch(base):
                count, override = int(counted[1]), counted[2]
                runners[base] = partial(
                    bench.mode_d, base, None, checkpointing=count, budget_override=override and float(override)
                )
            if time.perf_counter() - t_start > args.budget_s:
                report["results"].append({"mode": mode, "error": "skipped: time budget spent"})
                continue
            free_everything(env.device)
            apply_memory_budget(1.0)  # torch's default: a peer never inherits the budget a D mode set
            left_over = torch.cuda.memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else None
            t_mode = time.perf_counter()
            bench.label = mode
            try:
                with mode_attention(bench, base, attention):
                    result = runners[base]()
                result["mode"] = mode
            except Exception as err:
                traceback.print_exc()
                result = {"mode": mode, "error": f"{type(err).__name__}: {err}"}
            result["mode_wall_s"] = round(time.perf_counter() - t_mode, 1)
            result["allocated_before_mode_gib"] = left_over  # earlier modes' leftovers (dynamo caches), in the peak
            report["results"].append(result)
            with contextlib.suppress(Exception):
                torch._dynamo.reset()
            if out is not None:
                (out / "train_throughput.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    print(table, flush=True)
    if out is not None:
        (out / "train_throughput.md").write_text(table)
        (out / "train_throughput.json").write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
    # Reports are written and the process group is gone: leave without the interpreter's teardown, where torch 2.13's
    # CPU build has been seen to abort a finished rank ("terminate called without an active exception"), as the
    # worker does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
