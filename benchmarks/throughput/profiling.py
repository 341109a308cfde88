"""torch.profiler over a few of a mode's steps: kernels by group, device busy and idle time, the longest idle gaps."""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path

import torch
from harness import sync


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
    table = averages.table(sort_by=sort_key, row_limit=150, max_name_column_width=90)
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
        elif "triton_" in k and "fused" in k:  # before copies: inductor names its casts `..._to_copy_...`
            group = "inductor fused (compiled layers)"
        elif "nccl" in k or "memcpy" in k or "memset" in k or "copy" in k:
            group = "copies/nccl"
        elif "gemm" in k or "nvjet" in k or "cutlass" in k or "sm90" in k or "xmma" in k or "cublas" in k:
            group = "matmul (cuBLAS)"
        elif any(w in k for w in ("attn", "attention", "flash", "fwd_kernel", "bwd_dq", "bwd_dkdv", "bwd_delta")):
            group = "attention"
        elif "ce_" in k or "cross" in k or "softmax" in k:
            group = "cross-entropy / softmax"
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
