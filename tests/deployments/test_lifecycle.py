"""How a training flow run's processes end when what they depend on goes away, against a real `prefect server`.

- serve.py killed outright, or the Prefect API lost under a served flow run: its flow run process (`python -m
  prefect.engine`) must not train on, holding the work folder's lock for nobody;
- the Prefect API lost under `sftflow run`: one line naming the API and an exit within seconds, never an engine that
  retries for minutes and ends `Finished in state Running()`.

An API a test loses is a second `prefect server` on the module server's database, so the module's own server stays.

Each test trains a one-layer model on a plan long enough (hundreds of epochs) that it is still training when the
test pulls the plug.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.deployments.conftest import prefect_server_on, stop, wait_for
from tests.deployments.test_serve import REPO, TINY, _workers_under, lock_free

pytestmark = pytest.mark.slow


def _long_training_config(root: Path) -> Path:
    config = root / "long.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "work_dir": str(root / "work"),
                "train_retries": 0,
                "demo": {"records": 40},
                "plan": {"tokens_per_rank": 512, "epochs": 400},
                "train": {"model_overrides": TINY, "optimizer": {"lr": 1e-3}, "checkpoint": {"every": 50}},
                "eval": {"max_docs": 4, "max_generations": 1, "num_examples": 1},
            }
        )
    )
    return config


def _training(work: Path) -> bool:
    """Whether a training run of `work` has written a step."""
    return any(path.stat().st_size > 0 for path in work.glob("train/*/metrics.jsonl"))


def _children(pid: int, name: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and name in cmdline:
            found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _api(env: dict, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.load(r)


@contextmanager
def _second_server(env: dict, folder: Path) -> Iterator[tuple[dict, subprocess.Popen]]:
    """Another `prefect server` on the database of `env`'s: (the environment that reaches it, its process). The
    commands that reach it give up on it after 3 s without an answer instead of the default 10 s: the tests kill it,
    and a killed server refuses connections at once (a slow one still counts as reachable)."""
    env = dict(env, SFTFLOW_API_LOST_TIMEOUT="3")
    with prefect_server_on(env, folder / "server.log", 120) as (env, server):
        yield env, server


def _kill(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=10)


@contextmanager
def _served_run(env: dict, folder: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """serve.py on the long config, and one `sft/full` run of it, training: (serve.py, its flow run process)."""
    config = _long_training_config(folder)
    log_path = folder / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen(
            [sys.executable, str(REPO / "deployments" / "serve.py")],
            env=dict(env, SFTFLOW_CONFIG=str(config)),
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        engine = None
        try:

            def served():  # by this serve.py: an earlier test's serve.py registered the name with its own config
                assert serve.poll() is None, log_path.read_text()[-3000:]
                try:
                    return _api(env, "/deployments/name/sft/full")["parameters"].get("config_path") == str(config)
                except OSError:
                    return False

            wait_for(served, 120, "sft/full to be served")
            run = ["prefect", "deployment", "run", "sft/full"]
            started = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
            assert started.returncode == 0, started.stdout + started.stderr
            wait_for(lambda: _training(folder / "work"), 300, "training to start\n" + log_path.read_text()[-3000:])
            (engine,) = _children(serve.pid, "prefect.engine")
            assert not lock_free(folder / "work")
            yield serve, engine
        finally:
            stop(serve)
            if engine is not None and _alive(engine):
                os.kill(engine, signal.SIGKILL)


def test_a_killed_serve_takes_its_flow_run_and_training_with_it(prefect_server, tmp_path):
    with _served_run(prefect_server, tmp_path) as (serve, engine):
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait(timeout=10)
        log = tmp_path / "serve.log"
        wait_for(lambda: not _alive(engine), 45, "the flow run process to end\n" + log.read_text()[-3000:])
        _lock_released(tmp_path / "work")
        wait_for(lambda: not _workers_under(tmp_path / "work"), 15, "the training workers to exit")


def test_a_served_run_that_lost_its_api_ends_and_lets_go_of_the_work_folder(prefect_server, tmp_path):
    with _second_server(prefect_server, tmp_path) as (env, server), _served_run(env, tmp_path) as (serve, engine):
        _kill(server)
        log = tmp_path / "serve.log"
        wait_for(lambda: not _alive(engine), 45, "the flow run process to end\n" + log.read_text()[-3000:])
        assert f"error: lost the Prefect API at {env['PREFECT_API_URL']}: " in log.read_text(), log.read_text()[-3000:]
        _lock_released(tmp_path / "work")
        wait_for(lambda: not _workers_under(tmp_path / "work"), 15, "the training workers to exit")
        # serve.py itself is not under test: stopped gracefully, it would spend `stop`'s 20 s grace period retrying
        # the lost API to pause its deployments.
        _kill(serve)


def test_a_lost_api_ends_sftflow_run_with_one_line_naming_it(prefect_server, tmp_path):
    config = _long_training_config(tmp_path)
    work = tmp_path / "work"
    with _second_server(prefect_server, tmp_path) as (env, server):
        url = env["PREFECT_API_URL"]
        with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
            run = subprocess.Popen(
                [str(Path(sys.executable).with_name("sftflow")), "run", str(config)],
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        try:
            wait_for(lambda: _training(work) or run.poll() is not None, 120, "training to start")
            assert run.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            _kill(server)
            code = run.wait(timeout=45)
        finally:
            stop(run)
    stdout, stderr = (tmp_path / "run.out").read_text(), (tmp_path / "run.err").read_text()
    assert code == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: lost the Prefect API at {url}: "), stderr[-3000:]
    assert "Finished in state Running()" not in stdout + stderr
    _lock_released(work)
    wait_for(lambda: not _workers_under(work), 15, "the training workers to exit")


def _lock_released(work: Path) -> None:
    # A process whose main thread has ended (a zombie in /proc) may still be tearing down its other threads, which
    # share its open files: the lock goes with the last of them.
    lock = work / ".sftflow.lock"
    wait_for(lambda: lock_free(work), 15, f"the work folder's lock to be released (open in {_holders(lock)})")


def _holders(path: Path) -> list[str]:
    """The processes with `path` open: PID, state and command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if any(str(path) in os.readlink(fd) for fd in (proc / "fd").iterdir()):
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                found.append(f"{proc.name} {stat[0]} ppid {stat[1]} {(proc / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found
