"""The README's first commands on a fresh machine: no PREFECT_API_URL and an empty PREFECT_HOME (no database yet).

The server's start is made deliberately slower than Prefect's own 20 s budget by a `sitecustomize` module that
sleeps in the server process only, so these tests fail if a command still relies on that budget.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftflow.flows.local_api import read_record, state_dir, stop_server
from sftflow.tasks.demo import write_demo

pytestmark = pytest.mark.slow

SLOW_START_S = 21  # Prefect's ephemeral server gets 20 s


def _sitecustomize(sleep_s: float) -> str:
    return f"""
import sys, time
if "sftflow.flows.local_api" in sys.orig_argv:
    time.sleep({sleep_s})
"""


SITECUSTOMIZE = _sitecustomize(SLOW_START_S)


def _env(home: Path, hooks: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=os.pathsep.join([str(hooks), env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def _sftflow(*args: str, env: dict[str, str], wait: bool = True):
    exe = Path(sys.executable).with_name("sftflow")
    process = subprocess.Popen([str(exe), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process.communicate(timeout=600) + (process.returncode,) if wait else process


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh-machine")
    hooks = root / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    demo = write_demo(root / "demo", n=3)
    home = root / "prefect-home"
    yield dict(root=root, hooks=hooks, demo=demo, home=home)
    stop_server(state_dir(home))


def _data_args(fresh, out: str) -> list[str]:
    demo = fresh["demo"]
    source, tokenizer = str(demo["data"]), str(demo["tokenizer"])
    return ["data", "--source", source, "--tokenizer", tokenizer, "--out", str(fresh["root"] / out)]


def _starting_server(home: Path, timeout_s: float = 60.0):
    """The local API server process of PREFECT_HOME `home`, once it runs."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["cmdline"]):
            try:
                if "sftflow.flows.local_api" in (process.info["cmdline"] or []) and process.environ().get(
                    "PREFECT_HOME"
                ) == str(home):
                    return process
            except psutil.Error:
                continue
        time.sleep(0.1)
    pytest.fail(f"no local API server process for {home} within {timeout_s:g} s")


def _listening_ports(process) -> set[int]:
    import psutil

    connections = getattr(process, "net_connections", None) or process.connections
    return {c.laddr.port for c in connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_concurrent_first_runs_survive_a_slow_server_start(fresh):
    env = _env(fresh["home"], fresh["hooks"], SFTFLOW_API_IDLE_TIMEOUT="20")
    first = _sftflow(*_data_args(fresh, "a"), env=env, wait=False)
    second = _sftflow(*_data_args(fresh, "b"), env=env, wait=False)
    # While the server still sleeps in its start-up hook it already holds its port, so no other server can take it
    # before the start and be taken for this one.
    server = _starting_server(fresh["home"])
    ports = _listening_ports(server)
    assert len(ports) == 1, ports
    (port,) = ports
    with socket.socket() as impostor, pytest.raises(OSError) as taken:
        impostor.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    outputs = [p.communicate(timeout=600) + (p.returncode,) for p in (first, second)]
    for stdout, stderr, code in outputs:
        assert code == 0, stderr[-3000:]
        assert '"docs_train"' in stdout
    # One of the two started the shared server (and created the database); the other waited for it.
    starts = [stderr.count("started a local Prefect API server") for _, stderr, _ in outputs]
    assert sorted(starts) == [0, 1], starts
    record = read_record(state_dir(fresh["home"]))
    assert record is not None
    assert (record.pid, record.url) == (server.pid, f"http://127.0.0.1:{port}/api")


def test_later_commands_reuse_the_running_server(fresh):
    env = _env(fresh["home"], fresh["hooks"], SFTFLOW_API_IDLE_TIMEOUT="20")
    before = read_record(state_dir(fresh["home"]))
    started = time.monotonic()
    stdout, stderr, code = _sftflow(*_data_args(fresh, "c"), env=env)
    elapsed = time.monotonic() - started
    assert code == 0, stderr[-3000:]
    assert "started a local Prefect API server" not in stderr
    assert read_record(state_dir(fresh["home"])) == before
    # No server start inside this command: it cannot have waited out the slow start again.
    assert elapsed < SLOW_START_S + 60


def test_the_server_exits_once_no_command_holds_it(fresh):
    record = read_record(state_dir(fresh["home"]))
    assert record is not None
    os.kill(record.pid, 0)
    # The commands above set a 20 s idle timeout; the watchdog looks every 5 s.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            os.kill(record.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(1)
    pytest.fail(f"the local API server (pid {record.pid}) still runs 120 s after the last command")


def test_a_start_over_budget_is_one_line_that_says_what_to_do(fresh, tmp_path):
    env = _env(tmp_path / "home", fresh["hooks"], SFTFLOW_API_START_TIMEOUT="3")
    stdout, stderr, code = _sftflow(*_data_args(fresh, "d"), env=env)
    assert code == 2, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "did not answer within 3 s" in errors[0] and "SFTFLOW_API_START_TIMEOUT" in errors[0]
