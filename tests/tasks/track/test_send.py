"""Sending a finished run to its trackers (`sftflow.tasks.track.stage.send`)."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard", reason="needs the track extra (tensorboard)")


def test_a_tensorboard_run_recorded_by_its_own_folder_is_not_sent_again(tmp_path):
    """`track.json` files written before live tracking name a TensorBoard run by its folder
    (`WORK_DIR/tensorboard/<run>`), not by the tensorboard folder the config now names."""
    from sftflow.tasks.track.config import TrackConfig
    from sftflow.tasks.track.record import RunRecord
    from sftflow.tasks.track.sinks import TrackedRun
    from sftflow.tasks.track.stage import send

    old = str(tmp_path / "tensorboard" / "sftflow-run-1234")
    earlier = TrackedRun(tracker="tensorboard", ok=True, run_id="sftflow-run-1234", url=old, target=old)
    record = RunRecord(name="sftflow-run-1234", params={}, steps=[{"step": 1, "loss": 1.0}], eval={}, final_step=1)
    (sent,) = send(record, TrackConfig(tensorboard=True), tmp_path, {"tensorboard": earlier})
    assert sent == earlier and not (tmp_path / "tensorboard").exists()  # nothing written
    elsewhere = TrackedRun(tracker="tensorboard", ok=True, target=str(tmp_path / "other" / "x"))
    (resent,) = send(record, TrackConfig(tensorboard=True), tmp_path, {"tensorboard": elsewhere})
    assert resent.ok and resent.target == str(tmp_path / "tensorboard")
