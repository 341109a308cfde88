"""What every benchmark's `--jsonl` rows must be: JSON lines with the fields of `benchmarks/results/*.jsonl`, each a
record that `benchmarks/results_table.py` accepts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FIELDS = {
    "date", "gpu", "machine", "versions", "commit", "benchmark", "command", "workload", "mode", "metric", "value",
    "unit", "peer", "peer_value", "ratio", "ratio_basis", "run", "source", "note",
}  # fmt: skip


def _results_table():
    if "results_table" not in sys.modules:
        spec = importlib.util.spec_from_file_location("results_table", BENCHMARKS / "results_table.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["results_table"] = module
        spec.loader.exec_module(module)
    return sys.modules["results_table"]


def read_result_rows(path: Path, benchmark: str) -> list[dict]:
    """The rows in `path`, after checking each has exactly the results fields, passes `results_table`'s checks and
    names `benchmark` (`benchmarks/planner.py`) as what measured it."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    assert rows, f"no rows in {path}"
    problems = _results_table().record_problems
    for row in rows:
        assert set(row) == FIELDS, set(row) ^ FIELDS
        assert problems(row) == [], (problems(row), row)
        assert row["benchmark"] == benchmark and row["command"].startswith(benchmark), row
    return rows
