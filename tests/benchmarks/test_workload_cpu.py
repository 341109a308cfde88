"""`benchmarks/workload.py` end to end on the CPU (`benchmarks/workloads/tiny-cpu.yaml`): real `sftflow plan` and
`sftflow train` processes, then a baseline of `train_throughput.py`; the summary's figures are the run's own.
Plumbing only; no timing checks."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from tests.benchmarks.rows import read_result_rows

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "workload.py"


def test_workload_summarizes_the_run_it_trained_and_its_baseline(tmp_path):
    out, rows = tmp_path / "out", tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(SCRIPT), "tiny-cpu", "--steps", "6", "--warmup", "2", "--baseline", "A"]
    cmd += ["--work", str(tmp_path / "work"), "--out", str(out), "--jsonl", str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "tiny-cpu.json").read_text())
    metrics = [json.loads(line) for line in (out / "tiny-cpu-metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    timed = metrics[2:]
    assert summary["steps"] == 6 and summary["timed_steps"] == 4
    assert summary["tokens_per_s_median"] == round(statistics.median(m["tokens_per_s"] for m in timed))
    aggregate = sum(m["tokens"] for m in timed) / sum(m["step_time_s"] for m in timed)
    assert summary["tokens_per_s_aggregate"] == round(aggregate)
    # the end-to-end rate counts every step's tokens over the command's wall time, start-up included
    # (the summary's wall time is rounded to 0.1 s, its rate is of the unrounded one)
    total, wall = sum(m["tokens"] for m in metrics), summary["train_command_wall_s"]
    assert math.floor(total / (wall + 0.05)) <= summary["tokens_per_s_end_to_end"] <= math.ceil(total / (wall - 0.05))
    assert summary["tokens_per_s_end_to_end"] < summary["tokens_per_s_aggregate"]
    # read back from the run's run.json: the tiny model's 2 layers, none recomputed on a CPU that holds them all
    assert summary["activation_checkpointing_auto"] == "0 of 2 layers"
    assert summary["activation_checkpointing_setting"] == "auto"
    assert summary["loss_first_last"] == [metrics[0]["loss"], metrics[-1]["loss"]]
    baseline = summary["baseline"]
    assert baseline["mode"] == "A" and baseline["timed_steps"] == 4 and baseline["tokens_per_s_median"] > 0
    assert summary["ratio_median"] == round(summary["tokens_per_s_median"] / baseline["tokens_per_s_median"], 3)
    assert "[train]" in (out / "tiny-cpu-train.log").read_text()
    # --jsonl: sftflow's rows carry the peer and the ratio; the peer's own rows follow
    found = read_result_rows(rows, "benchmarks/workload.py")
    ours = {r["metric"]: r for r in found if r["mode"].startswith("sftflow train")}
    assert ours["tokens/s median"]["value"] == summary["tokens_per_s_median"]
    assert ours["tokens/s median"]["ratio"] == summary["ratio_median"]
    assert ours["tokens/s median"]["mode"] == "sftflow train, activation checkpointing auto: 0 of 2 layers"
    peer = {r["metric"]: r["value"] for r in found if r["mode"].startswith("A: ")}
    assert peer["tokens/s aggregate"] == baseline["tokens_per_s_aggregate"]


def test_a_failed_baseline_leaves_sftflow_s_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(SCRIPT), "tiny-cpu", "--steps", "3", "--warmup", "1", "--baseline", "NoSuchMode"]
    cmd += ["--work", str(tmp_path / "work"), "--jsonl", str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "baseline NoSuchMode failed" in proc.stdout + proc.stderr
    found = read_result_rows(rows, "benchmarks/workload.py")
    assert {r["metric"] for r in found} >= {"tokens/s median", "tokens/s aggregate", "tokens/s end to end"}
    assert all(r["mode"].startswith("sftflow train") and r["peer"] is None for r in found)
