"""Smoke run of benchmarks/train_throughput.py on CPU: the sftflow mode (the worker's own step) runs 2 timed steps on
a tiny Llama and reports real tokens per second. Plumbing only; no timing checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.rows import read_result_rows

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"


def test_train_throughput_sftflow_mode_runs_on_cpu(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu", "--modes", "D,D1b0.9,De@sdpa"]
    cmd += ["--row-tokens", "256", "--median-length", "24", "--min-length", "4", "--max-length", "96"]
    cmd += ["--warmup", "1", "--steps", "2", "--breakdown-steps", "1", "--profile-steps", "0", "--out", str(out)]
    cmd += ["--jsonl", str(tmp_path / "rows.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "train_throughput.json").read_text())
    results = {r["mode"]: r for r in report["results"]}
    assert set(results) == {"D", "D1b0.9", "De@sdpa"}
    for mode in ("D", "D1b0.9", "De@sdpa"):
        assert "error" not in results[mode], results[mode]
        assert results[mode]["timed_steps"] == 2
        assert results[mode]["tokens_per_s"] > 0
    d = results["D"]
    assert all(math.isfinite(x) for x in d["loss_first_last"])
    phases = {"collate", "train_step", "scheduler_metrics"}
    assert set(d["breakdown_ms_median"]) == phases
    assert 0.3 < report["data"]["trained_fraction"] < 0.7
    assert "| D |" in (out / "train_throughput.md").read_text()
    assert "activation memory budget 1.0" in d["what"]  # the worker's auto: nothing checkpointed, eager on CPU
    # D<N>b<budget>: N of the 2 layers checkpointed at that budget, with the estimate for the longest row it ran
    counted = results["D1b0.9"]
    assert "activation checkpointing 1," in counted["what"] and counted["memory_budget"] == 0.9
    assert 0 < counted["row_tokens_max"] <= 256
    assert counted["estimated_peak_gib"] > 0 and d["estimated_peak_gib"] > 0
    # a mode's @suffix forces its attention backend, for that mode alone
    assert "attention sdpa" in results["De@sdpa"]["what"] and "compile=off" in results["De@sdpa"]["what"]
    # --jsonl: one row per figure, with the environment it was measured in
    rows = read_result_rows(tmp_path / "rows.jsonl", "benchmarks/train_throughput.py")
    assert {row["workload"] for row in rows} == {"tiny, 256-token rows"}
    speed = {row["mode"]: row["value"] for row in rows if row["metric"] == "tokens_per_s"}
    assert speed == {mode: results[mode]["tokens_per_s"] for mode in results}
    assert all(row["gpu"] is None and row["versions"]["torch"] for row in rows)


def test_a_baseline_runs_on_two_ranks_and_counts_both_ranks_tokens(tmp_path):
    """Under torchrun (2 gloo processes) the FSDP baseline B trains each rank's own row of a 2-rank plan; a step's
    tokens are both rows' (more than one row holds), and the report is rank 0's alone."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT)]
    cmd += ["--preset", "tiny", "--device", "cpu", "--modes", "B", "--row-tokens", "256", "--median-length", "24"]
    cmd += ["--min-length", "4", "--max-length", "96", "--warmup", "1", "--steps", "2", "--breakdown-steps", "0"]
    cmd += ["--profile-steps", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads((out / "train_throughput.json").read_text())["results"]
    assert "error" not in result, result
    assert result["mode"] == "B" and result["timed_steps"] == 2
    assert 256 < result["tokens_per_step_mean"] <= 2 * 256
    assert proc.stdout.count("[B] {") == 1  # rank 1 prints nothing
    wrong = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT)]
    wrong += ["--preset", "tiny", "--device", "cpu", "--modes", "D", "--steps", "1", "--row-tokens", "256"]
    proc = subprocess.run(wrong, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "benchmarks/workload.py" in proc.stderr
