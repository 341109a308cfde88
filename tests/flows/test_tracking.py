"""Experiment tracking against the real things: a local `mlflow server` started and stopped here, TensorBoard event
files read back with TensorBoard's own reader, and Weights & Biases in offline mode. A tracker that cannot be reached
is a warning, never a failed run, and a cached rerun sends nothing twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftflow.flows.config import SFTConfig
from sftflow.flows.local_api import free_port, healthy
from sftflow.flows.sft import sft

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow", reason="needs the track extra (mlflow)")
pytest.importorskip("tensorboard", reason="needs the track extra (tensorboard)")
pytest.importorskip("wandb", reason="needs the track extra (wandb)")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (root / "server.log").open("w")
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'db.sqlite'}", "--artifacts-destination", str(root / "a")]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not healthy(uri):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _config(work: Path, uri: str) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work),
            "demo": {"records": 120},
            "plan": {"tokens_per_rank": 512},
            "train": {"model": "tiny-llama", "max_steps": 4, "num_threads": 1},
            "eval": {"max_docs": 6, "max_generations": 1, "num_examples": 1},
            "track": {
                "mlflow": {"uri": uri, "experiment": "sftflow-test", "log_model": True, "registered_model": "tiny"},
                "tensorboard": True,
                "wandb": {"project": "sftflow-test", "mode": "offline"},
            },
        }
    )


@pytest.fixture(scope="module")
def tracked(mlflow_server, tmp_path_factory):
    work = tmp_path_factory.mktemp("tracked")
    result = sft(config=_config(work, mlflow_server))
    return work, result


def test_mlflow_gets_params_step_metrics_eval_plots_and_the_model(tracked, mlflow_server):
    from mlflow.tracking import MlflowClient

    _, result = tracked
    by_tracker = {t.tracker: t for t in result.tracking}
    assert all(t.ok for t in result.tracking), result.tracking
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(by_tracker["mlflow"].run_id)
    assert run.data.params["train.max_steps"] == "4" and run.data.params["train.model"] == "tiny-llama"
    assert run.data.tags["prefect.flow_run_id"]  # the link back to the Prefect run
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4]
    losses = [json.loads(line)["loss"] for line in Path(result.train.metrics_path).read_text().splitlines()]
    assert [m.value for m in history] == pytest.approx(losses)
    assert run.data.metrics["eval/tuned/loss"] == pytest.approx(result.eval.metrics["tuned"].loss)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"eval", "plots", "model"} <= artifacts
    assert "model/config.json" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert "plots/loss_curve.png" in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert by_tracker["mlflow"].url.startswith(mlflow_server)
    assert by_tracker["mlflow"].model_version is None  # no gate ran: nothing registered


def test_tensorboard_and_wandb_offline_hold_the_run(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, result = tracked
    by_tracker = {t.tracker: t for t in result.tracking}
    events = EventAccumulator(by_tracker["tensorboard"].url, size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert events.Scalars("eval/tuned/loss")[0].value == pytest.approx(result.eval.metrics["tuned"].loss, rel=1e-6)
    assert "loss_curve" in events.Tags()["images"]

    run_dir = Path(by_tracker["wandb"].url)
    assert run_dir.name.startswith("offline-run-")
    records = _wandb_records(next(run_dir.glob("run-*.wandb")))
    history = [
        {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    steps = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert [step for step, _ in steps] == [1, 2, 3, 4]
    summary = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
        if item.key
    }
    assert summary["eval/tuned/loss"] == pytest.approx(result.eval.metrics["tuned"].loss)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert json.loads({i.key: i.value_json for i in run.config.update}["train.max_steps"]) == "4"


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file: a 7-byte header, then a LevelDB-style log of 32 KiB blocks
    whose records are split into FULL / FIRST / MIDDLE / LAST chunks, each behind a (crc32, length, type) header."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, block, pos = path.read_bytes(), 32768, 7
    assert raw[:4] == b":W&B"
    chunks, pending = [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        else:
            chunks.append(pending + data)
    records = []
    for data in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        records.append(record)
    return records


def test_a_cached_rerun_sends_nothing_twice_and_registers_what_the_gate_promotes(tracked, mlflow_server):
    from mlflow.tracking import MlflowClient

    work, result = tracked
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("sftflow-test")
    # A Cached rerun, now with the gate: the run already in MLflow is not sent again, and the model the gate
    # promotes (an empty registry takes it) becomes version 1 of "tiny", alias champion.
    again = sft(config=_config(work, mlflow_server), promote=True)
    assert [t.run_id for t in again.tracking] == [t.run_id for t in result.tracking]
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert again.promotion.decision == "promoted"
    mlflow_run = next(t for t in again.tracking if t.tracker == "mlflow")
    assert mlflow_run.model_version == "1"
    champion = client.get_model_version_by_alias("tiny", "champion")
    assert champion.version == "1" and champion.run_id == mlflow_run.run_id
    assert champion.tags["sftflow.registry_version"] == again.promotion.champion

    third = sft(config=_config(work, mlflow_server), promote=True)
    assert third.promotion.decision == "unchanged"  # the same files: no new registry version either
    assert len(client.search_model_versions("name='tiny'")) == 1
    assert len(client.search_runs([experiment.experiment_id])) == 1

    # Turning trackers off and on again, or changing their set, sends to none that already hold the run.
    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.stage import track_run

    full = _config(work, mlflow_server).track
    only_tensorboard = TrackConfig(tensorboard=True)
    (tensorboard_run,) = track_run(only_tensorboard, {}, again.train, again.eval, work)
    assert tensorboard_run.run_id == next(t.run_id for t in result.tracking if t.tracker == "tensorboard")
    back = track_run(full, {}, again.train, again.eval, work)
    assert [t.run_id for t in back] == [t.run_id for t in again.tracking]
    assert len(client.search_runs([experiment.experiment_id])) == 1
    # Another experiment is another target: that tracker, and only it, gets the run.
    moved = full.model_copy(update={"mlflow": full.mlflow.model_copy(update={"experiment": "sftflow-other"})})
    sent = {t.tracker: t for t in track_run(moved, {}, again.train, again.eval, work)}
    assert sent["mlflow"].run_id != mlflow_run.run_id and sent["wandb"].run_id == mlflow_run_of(again, "wandb")
    assert len(client.search_runs([client.get_experiment_by_name("sftflow-other").experiment_id])) == 1


def mlflow_run_of(result, tracker: str) -> str:
    return next(t.run_id for t in result.tracking if t.tracker == tracker)


def test_an_unreachable_tracker_is_a_warning_and_the_others_still_get_the_run(tracked, caplog):
    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.stage import track_run

    work, result = tracked
    dead = f"http://127.0.0.1:{free_port()}"
    config = TrackConfig.model_validate({"mlflow": {"uri": dead}, "tensorboard": True})
    start = time.monotonic()
    tracked_runs = track_run(config, {"train": {"lr": 1}}, result.train, result.eval, work / "elsewhere")
    assert time.monotonic() - start < 30
    mlflow_run, tensorboard_run = tracked_runs
    assert not mlflow_run.ok and f"MLflow at {dead} is not reachable" in mlflow_run.error
    assert tensorboard_run.ok
    assert any(f"mlflow at {dead} (experiment sftflow) did not get this run" in r.getMessage() for r in caplog.records)
