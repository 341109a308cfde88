"""End-to-end training throughput on one GPU: sftflow's training step against what users run today.

    python benchmarks/train_throughput.py [--modes A,B,C,D,De] [--out DIR]        # the 1B training benchmark (H200)
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
  one host sync for the step's statistics), then the scheduler and `MetricsLogger`. (The worker itself queues step
  s + 1 before it reads step s's statistics; timed here step by step, that overlap does not show: the end-to-end
  figures of `benchmarks/workload.py` hold it.)
- **De**: D with `compile="off"` (eager), to show what compilation buys.
- **Df**: D with `parallel="fsdp"` (FSDP2 at world size 1 and torch's fused AdamW, D before the one-device path).
- **L** / **Lp**: LoRA, rank 16 on every linear layer of the decoder: L is D with `train.lora` (the worker's
  `apply_lora`, frozen bf16 base, fp32 adapters and their fused AdamW); Lp is the common peer setup (`mode_lora_peer`:
  `peft.get_peft_model` on the bf16 model, autocast, torch `varlen_attn`, Liger's fused CE, compiled layers);
  **Lpac** is Lp with gradient checkpointing on every layer, what its users turn on when Lp does not fit.
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

`--jsonl FILE` appends each mode's figures to FILE as result rows (`benchmarks/harness.py`: one JSON line a figure,
with the date, GPU, versions and commit). The code is in `benchmarks/throughput/`, by mode family: the peers
(`peer_modes.py`), sftflow's modes (`sftflow_modes.py`), the timed loop they share (`bench.py`), the presets, data
and batches (`common.py`), the profiler (`profiling.py`), the report (`report.py`) and the
command line (`run.py`); this file is the entry point. The real worker under torchrun (crash, resume, export, 1 and
2 GPUs) is the GPU test `tests/gpu/test_train_crash_resume.py`.
"""

from __future__ import annotations

import os
import sys

from throughput.common import PAD_ID, PRESETS, init_single_process, llama_config  # noqa: F401 - cost_table.py's
from throughput.run import main, parse_args  # noqa: F401

if __name__ == "__main__":
    main()
    # Reports are written and the process group is gone: leave without the interpreter's teardown, where torch 2.13's
    # CPU build has been seen to abort a finished rank ("terminate called without an active exception"), as the
    # worker does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
