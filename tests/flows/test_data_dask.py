"""`sft-data` on a real local Dask cluster (2 worker processes) and on threads, over a source split into shards.

The output must not depend on the runner, nor (beyond which shard holds a document) on the shard size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sftflow.flows.config import DataConfig, SFTConfig
from sftflow.flows.data import DataResult, api_for_workers, load_data_result, sft_data
from sftflow.tasks.data.index import load_index
from sftflow.tasks.data.pbin import open_pbin
from sftflow.tasks.demo import write_demo
from tests.flows.conftest import task_states

pytest.importorskip("prefect_dask")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict[str, Path]:
    """Demo conversations with blank lines and one line that is not JSON, so line numbers and rejects matter."""
    out = tmp_path_factory.mktemp("dask-data")
    demo = write_demo(out / "demo", n=300)
    lines = demo["data"].read_text().splitlines()
    for at in range(len(lines) - 1, 0, -37):
        lines.insert(at, "")
    lines.insert(100, "{not json")
    path = out / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return {"data": path, "tokenizer": demo["tokenizer"]}


def _states(state, expected_runs: int) -> dict[str, list[str]]:
    # The API records task-run states from events, a moment after the flow returns.
    for _ in range(100):
        states = task_states_or_none(state)
        if states is not None and sum(len(v) for v in states.values()) == expected_runs:
            return states
        time.sleep(0.1)
    return task_states(state)


def task_states_or_none(state) -> dict[str, list[str]] | None:
    try:
        return task_states(state)
    except AttributeError:  # a task run without a recorded state yet
        return None


def _run(dataset, work: Path, **data) -> tuple[DataResult, dict[str, list[str]]]:
    config = DataConfig(
        sources=[str(dataset["data"])],
        tokenizer=str(dataset["tokenizer"]),
        render={"template": "chatml", "on_bad_record": "reject"},
        index={"eval_fraction": 0.2},
        **data,
    )
    state = sft_data(config=SFTConfig(work_dir=str(work), data=config), return_state=True)
    assert state.is_completed(), state
    result = state.result()
    return result, _states(state, expected_runs=3 * len(result.pbin) + 1)


def _index_arrays(result: DataResult) -> dict[str, np.ndarray]:
    index = load_index(result.index_dir)
    return {name: getattr(index, name) for name in ("shard", "doc", "length", "loss_tokens", "content_hash", "split")}


def _docs(result: DataResult) -> list[tuple[str, list[int], list[list[int]]]]:
    docs = []
    for shard in result.pbin:
        with open_pbin(shard.path) as f:
            docs += [(f.source(i), f.doc(i).tolist(), f.loss_spans(i).tolist()) for i in range(len(f))]
    return docs


@pytest.fixture(scope="module")
def threads_run(dataset, tmp_path_factory) -> DataResult:
    shard_bytes = dataset["data"].stat().st_size // 5
    return _run(dataset, tmp_path_factory.mktemp("threads"), shard_bytes=shard_bytes, workers=2)[0]


def _assert_same_output(got: DataResult, want: DataResult) -> None:
    # Same shards, same bytes: the pbin files (header provenance included) and every index array.
    assert [Path(p.path).read_bytes() for p in got.pbin] == [Path(p.path).read_bytes() for p in want.pbin]
    assert [p.sha256 for p in got.pbin] == [p.sha256 for p in want.pbin]
    for name, array in _index_arrays(want).items():
        np.testing.assert_array_equal(_index_arrays(got)[name], array, err_msg=name)
    paths = {"index": None, "rejects": None}  # folders of each run's own work dir
    assert got.summary() | paths == want.summary() | paths
    assert len(got.summary()["rejects"]) == len(want.summary()["rejects"])


def test_dask_cluster_output_is_byte_identical_to_threads(dataset, threads_run, tmp_path):
    """An existing cluster (`dask_address`) of 2 worker processes; the next test has the runner start its own."""
    from distributed import LocalCluster

    shard_bytes = dataset["data"].stat().st_size // 5
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        address = cluster.scheduler_address
        dask, states = _run(
            dataset, tmp_path / "dask", shard_bytes=shard_bytes, task_runner="dask", dask_address=address
        )

    assert len(dask.pbin) >= 5
    assert states["render"] == ["Completed"] * len(dask.pbin)
    _assert_same_output(dask, threads_run)
    with open_pbin(dask.pbin[1].path) as f:
        assert f.provenance["source_range"].startswith("bytes ")
        assert f.provenance["source_sha256"] == dask.rendered[0].source_sha256


_EPHEMERAL_SCRIPT = """
import sys
from sftflow.flows.config import DataConfig, SFTConfig
from sftflow.flows.data import sft_data
config = DataConfig.model_validate_json(sys.argv[1])
sft_data(config=SFTConfig(work_dir=sys.argv[2], data=config))
"""


@pytest.mark.slow
def test_dask_workers_reach_the_flows_ephemeral_api(dataset, threads_run, tmp_path):
    """The data flow called from Python with no Prefect API set runs on Prefect's temporary (ephemeral) server: the
    workers must use the flow's, not start their own."""
    config = DataConfig(
        sources=[str(dataset["data"])],
        tokenizer=str(dataset["tokenizer"]),
        render={"template": "chatml", "on_bad_record": "reject"},
        index={"eval_fraction": 0.2},
        shard_bytes=dataset["data"].stat().st_size // 5,
        task_runner="dask",
        workers=2,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    # Prefect's own 20 s start-up budget is too short for a first start on a busy 2-core machine (the CLI uses
    # sftflow's local API instead; a Python caller of the flows sets this, as the README says).
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "600"
    work = tmp_path / "work"
    args = [sys.executable, "-c", _EPHEMERAL_SCRIPT, config.model_dump_json(), str(work)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert output.count("Starting temporary server") == 1, output[-3000:]
    assert output.count("Task run 'render-") == 5
    _assert_same_output(load_data_result(work), threads_run)


def test_shard_size_changes_which_shard_holds_a_doc_and_nothing_else(dataset, tmp_path):
    whole, _ = _run(dataset, tmp_path / "whole")
    by_bytes, _ = _run(dataset, tmp_path / "bytes", shard_bytes=4096)
    by_lines, _ = _run(dataset, tmp_path / "lines", shard_records=50)

    assert len(whole.pbin) == 1 and len(by_bytes.pbin) > 3 and len(by_lines.pbin) > 3
    expected = _docs(whole)
    assert expected[0][0] == f"{dataset['data'].resolve()}:1"
    for sharded in (by_bytes, by_lines):
        # The pbin docs concatenated in shard order are the unsharded docs, true line numbers included.
        assert _docs(sharded) == expected
        got, want = _index_arrays(sharded), _index_arrays(whole)
        for name in ("length", "loss_tokens", "content_hash", "split"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert sharded.index.dropped == whole.index.dropped
        assert sum(r.num_rejected for r in sharded.rendered) == 1
        rejects = [json.loads(line) for r in sharded.rendered if r.rejects_path for line in open(r.rejects_path)]
        assert [r["source"] for r in rejects] == [f"{dataset['data'].resolve()}:101"]
    assert whole.index.dropped.get("duplicate", 0) > 0  # dedup across shard boundaries kept the same first copies


def test_remote_dask_address_without_a_prefect_server_is_refused():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = DataConfig(sources=["x.jsonl"], tokenizer="t", task_runner="dask", dask_address="tcp://10.1.2.3:8786")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(ValueError, match="10.1.2.3:8786.*PREFECT_API_URL") as refused:
            with api_for_workers(config):
                pass
    # which API that is, as it is now: Prefect's temporary server of a flow called from Python (commands always set
    # PREFECT_API_URL, to the user's server or sftflow's local one)
    assert "Prefect's temporary server" in str(refused.value) and "ephemeral" not in str(refused.value)
