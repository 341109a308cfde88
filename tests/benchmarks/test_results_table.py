"""benchmarks/results_table.py: every results record has its fields; RESULTS.md holds the table the data gives."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "results_table.py"


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_table"] = module
    spec.loader.exec_module(module)
    return module


def record(**changes):
    r = {
        "date": "2026-12-06",
        "gpu": "NVIDIA H100 80GB HBM3",
        "versions": {"torch": "2.11.0+cu130"},
        "commit": None,
        "benchmark": "benchmarks/attention.py",
        "workload": "packed row",
        "mode": "triton",
        "metric": "fwd+bwd time",
        "value": 1.0,
        "unit": "ms",
        "note": None,
    }
    r.update(changes)
    return {k: v for k, v in r.items() if v is not ...}


def test_every_shipped_record_has_the_required_fields(rt):
    records, problems = rt.load()
    assert problems == []
    assert len(records) > 100


def test_results_md_holds_the_table_the_data_gives(rt):
    records, _ = rt.load()
    text = rt.RESULTS_MD.read_text(encoding="utf-8")
    assert rt.current_block(text) == rt.block(records), "stale: run python benchmarks/results_table.py --write"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"metric": ...}, "missing field 'metric'"),
        ({"date": ...}, "missing field 'date'"),
        ({"value": "1.0"}, "field 'value' has a str"),
        ({"value": True}, "field 'value' has a bool"),
        ({"date": "6 Dec 2026"}, "is not YYYY-MM-DD"),
        ({"gpu": None}, "neither 'gpu' nor 'machine'"),
        ({"ratio": 1.3}, "a ratio without the peer"),
        ({"speed": 3}, "unknown field 'speed'"),
    ],
)
def test_a_record_lacking_a_field_is_reported(rt, changes, problem):
    assert rt.record_problems(record()) == []
    assert any(problem in p for p in rt.record_problems(record(**changes)))


def test_the_table_keeps_the_latest_measurement_of_each_key(rt):
    old = record(date="2026-12-01", value=2.0, source="a")
    old_other = record(date="2026-12-01", metric="fwd time", value=0.5, source="a")
    new = record(date="2026-12-05", value=1.5, source="b", peer="torch", peer_value=3.0, ratio=2.0)
    cpu = record(gpu=None, machine="CPU, 2 cores", value=9.0)
    rows = rt.latest([new, old, old_other, cpu])
    gpu_row = rows[("benchmarks/attention.py", "packed row", "triton", "NVIDIA H100 80GB HBM3")]
    assert gpu_row == [new]  # the older run's other metric is not mixed in
    assert rows[("benchmarks/attention.py", "packed row", "triton", "CPU, 2 cores")] == [cpu]
    table = rt.table([new, old, old_other, cpu])
    assert "fwd+bwd time 1.5 ms" in table and "2.0× torch (3.0 ms)" in table and "fwd+bwd time 2.0 ms" not in table


def test_check_fails_on_a_stale_table_and_write_fixes_it(rt, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.jsonl").write_text(json.dumps(record()) + "\n")
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# R\n\n{rt.BEGIN}\nold\n{rt.END}\n\n## History\nkept\n")
    args = ["--results-dir", str(results), "--results-md", str(md)]
    assert rt.main([*args, "--check"]) == 1
    assert rt.main([*args, "--write"]) == 0
    assert rt.main([*args, "--check"]) == 0
    assert md.read_text().endswith("## History\nkept\n") and "fwd+bwd time 1.0 ms" in md.read_text()
    (results / "a.jsonl").write_text(json.dumps(record(value=2.0)) + "\n")
    assert rt.main([*args, "--check"]) == 1
    (results / "b.jsonl").write_text(json.dumps(record(unit=...)) + "\n")
    assert rt.main([*args, "--check"]) == 1
