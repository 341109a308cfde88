"""Experiment tracking against the real things: a local `mlflow server` started and stopped here, TensorBoard event
files read back with TensorBoard's own reader, and Weights & Biases in offline mode. A tracker that cannot be reached
is a warning, never a failed run, and a cached rerun sends nothing twice. Step metrics reach the trackers while the
model trains, into the one tracker run the end of the pipeline completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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

    # Offline, the live run and its resumption by the end-of-run send are two local folders of one run id.
    run_dir = Path(by_tracker["wandb"].url)
    assert run_dir.name.startswith("offline-run-")
    folders = sorted(run_dir.parent.glob(f"offline-run-*-{by_tracker['wandb'].run_id}*"))
    assert len(folders) == 2 and run_dir in folders
    records = [record for folder in folders for record in _wandb_records(next(folder.glob("run-*.wandb")))]
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
    config = {i.key: i.value_json for r in records if r.WhichOneof("record_type") == "run" for i in r.run.config.update}
    assert json.loads(config["train.max_steps"]) == "4"  # from the end-of-run send: the live run has none yet


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


def _prefect_database_files() -> list[Path]:
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    url = PREFECT_API_DATABASE_CONNECTION_URL.value() or ""
    path = Path(url.split("///", 1)[1]) if url.startswith("sqlite") else None
    return [p for p in (path, Path(f"{path}-wal")) if p is not None and p.exists()]


def _prefect_api_json() -> str:
    """Every flow run (with its parameters), log line and artifact the Prefect API holds, as JSON text."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(limit=200)
        logs = client.read_logs(limit=200)
        artifacts = client.read_artifacts(limit=200)
    return "\n".join(item.model_dump_json() for item in (*runs, *logs, *artifacts))


def test_credentials_in_the_mlflow_uri_are_written_nowhere(mlflow_server, tmp_path, monkeypatch):
    """A password in `track.mlflow.uri`, run from a config file as a user runs it: MLflow gets the run (the password
    sent as basic auth, which this server ignores), and the password is in no file of the run, nothing the command
    printed, no row of the Prefect database and nothing its API returns."""
    from mlflow.tracking import MlflowClient

    from tests.flows.conftest import run_cli

    secret = f"pw-{os.getpid()}-{time.time_ns()}"
    for var in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(var, "placeholder")  # restored afterwards; the config's credentials replace it
    uri = mlflow_server.replace("http://", f"http://alice:{secret}@")
    config = tmp_path / "config" / "my-sft.yaml"
    config.parent.mkdir()
    work = tmp_path / "work"
    config.write_text(
        json.dumps(
            {
                "work_dir": str(work),
                "demo": {"records": 60},
                "plan": {"tokens_per_rank": 512},
                "train": {"model": "tiny-llama", "max_steps": 2, "num_threads": 1},
                "eval": {"max_docs": 4, "max_generations": 1, "num_examples": 1},
                "track": {"mlflow": {"uri": uri, "experiment": "sftflow-secret"}, "tensorboard": True},
            }
        )
    )
    proc = run_cli("run", str(config))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("sftflow-secret")
    assert experiment is not None and client.search_runs([experiment.experiment_id])
    assert secret not in proc.stdout + proc.stderr
    files = [p for p in work.rglob("*") if p.is_file()] + _prefect_database_files()
    assert len(files) > 20 and any("tensorboard" in str(p) for p in files)
    holding = [str(p) for p in files if secret.encode() in p.read_bytes()]
    assert not holding, holding
    api = _prefect_api_json()
    assert str(work) in api and "127.0.0.1" in api  # the runs' parameters are there, the URI without its password
    assert secret not in api


def _live_config(work: Path, uri: str) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work),
            "demo": {"records": 200},
            "plan": {"tokens_per_rank": 512, "epochs": 3},
            "train": {"model": "tiny-llama", "max_steps": LIVE_STEPS, "num_threads": 1},
            "eval": {"max_docs": 4, "max_generations": 1, "num_examples": 1},
            "track": {"mlflow": {"uri": uri, "experiment": "sftflow-live"}, "tensorboard": True, "live_every_s": 0.5},
        }
    )


LIVE_STEPS = 30


