"""The CPU benchmarks at their smallest sizes, each with `--jsonl`: they run, print their tables and write result
rows that `benchmarks/results_table.py` accepts. Plumbing only; no timing checks."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks.rows import BENCHMARKS, read_result_rows


def bench(script: str, *args: str, timeout: float = 120) -> str:
    cmd = [sys.executable, str(BENCHMARKS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_planner(tmp_path):
    out = bench("planner.py", "--num-docs", "2000", "--skip-real", "--no-record", "--jsonl", str(tmp_path / "r.jsonl"))
    assert "| ours | " in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/planner.py")
    assert len(rows) == 3 * 8  # efficiency, cost imbalance and time of each method
    ours = [r for r in rows if r["mode"] == "ours" and r["peer"] is not None]
    assert len(ours) == 1 and ours[0]["ratio"] == ours[0]["value"] / ours[0]["peer_value"]
    assert all(r["gpu"] is None and r["versions"]["numpy"] for r in rows)
