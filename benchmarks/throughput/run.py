"""End-to-end training throughput on one GPU: the modes by name, the command line and the run over the modes
(`benchmarks/train_throughput.py` is the entry point and documents it)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from harness import add_common_args, matmul_tflops, versions, write_rows

from throughput.common import (
    COUNTED_MODE,
    MODES,
    MULTI_GPU_MODES,
    PRESETS,
    free_everything,
    init_single_process,
    llama_config,
    make_data,
)
from throughput.peer_modes import PeerModes
from throughput.report import markdown, result_rows
from throughput.sftflow_modes import SftflowModes


class Bench(SftflowModes, PeerModes):
    """Every mode, on one model config, data set and plan."""


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
        help="the D modes' train.memory.activation_memory_budget: auto (resolved as the worker does: 1 where the row "
        "fits without checkpointing, else 0.99) or a number in (0, 1]",
    )
    p.add_argument("--breakdown-steps", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", action="store_true", help="also write the profiled steps' chrome trace (.trace.json.gz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining modes after this many seconds")
    p.add_argument("--out", default=None, help="folder for train_throughput.json/.md and profiles")
    add_common_args(p)  # --jsonl
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
            args.jsonl = None
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
            "Lpac": partial(bench.mode_lora_peer, checkpointing=True),
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
    write_rows(args.jsonl, result_rows(report))
    print(table, flush=True)
    if out is not None:
        (out / "train_throughput.md").write_text(table)
        (out / "train_throughput.json").write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return report