def _training_processes() -> list[int]:
    """The torchrun this test process started and every process under it (its workers run in sessions of their own,
    so its process group alone would miss them)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):  # a process that ended while being read
                continue
    torchrun = [
        pid
        for pid, ppid in parents.items()
        if ppid == os.getpid() and b"sftflow.tasks.train.torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    found = list(torchrun)
    for pid in found:  # grows while it is walked: breadth first down the tree
        found += [child for child, ppid in parents.items() if ppid == pid]
    if not torchrun:
        raise LookupError("no torchrun started by this process")
    return found


def _freeze_training_until_mlflow_has_its_steps(work: Path, uri: str, seen: dict) -> None:
    """Once the first step is written, stop the training processes (SIGSTOP) so that no further step can be
    written, wait until the MLflow server holds every step written so far, then let training go on. What MLflow
    held while training stood still is what was sent while it ran: no timing is assumed."""
    from mlflow.tracking import MlflowClient

    from sftflow.tasks.train.metrics import read_metrics

    deadline = time.monotonic() + 120
    while not (files := list(work.glob("train/*/metrics.jsonl"))) or not read_metrics(files[0]):
        if time.monotonic() > deadline:
            raise TimeoutError("training wrote no step")
        time.sleep(0.01)
    frozen = _training_processes()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        seen["written"] = [r["step"] for r in read_metrics(files[0])]
        client = MlflowClient(tracking_uri=uri)
        while True:
            experiment = client.get_experiment_by_name("sftflow-live")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            seen["runs"] = [run.info.run_id for run in runs]
            if runs:
                seen["held"] = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
                seen["status"] = runs[0].info.status
                if seen["held"] == seen["written"]:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"MLflow did not get the steps written: {seen}")
            time.sleep(0.2)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


def test_step_metrics_reach_mlflow_and_tensorboard_while_training_runs(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sftflow.tasks.track.live import read_live_runs

    seen, errors = {}, []

    def watch():
        try:
            _freeze_training_until_mlflow_has_its_steps(tmp_path, mlflow_server, seen)
        except Exception as err:
            errors.append(err)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = sft(config=_live_config(tmp_path, mlflow_server))
    watcher.join(60)
    assert not errors, errors
    # While training stood at a step before its last, MLflow held every step written, in one running run.
    assert seen["written"][-1] < LIVE_STEPS and seen["held"] == seen["written"]
    assert len(seen["runs"]) == 1 and seen["status"] == "RUNNING"

    by_tracker = {t.tracker: t for t in result.tracking}
    assert all(t.ok for t in result.tracking), result.tracking
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("sftflow-live").experiment_id])
    # The end of the pipeline completed that same run: each step once, the config, the eval metrics.
    assert run.info.run_id == seen["runs"][0] == by_tracker["mlflow"].run_id and run.info.status == "FINISHED"
    for key in ("loss", "lr", "grad_norm", "trained_tokens"):  # the breakdown's keys: the resumed test below
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, LIVE_STEPS + 1))
    assert run.data.params["train.max_steps"] == str(LIVE_STEPS)
    assert run.data.metrics["eval/tuned/loss"] == pytest.approx(result.eval.metrics["tuned"].loss)

    # TensorBoard: the live writer's event file and the end's in one log dir, each step once.
    log_dir = Path(by_tracker["tensorboard"].url)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, LIVE_STEPS + 1))
    assert events.Scalars("eval/tuned/loss")[0].step == LIVE_STEPS

    live = read_live_runs(result.train.run_dir)
    assert {t: (r.run_id, r.closed) for t, r in live.items()} == {
        "mlflow": (run.info.run_id, True),
        "tensorboard": (log_dir.name, True),
    }


def test_a_resumed_training_run_continues_its_live_runs(mlflow_server, tmp_path):
    """Two attempts of one training run (the first stopped after step 3, the second resumed from the checkpoint at
    step 2, as `metrics.jsonl` then reads) make one tracker run holding each step once."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sftflow.tasks.core.atomic import write_atomic
    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.live import LiveTracker, read_live_runs

    config = TrackConfig.model_validate(
        {"mlflow": {"uri": mlflow_server, "experiment": "sftflow-resumed"}, "tensorboard": True, "live_every_s": 0.2}
    )
    run_dir = tmp_path / "train" / "run"
    run_dir.mkdir(parents=True)
    metrics = run_dir / "metrics.jsonl"

    def line(step: int, attempt: int) -> str:
        breakdown = {"source": {"chat": {"loss": 2.0 / step, "token_accuracy": 0.1 * attempt}}}
        return json.dumps({"step": step, "loss": 1.0 / step + attempt, "lr": 1e-3, "breakdown": breakdown}) + "\n"

    first = LiveTracker(config, tmp_path)
    first.start(run_dir)
    metrics.write_text("".join(line(step, 1) for step in (1, 2, 3)))
    first.stop(trained=False)
    (opened,) = [r for r in read_live_runs(run_dir).values() if r.tracker == "mlflow"]
    client = MlflowClient(tracking_uri=mlflow_server)
    assert opened.sent_through == 3 and client.get_run(opened.run_id).info.status == "FAILED"

    # The first attempt went on to step 4 after its tracker stopped, and crashed; it had saved a checkpoint at 2.
    with metrics.open("a") as f:
        f.write(line(4, 1))
    (run_dir / "checkpoints" / "step-2").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-2" / ".metadata").write_bytes(b"")
    (run_dir / "checkpoints" / "latest").write_text("step-2\n")
    second = LiveTracker(config, tmp_path)
    second.start(run_dir)  # before the worker starts, as the launcher does
    deadline = time.monotonic() + 60  # its first tick has read the old file when it has reopened the run
    while client.get_run(opened.run_id).info.status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.05)
    write_atomic(metrics, "".join(line(step, 1) for step in (1, 2)))  # what the resumed worker keeps
    with metrics.open("a") as f:
        f.write("".join(line(step, 2) for step in (3, 4, 5)))
    second.stop(trained=True)

    (run,) = client.search_runs([client.get_experiment_by_name("sftflow-resumed").experiment_id])
    assert run.info.run_id == opened.run_id and run.info.status == "RUNNING"
    history = client.get_metric_history(run.info.run_id, "loss")
    # Step 3 was sent by the first attempt; the second sends only what comes after it, and the crashed attempt's
    # step 4 (after the checkpoint the worker resumed from) is never sent: the resumed run's is.
    assert [m.step for m in history] == [1, 2, 3, 4, 5]
    assert [m.value for m in history] == pytest.approx([1 / 1 + 1, 1 / 2 + 1, 1 / 3 + 1, 1 / 4 + 2, 1 / 5 + 2])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/source/chat/loss")] == [1, 2, 3, 4, 5]
    live = read_live_runs(run_dir)
    assert {t: r.sent_through for t, r in live.items()} == {"mlflow": 5, "tensorboard": 5}
    events = EventAccumulator(live["tensorboard"].url)
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [e.step for e in events.Scalars("train/source/chat/loss")] == [1, 2, 3, 4, 5]  # one train/ prefix


