"""The CPU benchmarks at their smallest sizes, each with `--jsonl`: they run, print their tables and write result
rows that `benchmarks/results_table.py` accepts. Plumbing only; no timing checks."""

from __future__ import annotations

import subprocess
import sys

from sftflow.tasks.shapes import SHAPES
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


def test_cost_table(tmp_path):
    """The planner's cost table on the CPU: one point per length, in the file `plan.cost_table` reads, saying which
    attention and loss kernels the steps ran (a table measured with one attention kernel misweighs another's); on
    the CPU those are torch's SDPA and the plain-PyTorch loss."""
    import json

    out = bench(
        "cost_table.py", "--preset", "tiny", "--device", "cpu", "--lengths", "16,64", "--row-tokens", "64",
        "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "table"), "--jsonl", str(tmp_path / "r.jsonl"),
    )  # fmt: skip
    table = json.loads((tmp_path / "table" / "cost_table.json").read_text())
    assert [length for length, _ in table["points"]] == [16, 64] and all(t > 0 for _, t in table["points"])
    assert (table["attention"], table["loss"]) == ("sdpa", "reference")
    assert "attention sdpa" in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/cost_table.py")
    assert [r["mode"] for r in rows] == ["length16, attention sdpa", "length64, attention sdpa"]


def tiny_config(tmp_path) -> str:
    """A Hugging Face config file of the registry's smallest Llama shape: each mode builds it in a second."""
    path = tmp_path / "model.json"
    SHAPES["llama-64x2"].config().to_json_file(str(path))
    return str(path)


def test_export_memory(tmp_path):
    out = bench("export_memory.py", "--config", tiny_config(tmp_path), "--jsonl", str(tmp_path / "r.jsonl"))
    assert "| streamed | " in out and "| whole | " in out and "streamed / whole:" in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/export_memory.py")
    assert {(r["mode"], r["metric"]) for r in rows} == {
        (mode, metric) for mode in ("streamed", "whole") for metric in ("extra host memory", "export time")
    }
    assert [r["peer"] for r in rows if r["mode"] == "streamed" and r["metric"] == "export time"] == ["whole"]


def test_checkpoint_memory(tmp_path):
    args = ["--config", tiny_config(tmp_path), "--layers", "1", "--modes", "deferred", "joined"]
    out = bench("checkpoint_memory.py", *args, "--jsonl", str(tmp_path / "r.jsonl"))
    assert "| deferred | " in out and "| joined | " in out and "deferred / joined:" in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/checkpoint_memory.py")
    assert len(rows) == 2 * 4 and {r["mode"] for r in rows} == {"deferred", "joined"}


def test_load_checkpoint(tmp_path):
    args = ["--shape", "small", "--ranks", "1", "--baseline-ranks", "--jsonl", str(tmp_path / "r.jsonl")]
    out = bench("load_checkpoint.py", *args)
    assert "| 1 | sftflow | " in out and "failed" not in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/load_checkpoint.py")
    assert [(r["mode"], r["metric"]) for r in rows] == [
        ("sftflow", "peak host memory, largest rank"),
        ("sftflow", "load time"),
    ]
    assert all(r["workload"].endswith("1 gloo rank(s)") and r["value"] > 0 for r in rows)


def test_data_prep(tmp_path):
    out = bench("data_prep.py", "--limit", "20", "--repeats", "1", "--jsonl", str(tmp_path / "r.jsonl"))
    assert "HF apply_chat_template" in out and "ratio (ours / baseline)" in out
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/data_prep.py")
    assert len(rows) == 3 * 2 and sum(r["peer"] is not None for r in rows) == 2  # both of ours against HF's
    assert all(r["versions"]["tokenizers"] for r in rows)


def test_attention_rows(tmp_path):
    """`benchmarks/attention.py` times on a GPU; its `--jsonl` rows, made here from a table of figures as it
    measures them (shape, variant, fwd ms, fwd TFLOP/s, fwd+bwd ms, fwd+bwd TFLOP/s, error)."""
    measured = [
        (16, 4, 128, "torch", 1.0, 300.0, 1.8, 400.0, 0.0),
        (16, 4, 128, "flash_attn_4", 0.5, 600.0, 1.0, 690.0, 1e-3),
    ]
    code = (
        f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); sys.argv = ['benchmarks/attention.py', '--jsonl']; "
        "import attention, harness; "
        f"rows = {measured!r}; base = {{(16, 4, 128): rows[0]}}; "
        f"harness.write_rows({str(tmp_path / 'r.jsonl')!r}, attention.figure_rows(rows, base, 690.0, 'T=16384 packed'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_result_rows(tmp_path / "r.jsonl", "benchmarks/attention.py")
    fa4 = [r for r in rows if r["mode"] == "flash_attn_4" and r["unit"] == "ms"]
    assert len(rows) == 4 and fa4[0]["ratio"] == 1.8 and fa4[0]["peer_value"] == 1.8
    assert [r["value"] for r in rows if r["unit"] == "%"] == [58.0, 100.0]
