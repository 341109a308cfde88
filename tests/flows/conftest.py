"""Flow tests run on Prefect's real engine: one session-scoped test harness (temporary API database) with results in a
temporary folder, since the harness does not isolate results."""

from __future__ import annotations

import logging
import os
import sys
from collections import defaultdict

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    # No flow run heartbeats in this process: each flow run (every subflow of `sft` too) otherwise ends by joining
    # its heartbeat thread out of a 1 s sleep, about a second per run for a signal only a server's crash detection
    # reads. Runs that a runner starts (tests/deployments) and the `sftflow` commands run as processes keep them.
    settings = {PREFECT_RESULTS_LOCAL_STORAGE_PATH: str(results), PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    with temporary_settings(settings):
        with prefect_test_harness(server_startup_timeout=120):
            yield


@pytest.fixture(autouse=True)
def prefect_console_on_a_live_stream():
    """Prefect rebuilds its logging handlers when its API app is created (`create_app` calls `setup_logging`); a CLI
    test under typer's `CliRunner` that does so leaves the console handler writing to the runner's stream, closed
    once the test ends, and every later test's flow-run log then fails. Point such a handler back at stderr."""
    yield
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one first
                handler.console.file = sys.stderr


_STAGE_OF_TASK = {
    "render_task": "render",
    "spans_task": "spans",
    "pbin_task": "pbin",
    "index_task": "index",
    "text_scan_task": "textscan",
    "plan_task": "plan",
    "train_stage_task": "train",
    "_train_task_fn": "train",
    "eval_task": "evaluate",
    "promote_task": "promote",
    "bench_task": "bench",
}


def _stage(run) -> str:
    # task_key looks like "render_task-<hash>": the task function's name, then a hash.
    name = run.task_key.split("-")[0]
    return _STAGE_OF_TASK.get(name, name)


def _read_task_runs(**filters) -> list:
    """Task runs matching `filters`, once each has a final state and no more appear. Task runs reach the API as
    events, recorded by the server after the flow has returned: for a moment a run can still show no state, or not
    exist yet. So this sends the events still queued in this process, then reads until every run is final and the
    count has held for half a second."""
    import inspect
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    drained = EventsWorker.drain_all(timeout=10, at_exit=False)
    if inspect.isawaitable(drained):  # only in an async context, which these tests are not
        raise RuntimeError("_read_task_runs is for synchronous tests")
    deadline = time.monotonic() + 15
    count, since = -1, time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(**filters)
            now = time.monotonic()
            if len(runs) != count:
                count, since = len(runs), now
            final = all(run.state is not None and run.state.is_final() for run in runs)
            if final and now - since >= 0.5 or now > deadline:
                return runs
            time.sleep(0.1)


def _flow_task_runs(flow_state) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run_id = flow_state.state_details.flow_run_id
    return _read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def task_states(flow_state) -> dict[str, list[str]]:
    """Final state names of every task run of a finished flow run, keyed by stage (`render`, `spans`, ...)."""
    states: dict[str, list[str]] = defaultdict(list)
    for run in _flow_task_runs(flow_state):
        states[_stage(run)].append(run.state.name)
    return dict(states)


def run_counts(flow_state) -> dict[str, list[int]]:
    """How many times each task run of a finished flow run ran (retries included), keyed by stage."""
    counts: dict[str, list[int]] = defaultdict(list)
    for run in _flow_task_runs(flow_state):
        counts[_stage(run)].append(run.run_count)
    return dict(counts)


class RecordedTaskRuns:
    """Task runs created while the `with` block ran, over all flows and subflows (tests run one at a time)."""

    def __enter__(self):
        import datetime

        self.start = datetime.datetime.now(datetime.timezone.utc)
        return self

    def __exit__(self, *exc):
        return False

    def states(self) -> dict[str, list[str]]:
        import time

        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterEndTime

        window = TaskRunFilter(end_time=TaskRunFilterEndTime(after_=self.start))
        # A run appears here once its final state is recorded (from events): read until the set stops growing.
        runs, previous = _read_task_runs(task_run_filter=window), -1
        while len(runs) != previous:
            previous = len(runs)
            time.sleep(0.5)
            runs = _read_task_runs(task_run_filter=window)
        states: dict[str, list[str]] = defaultdict(list)
        for run in runs:
            if not run.name.startswith("sft-"):  # the placeholder task run of each subflow
                states[_stage(run)].append(run.state.name)
        return dict(states)


def run_cli(*args: str, timeout: float = 600):
    """Run the `sftflow` console script as a user would, against the test harness's API server."""
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    exe = Path(sys.executable).with_name("sftflow")
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=timeout)
