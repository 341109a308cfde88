"""What the deployment tests share: polling for a condition, stopping a process group, and a real `prefect server`
started on a database of its own and waited for until it answers."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

from sftflow.flows.local_api import free_port

POLL_S = 0.2


def wait_for(predicate, timeout_s: float, what: str):
    """The first truthy value of `predicate()`, polled every `POLL_S` seconds; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of `proc` (started with `start_new_session=True`), SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def healthy(api: str) -> bool:
    """Whether the Prefect API at `api` answers its health check."""
    try:
        with urllib.request.urlopen(api + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def listens_in_session(port: int, session: int) -> bool:
    """Whether a process of session `session` (a server started with `start_new_session=True`) listens on `port`."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                if os.getsid(conn.pid) == session:
                    return True
            except ProcessLookupError:
                pass
    return False


def _up_or_lost(server: subprocess.Popen, port: int, api: str, log_path: Path) -> bool:
    """Whether `server` exited, lost its port to another process, or is up: its own process listens and answers."""
    if server.poll() is not None or "already in use" in log_path.read_text():
        return True
    return listens_in_session(port, server.pid) and healthy(api)


@contextmanager
def prefect_server_on(env: dict, log_path: Path, timeout_s: float) -> Iterator[tuple[dict, subprocess.Popen]]:
    """`prefect server start` on a free loopback port with `env` (its PREFECT_* settings: home, database), once it
    answers: (`env` with PREFECT_API_URL naming it, the server's process). Stopped, by process group, on exit.

    A free port is free only until someone binds it: two test workers starting servers at once can be handed the
    same one, and then the second server fails to bind while the first answers its health check. So the server
    counts as up only once its own process listens on the port; one that lost the port is started again on another."""
    for attempt in range(3):
        port = free_port()
        served = dict(env, PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env=served,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for(
                partial(_up_or_lost, server, port, served["PREFECT_API_URL"], log_path), timeout_s, "prefect server"
            )
            lost_port = "already in use" in log_path.read_text()
            if server.poll() is None and not lost_port:
                break
            assert lost_port and attempt < 2, log_path.read_text()[-3000:]
        except BaseException:
            stop(server)
            raise
        stop(server)
    try:
        yield served, server
    finally:
        stop(server)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """One `prefect server` for the module, on a database of its own: the environment that reaches it."""
    home = tmp_path_factory.mktemp("prefect-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"),
        DO_NOT_TRACK="1",
        # The server streams logs to `--watch` only when asked to (the README's deployment section says so).
        PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED="true",
        PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED="true",
        COLUMNS="250",  # `--watch` prints through rich, which wraps lines at the terminal width
        # serve.py's runner looks for scheduled runs every 10 s by default: each `deployment run` (and each retry)
        # would wait up to that long to start. The runner still polls the real API, only more often.
        PREFECT_RUNNER_POLL_FREQUENCY="1",
    )
    with prefect_server_on(env, home / "server.log", 180) as (env, _):
        yield env
