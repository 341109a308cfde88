"""sftflow's modes: D and its variants (De, Df, Dsel, Dac, D<N>[b<budget>], L, Q): the worker's own step,
imported, not copied."""

from __future__ import annotations

import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from harness import sync

from throughput.bench import BenchCore
from throughput.common import LORA_RANK, PAD_ID, dynamo_stats
from throughput.profiling import profile_steps


class SftflowModes(BenchCore):
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
        from sftflow.tasks.train.compile import compile_layers, resolve_compile
        from sftflow.tasks.train.config import parallel_path
        from sftflow.tasks.train.data import RankBatches
        from sftflow.tasks.train.metrics import MetricsLogger
        from sftflow.tasks.train.model import attention_width, count_params, decoder_layers
        from sftflow.tasks.train.resolved import model_state_bytes
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
