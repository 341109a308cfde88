"""GPU smoke run of the training stage through its real launcher: train, crash, resume, export.

    python benchmarks/train_smoke_gpu.py [--nproc 1] [--steps 30] [--work /tmp/sftflow-train-smoke]

A Llama-shaped random-init model (8 layers, hidden 1024, 16 heads / 8 KV heads, vocab 32k), bf16 compute with fp32
master weights, mock documents (lognormal lengths, median 600), packed rows of 16,384 tokens per rank. The first
launch is killed after step 20 (`SFTFLOW_TEST_CRASH` with the test suite's `tests/crash_shim` on PYTHONPATH: one
worker SIGKILLs itself; the checkpoint of step 20 is written);
the second launch resumes from `latest` and finishes. Prints tokens/s (median of the steps after warm-up), the
worker's MFU estimate and peak memory, and checks that every step is logged once and the export reloads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--crash-after", type=int, default=20)
    parser.add_argument("--work", type=Path, default=Path("/tmp/sftflow-train-smoke"))
    parser.add_argument("--device", default="cuda", help="cpu: a much smaller model, to check the plumbing only")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: I001

    from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
    from sftflow.tasks.train.config import TrainConfig
    from sftflow.tasks.train.launch import TrainingFailed, train
    from sftflow.tasks.train.metrics import read_metrics
    from sftflow.tasks.train.mock import MockConfig, MockDataset, write_mock_index

    work = args.work / f"nproc{args.nproc}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cpu = args.device == "cpu"
    vocab, hidden, layers, row = (1000, 128, 2, 1024) if cpu else (32000, 1024, 8, 16384)
    mock = MockConfig(
        num_docs=(200 if cpu else 2000) * args.nproc,
        vocab_size=vocab,
        median_length=60 if cpu else 600,
        sigma=1.0,
        min_length=16,
        max_length=row // 4,
        loss_spans=True,
    )
    dataset = MockDataset(mock)
    arrays, stats = plan(
        dataset.lengths,
        dataset.loss_token_counts,
        PlanConfig(num_ranks=args.nproc, tokens_per_rank=row, micro_batches_per_step=1),
    )
    (work / "plan").mkdir()
    save_plan(arrays, work / "plan" / "plan.npz")
    LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=hidden // 16,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ).to_json_file(str(work / "model.json"))
    config = TrainConfig(
        data=str(write_mock_index(mock, work / "data")),
        plan=str(work / "plan"),
        model=str(work / "model.json"),
        out=str(work / "run"),
        nproc=args.nproc,
        max_steps=args.steps,
        checkpoint=dict(every=10, keep_last=2),
        schedule=dict(warmup_steps=3),
        optimizer=dict(lr=3e-4),
        device=args.device,
        timeout_s=600,
    )
    print(f"[smoke] plan: {arrays.num_steps} steps, packing efficiency {stats.efficiency:.3f}", flush=True)

    saved = dict(os.environ)
    os.environ["SFTFLOW_TEST_CRASH"] = f"crash_after_step={args.crash_after}"
    shim = str(Path(__file__).resolve().parents[1] / "tests" / "crash_shim")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        train(config)
        crashed = False
    except TrainingFailed:
        crashed = True
    os.environ.clear()
    os.environ.update(saved)
    t1 = time.perf_counter()
    result = train(config, resume=True)
    t2 = time.perf_counter()

    records = read_metrics(work / "run" / "metrics.jsonl")
    timed = [r for r in records if r["step"] > 3 and r["step"] != args.crash_after + 1]
    reloaded = AutoModelForCausalLM.from_pretrained(result.hf_dir)
    summary = {
        "device": torch.cuda.get_device_name(0) if not cpu else "cpu",
        "nproc": args.nproc,
        "torch": torch.__version__,
        "first_attempt_crashed": crashed,
        "first_attempt_s": round(t1 - t0, 1),
        "resume_s": round(t2 - t1, 1),
        "steps_logged_once": [r["step"] for r in records] == list(range(1, args.steps + 1)),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in timed)),
        "mfu_median": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
        "peak_memory_gib": max(r["peak_memory_gib"] or 0 for r in records),
        "checkpoints": sorted(p.name for p in (work / "run" / "checkpoints").iterdir()),
        "hf_reload_params_M": round(sum(p.numel() for p in reloaded.parameters()) / 1e6, 1),
    }
    print("[smoke] " + json.dumps(summary), flush=True)
    ok = crashed and summary["steps_logged_once"] and result.steps == args.steps
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
