"""The benchmark harness (`benchmarks/harness.py`): its options, timer, environment and result rows."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import harness  # noqa: E402

from tests.benchmarks.rows import FIELDS, _results_table  # noqa: E402


def test_common_options_are_added_only_where_asked():
    p = harness.add_common_args(argparse.ArgumentParser(), steps=5, warmup=2, out="a folder")
    args = p.parse_args(["--steps", "7", "--jsonl", "rows.jsonl"])
    assert (args.steps, args.warmup, args.out, args.jsonl) == (7, 2, None, "rows.jsonl")
    bare = harness.add_common_args(argparse.ArgumentParser(), jsonl=False)
    assert vars(bare.parse_args([])) == {}


def test_the_cpu_timer_measures_the_host_clock():
    timer = harness.Timer("cpu").start()
    time.sleep(0.05)
    assert 0.04 < timer.stop() < 1.0
    times = harness.time_calls(lambda: time.sleep(0.01), repeats=3, warmup=1)
    assert len(times) == 3 and all(0.005 < t < 1.0 for t in times)


def test_rows_carry_the_environment_and_append_as_json_lines(tmp_path):
    env = harness.environment()
    assert env["versions"]["torch"] and env["versions"]["python"]
    assert env["commit"] is None or len(env["commit"].split("+")[0]) == 40
    row = harness.result_row("bench", "D", "tokens_per_s", 12.5, "tokens/s", env, workload="w", peer="p", ratio=2.0)
    assert set(row) == FIELDS and row["value"] == 12.5 and row["date"] == env["date"]
    assert row["machine"].endswith(" cores") and (row["workload"], row["peer"], row["ratio"]) == ("w", "p", 2.0)
    assert _results_table().record_problems(row) == []  # a record the results table takes
    path = tmp_path / "sub" / "rows.jsonl"
    harness.write_rows(path, [row])
    harness.write_rows(path, [dict(row, mode="A")])
    harness.write_rows(None, [row])  # nothing to write to
    assert [r["mode"] for r in harness.read_rows(path)] == ["D", "A"]
    assert json.loads(path.read_text().splitlines()[0]) == row


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("SFTFLOW_BENCH_COMMIT", raising=False)
    assert harness.git_commit(tmp_path) is None


def test_a_copied_tree_s_commit_is_the_one_named(tmp_path, monkeypatch):
    # a device machine's copy: its git metadata is not the code's, the caller names the commit
    monkeypatch.setenv("SFTFLOW_BENCH_COMMIT", "3bdcefb")
    assert harness.git_commit(tmp_path) == "3bdcefb"
    assert harness.environment()["commit"] == "3bdcefb"


@pytest.mark.parametrize("dirty", [False, True])
def test_a_changed_checkout_is_marked_dirty(tmp_path, dirty, monkeypatch):
    import subprocess

    monkeypatch.delenv("SFTFLOW_BENCH_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "f"], check=True)
    if dirty:
        (tmp_path / "f").write_text("2")
    commit = harness.git_commit(tmp_path)
    assert len(commit.split("+")[0]) == 40 and commit.endswith("+dirty") == dirty


def test_the_matmul_rate_is_a_gpu_s_only():
    assert harness.matmul_tflops("cpu") is None
