"""Live tracking (`sftflow.tasks.track.live`): a tracker that cannot be reached while a run trains."""

from __future__ import annotations

import json
import socket
import time

import pytest

# Prefect sets up its logging on this import: here, before caplog attaches its handler, not during the test.
from prefect import get_run_logger  # noqa: F401

pytest.importorskip("mlflow", reason="needs the track extra (mlflow)")
pytest.importorskip("tensorboard", reason="needs the track extra (tensorboard)")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tracker_unreachable_live_is_one_warning_and_the_others_still_follow(tmp_path, caplog):
    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.live import LiveTracker, read_live_runs

    dead = f"http://127.0.0.1:{_closed_port()}"
    config = TrackConfig.model_validate({"mlflow": {"uri": dead}, "tensorboard": True, "live_every_s": 0.1})
    run_dir = tmp_path / "train" / "run"
    run_dir.mkdir(parents=True)
    tracker = LiveTracker(config, tmp_path)
    tracker.start(run_dir)

    def followed_through(step: int) -> None:  # TensorBoard's state moves on at a tick after the step is written
        deadline = time.monotonic() + 60
        while (
            read_live_runs(run_dir).get("tensorboard") is None
            or read_live_runs(run_dir)["tensorboard"].sent_through < step
        ):
            assert time.monotonic() < deadline, read_live_runs(run_dir)
            time.sleep(0.05)

    with (run_dir / "metrics.jsonl").open("a") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
            f.flush()
            followed_through(step)  # so MLflow was tried at three ticks at least
    tracker.stop(trained=True)
    warnings = [r.getMessage() for r in caplog.records if "is not following this run live" in r.getMessage()]
    assert len(warnings) == 1 and f"mlflow at {dead}" in warnings[0] and "not reachable" in warnings[0]
    assert set(read_live_runs(run_dir)) == {"tensorboard"}  # MLflow opened no run: the run's end makes one
