"""What every mode of the throughput benchmark shares: the model built from one seed, the worker's optimizer and
schedule, the timed loop and its summary (tokens/s, MFU, peak memory)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from harness import sync
from torch import nn

from throughput.common import free_everything_but_peak, matmul_params, peak_gib


class BenchCore:
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
