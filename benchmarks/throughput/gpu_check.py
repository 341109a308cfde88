"""The worker GPU check: the real worker under torchrun, crash after a checkpoint, resume (`--gpu-check`)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sftflow.tasks.shapes import SHAPES
from throughput.common import PRESETS, llama_config

# the test suite's crash hook, which the check's first attempt loads to crash after a checkpoint
CRASH_SHIM = Path(__file__).resolve().parents[2] / "tests" / "crash_shim"


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
    vocab, row = (512, 256) if small else (PRESETS["llama1b"].vocab if big else SHAPES["llama-1024x8"].vocab, 16384)
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
        LlamaConfig(**SHAPES["llama-64x2" if small else "llama-1024x8"].fields()).to_json_file(str(model_json))
    run_dir = work / "run"
    config = TrainConfig(
        data=str(write_mock_index(mock, work / "data")),
        plan=str(work / "plan"),
        model=str(model_json),
        out=str(run_dir),
        max_steps=steps,
        export=not big,
        device=device,
        num_threads=1 if small else None,
        checkpoint=dict(every=0 if big else 10, keep_last=2),
        schedule=dict(warmup_steps=3),
        optimizer=dict(lr=3e-4),
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
        code2, wall2, out2 = attempt(
            config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"resume": True})}), None
        )
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