def test_training_alone_finishes_its_mlflow_run_and_a_later_pipeline_run_completes_that_run(mlflow_server, tmp_path):
    """`sft-train` on its own (the `sft-train/rerun` deployment) has no evaluation to wait for: its MLflow run is
    FINISHED when training ends. A later `sft` run finds the model Cached and sends its evaluation into that same
    run, without a second run or a step sent twice."""
    from mlflow.tracking import MlflowClient

    from sftflow.flows.data import sft_data
    from sftflow.flows.plan import sft_plan
    from sftflow.flows.train import sft_train
    from sftflow.tasks.track.live import read_live_runs

    cfg = SFTConfig.model_validate(
        {
            "work_dir": str(tmp_path),
            "demo": {"records": 120},
            "plan": {"tokens_per_rank": 512},
            "train": {"model": "tiny-llama", "max_steps": 4, "num_threads": 1},
            "eval": {"max_docs": 4, "max_generations": 1, "num_examples": 1},
            "track": {"mlflow": {"uri": mlflow_server, "experiment": "sftflow-alone"}, "live_every_s": 0.5},
        }
    )
    sft_data(config=cfg)
    sft_plan(config=cfg)
    trained = sft_train(config=cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.get_experiment_by_name("sftflow-alone").experiment_id
    (alone,) = client.search_runs([experiment_id])
    assert alone.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(alone.info.run_id, "loss")] == [1, 2, 3, 4]
    live = read_live_runs(trained.run_dir)["mlflow"]
    assert (live.run_id, live.closed) == (alone.info.run_id, False)  # open to a later evaluation

    result = sft(config=cfg)
    assert result.train.run_dir == trained.run_dir  # Cached: not trained again
    (run,) = client.search_runs([experiment_id])
    assert run.info.run_id == alone.info.run_id and run.info.status == "FINISHED"
    assert run.data.metrics["eval/tuned/loss"] == pytest.approx(result.eval.metrics["tuned"].loss)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
