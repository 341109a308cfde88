"""Per-step metrics: `metrics.jsonl` (rank 0, one JSON object per optimizer step) and a rank-0 progress line
(`progress_log`).

Step time and throughput are smoothed with exponential moving averages started at zero and bias-corrected, as Adam
does for its moments: after n updates `ema_n = alpha * ema_{n-1} + (1 - alpha) * x_n`, reported as
`ema_n / (1 - alpha**n)`, so the first steps are not dragged towards zero. The ETA is the smoothed step time times the
steps left; the time per epoch is the smoothed step time times the steps per epoch.

MFU estimate: model FLOPs per step `6 * N * tokens + 6 * layers * width * sum(doc_len**2)` (dense matmuls forward and
backward, plus causal attention within each document), over the step time times the peak FLOP/s of all devices.
`N` excludes the input embedding. The peak comes from config or a table of known GPUs; on CPU MFU is not reported.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.train.config import MetricsConfig
from sftflow.tasks.train.progress_log import progress_line

# Dense bf16 peak FLOP/s per device, no sparsity.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


def default_peak_flops(device: torch.device, configured_tflops: float | None) -> float | None:
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)


class BiasCorrectedEMA:
    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value = 0.0
        self.count = 0

    def update(self, x: float) -> float:
        self.value = self.alpha * self.value + (1 - self.alpha) * x
        self.count += 1
        return self.get()

    def get(self) -> float:
        if self.count == 0:
            return math.nan
        return self.value / (1 - self.alpha**self.count)


class MetricsLogger:
    """Rank 0 appends one line per step; other ranks only keep the averages in step."""

    def __init__(
        self,
        config: MetricsConfig,
        *,
        is_main: bool,
        total_steps: int,
        steps_per_epoch: int,
        num_devices: int,
        flops_per_token: float,
        attn_flops_per_sq_token: float,
        resume_step: int,
    ):
        self.config = config
        self.is_main = is_main
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.num_devices = num_devices
        self.flops_per_token = flops_per_token
        self.attn_flops_per_sq_token = attn_flops_per_sq_token
        self.step_time = BiasCorrectedEMA(config.ema_alpha)
        self.throughput = BiasCorrectedEMA(config.ema_alpha)
        if is_main:
            self._truncate_after(resume_step)

    def _truncate_after(self, step: int) -> None:
        """Drop lines a crashed attempt wrote after the checkpoint we resume from, so steps appear once; a line cut
        short by the crash (or a full disk) ends the file there."""
        path = self.config.path
        if not path.is_file():
            return
        kept = [line for line, record in _lines(path) if record["step"] <= step]
        write_atomic(path, "".join(line + "\n" for line in kept))

    def log(
        self,
        *,
        step: int,
        epoch: int,
        loss: float | None,
        grad_norm: float | None,
        lr: float,
        trained_tokens: int,
        tokens: int,
        sum_sq_doc_lengths: float,
        seconds: float,
        skipped: str | None = None,
        peak_memory_gib: float | None = None,
        peak_reserved_gib: float | None = None,
        trained_tokens_by_source: dict[str, int] | None = None,
        breakdown: dict[str, dict[str, dict]] | None = None,
    ) -> dict:
        ema_step_time = self.step_time.update(seconds)
        tokens_per_s = tokens / seconds if seconds > 0 else math.nan
        ema_tokens_per_s = self.throughput.update(tokens_per_s)
        flops = self.flops_per_token * tokens + self.attn_flops_per_sq_token * sum_sq_doc_lengths
        peak = self.config.peak_flops
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "trained_tokens": trained_tokens,
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "ema_tokens_per_s": ema_tokens_per_s,
            "step_time_s": seconds,
            "ema_step_time_s": ema_step_time,
            "mfu": flops / (seconds * peak * self.num_devices) if peak and seconds > 0 else None,
            "epoch_time_s": ema_step_time * self.steps_per_epoch,
            "eta_s": ema_step_time * (self.total_steps - step),
            "skipped": skipped,
            "peak_memory_gib": peak_memory_gib,
            "peak_reserved_gib": peak_reserved_gib,
        }
        if trained_tokens_by_source is not None:
            record["trained_tokens_by_source"] = trained_tokens_by_source
        if breakdown is not None:  # {"source"|"tag": {name: {loss, token_accuracy, trained_tokens}}}
            record["breakdown"] = breakdown
        if self.is_main:
            with self.config.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if step % self.config.log_every == 0 or step == self.total_steps or skipped:
                print(progress_line(record, self.total_steps), file=sys.stdout, flush=True)
        return record


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [record for _, record in _lines(path)]


def _lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) pairs up to the first line that is not a whole JSON record: one being written right now, or
    one cut short by a crash or a full disk."""
    pairs = []
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                pairs.append((line, json.loads(line)))
            except json.JSONDecodeError:
                break
    return pairs
