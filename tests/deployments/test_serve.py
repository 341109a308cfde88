"""Deployments for real: a `prefect server`, `deployments/serve.py`, and `prefect deployment run ... --watch`.

Everything runs on this machine's loopback address and is shut down by PID at the end (serve first, then server).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import crash_env

REPO = Path(__file__).resolve().parents[2]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
PROMOTE = ("sft/promote", "sft-promote/gate")
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1.0)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"),
        DO_NOT_TRACK="1",
    )
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait(lambda: _healthy(api) or server.poll() is not None, 180, "prefect server")
        assert server.poll() is None, (home / "server.log").read_text()[-3000:]
        yield env, home
    finally:
        _stop(server)
        log.close()


def _final_state(prefect, flow_run_id: str, timeout_s: float = 600) -> str:
    """Poll `prefect flow-run inspect` until the run is in a final state; return its type (COMPLETED, FAILED, ...)."""
    final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    state = None

    def done() -> bool:
        nonlocal state
        out = prefect("flow-run", "inspect", flow_run_id, timeout=60).stdout
        found = re.search(r"state_type=StateType\.([A-Z]+)", out)
        state = found.group(1) if found else None
        return state in final

    _wait(done, timeout_s, f"flow run {flow_run_id} to finish")
    return state


@pytest.mark.slow
def test_serve_and_run_deployments(prefect_server, tmp_path):
    env, home = prefect_server
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "work_dir": str(tmp_path / "work"),
                "train_retries": 0,  # so that the injected crash below fails the flow run
                "demo": {"records": 120},
                "plan": {"tokens_per_rank": 512},
                "train": {"model_overrides": TINY, "lr": 1e-3, "max_steps": 4, "checkpoint_every": 2},
                "eval": {"max_docs": 8, "max_generations": 2, "num_examples": 1},
            }
        )
    )
    # The run with learning rate 7e-4 below crashes after step 3, once (tests/crash_shim); the others do not.
    serve_env = crash_env("crash_after_step=3,lr=0.0007", dict(env, SFTFLOW_CONFIG=str(config)))
    serve_log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, str(REPO / "deployments" / "serve.py")],
        env=serve_env,
        cwd=tmp_path,
        stdout=serve_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def prefect(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(["prefect", *args], env=env, capture_output=True, text=True, timeout=timeout)

    try:
        served = lambda: prefect("deployment", "inspect", "sft-eval/rerun", timeout=60).returncode == 0  # noqa: E731
        _wait(served, 120, "deployments")
        listing = prefect("deployment", "ls", timeout=60).stdout
        for name in ("sft/full", "sft-data/refresh", "sft-plan/rerun", "sft-train/rerun", "sft-eval/rerun", *PROMOTE):
            assert name in listing, listing
        refresh = prefect("deployment", "inspect", "sft-data/refresh", timeout=60).stdout
        assert "0 3 * * *" in refresh  # the nightly schedule

        full = prefect("deployment", "run", "sft/full", "--watch", "--watch-timeout", "900", timeout=960)
        assert full.returncode == 0, full.stdout + full.stderr + (tmp_path / "serve.log").read_text()[-4000:]
        assert "Completed" in full.stdout
        assert (tmp_path / "work" / "eval.json").is_file()

        # A stage rerun reads the latest upstream results: training is Cached, nothing upstream runs again.
        rerun = prefect("deployment", "run", "sft-train/rerun", "--watch", "--watch-timeout", "300", timeout=360)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        log = (tmp_path / "serve.log").read_text()
        assert "Finished in state Cached" in log

        # A run whose training crashes fails; `prefect flow-run retry` reruns it and training resumes from its last
        # checkpoint (the fault fires once per run folder), without redoing data or plan.
        started = prefect("deployment", "run", "sft/full", "-p", "learning_rate=7e-4")
        assert started.returncode == 0, started.stdout + started.stderr
        flow_run_id = re.search(UUID, started.stdout).group(0)
        assert _final_state(prefect, flow_run_id) == "FAILED"
        retried = prefect("flow-run", "retry", flow_run_id, timeout=120)
        assert retried.returncode == 0, retried.stdout + retried.stderr
        assert _final_state(prefect, flow_run_id) == "COMPLETED", (tmp_path / "serve.log").read_text()[-4000:]
        log = (tmp_path / "serve.log").read_text()
        assert re.search(r"resumed all components from \S*step-2", log), log[-4000:]
    finally:
        _stop(serve)
        serve_log.close()


def test_prefect_yaml_deploys_to_a_process_pool(prefect_server):
    env, _ = prefect_server
    env = dict(env, SFTFLOW_HOME=str(REPO))

    def prefect(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["prefect", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)

    pool = prefect("work-pool", "create", "sftflow-process", "--type", "process")
    assert pool.returncode == 0, pool.stdout + pool.stderr
    deployed = prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    listing = prefect("deployment", "ls").stdout
    for name in ("sft/full", "sft-data/refresh", "sft-plan/rerun", "sft-train/rerun", "sft-eval/rerun", *PROMOTE):
        assert name in listing, listing
