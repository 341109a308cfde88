"""The commands a GPU image without Prefect runs: `python -m sftflow.flows plan` on a bare dataset index and
`sftflow train` from a shipped workload config, driven by `benchmarks/workload.py` as the GPU numbers are made, with
`import prefect` failing in every process (`tests/no_prefect_shim`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.rows import read_result_rows

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "no_prefect_shim"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIM), env.get("PYTHONPATH")]))
    return env


def test_the_shim_hides_prefect():
    code = "import importlib.util, sys\ntry:\n import prefect\nexcept ModuleNotFoundError:\n sys.exit(3)\n"
    assert subprocess.run([sys.executable, "-c", code], env=_env()).returncode == 3


@pytest.mark.parametrize("name", ["llama8b-16k", "llama1b-64k", "llama8b-64k"])
def test_shipped_workload_configs_load(name):
    from sftflow.flows.config import load_config

    cfg = load_config(ROOT / "benchmarks" / "workloads" / f"{name}.yaml", {})
    shape = json.loads(Path(cfg.train.model).read_text())  # the model path resolves against the config's folder
    assert shape["model_type"] == "llama" and shape["vocab_size"] == 128256
    assert cfg.train.memory.activation_checkpointing in ("auto", "full") and not cfg.train.checkpoint.save


@pytest.mark.slow  # a plan, a 4-step training run and a baseline, each in a process of its own (~30 s)
def test_workload_runs_plan_and_train_without_prefect(tmp_path):
    """The 8B workload's config with a tiny model on the CPU: the plan comes from the bare mock index, training runs
    its steps on the one-device path (one of its two layers checkpointed, the optimizer stepping in the backward,
    one layer's moments in host memory: the variants the GPU runs), and with `checkpoint.save: false` no checkpoint
    is written, not even at the end; then a baseline of benchmarks/train_throughput.py on the same shape."""
    out = tmp_path / "out"
    args = [
        sys.executable, str(ROOT / "benchmarks" / "workload.py"), "llama8b-16k", "--steps", "4", "--warmup", "1",
        "--work", str(tmp_path / "work"), "--out", str(out), "--set", "train.model=tiny-llama",
        "--set", "plan.tokens_per_rank=4096", "--set", "train.device=cpu", "--baseline", "B",
        "--set", "train.memory.activation_checkpointing=1", "--set", "train.parallel=single",
        "--set", "train.optimizer.in_backward=true", "--set", "train.optimizer.grad_clip=null",
        "--set", "train.optimizer.offload=1", "--jsonl", str(tmp_path / "rows.jsonl"),
    ]  # fmt: skip
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "llama8b-16k.json").read_text())
    assert summary["steps"] == 4 and summary["timed_steps"] == 3
    assert "train.optimizer.offload=1" in summary["overrides"]
    log = (out / "llama8b-16k-train.log").read_text()
    assert "optimizer in the backward, AdamW moments in host memory (1 unit, " in log
    assert summary["tokens_per_s_aggregate"] > 0 and summary["train_command_wall_s"] > 0
    run = tmp_path / "work" / "llama8b-16k" / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert not any((run / "checkpoints").glob("step-*")) and not (run / "checkpoints" / "latest").exists()
    assert "No module named 'prefect'" not in proc.stderr
    # a number of layers to checkpoint, as `--set` passes it, reaches the worker
    assert "activation checkpointing 1 of 2 layers" in (out / "llama8b-16k-train.log").read_text()
    # the baseline ran in the same call on the same rows and timed steps, and the ratios are of the two
    baseline = summary["baseline"]
    assert baseline["mode"] == "B" and baseline["timed_steps"] == 3 and baseline["tokens_per_s_median"] > 0
    assert summary["ratio_median"] == round(summary["tokens_per_s_median"] / baseline["tokens_per_s_median"], 3)
    # sftflow's own numbers were reported before the baseline started (they survive a run cut short there)
    first, last = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("[workload]")
    ]
    assert "baseline" not in first and first["tokens_per_s_median"] == summary["tokens_per_s_median"]
    assert last == summary
    # --jsonl: the summary's figures as result rows, sftflow's against the baseline's
    rows = read_result_rows(tmp_path / "rows.jsonl", "benchmarks/workload.py")
    ours = {r["metric"]: r for r in rows if r["mode"].startswith("sftflow train")}
    assert ours["tokens/s median"]["value"] == summary["tokens_per_s_median"]
    assert ours["tokens/s median"]["peer_value"] == baseline["tokens_per_s_median"]
    assert {r["mode"] for r in rows} - {r["mode"] for r in ours.values()} == {f"B: {baseline['what']}"}
