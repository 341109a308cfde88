"""The Prefect API behind sftflow's commands: the user's server, or one local server that commands share.

Every flow run talks to a Prefect API. With `PREFECT_API_URL` set (in the environment or the Prefect profile) that is
the user's server, and nothing here runs. Without it, Prefect alone would start a temporary server in every process
and give it 20 s: on a loaded 2-core machine the first start, which creates the SQLite database, takes longer, and two
first runs at once both try to create the same database. Instead, one local server per `PREFECT_HOME` serves every
sftflow command:

- a command first looks for the server an earlier command started (`PREFECT_HOME/sftflow-api/server.json`) and uses
  it when it answers `/health` (a few milliseconds instead of a server start);
- otherwise it starts one, holding `start.lock` so that concurrent first runs start it, and create the database,
  exactly once; it waits up to `SFTFLOW_API_START_TIMEOUT` seconds (default 600) and says in one line if that fails;
- while a command runs it holds a shared lock on `clients.lock`; the server exits by itself once no command has
  held it for `SFTFLOW_API_IDLE_TIMEOUT` seconds (default 900), or on `sftflow server --stop`.

The server is Prefect's own application (API, UI and services, as `prefect server start` runs them) on 127.0.0.1 and
a free port, logging to `PREFECT_HOME/sftflow-api/server.log`; its UI shows every run of the commands that used it.
The starting command binds the port itself and hands the listening socket to the server process, so no other server
can take the port between the choice and the start, and the first healthy answer on it is this server's.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sftflow.tasks.core.locks import process_alive

START_TIMEOUT_ENV = "SFTFLOW_API_START_TIMEOUT"
IDLE_TIMEOUT_ENV = "SFTFLOW_API_IDLE_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0
DEFAULT_IDLE_TIMEOUT_S = 900.0
# After this long without an answer, the command says what it is waiting for (once).
_PATIENCE_NOTICE_S = 10.0
# uvicorn's own default backlog
_BACKLOG = 2048


class LocalAPIError(RuntimeError):
    """The local Prefect API could not be started; the message is one line that says what to do."""


@dataclass(frozen=True)
class ServerRecord:
    url: str
    pid: int
    prefect_version: str


def state_dir(prefect_home: Path) -> Path:
    return prefect_home / "sftflow-api"


def seconds_from_env(name: str, default: float, error: type[Exception] = LocalAPIError) -> float:
    """A positive number of seconds from environment variable `name`, `default` where it is unset; `error` names a
    bad value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise error(f"{name}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise error(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def read_record(folder: Path) -> ServerRecord | None:
    try:
        raw = json.loads((folder / "server.json").read_text())
        return ServerRecord(url=raw["url"], pid=int(raw["pid"]), prefect_version=raw["prefect_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(folder: Path, record: ServerRecord) -> None:
    from sftflow.tasks.core.atomic import write_atomic

    write_atomic(folder / "server.json", json.dumps(record.__dict__, indent=2) + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _running(folder: Path, prefect_version: str) -> ServerRecord | None:
    """The recorded server if it is alive, answers, and runs this Prefect version (an older one is stopped: its
    database schema may be behind)."""
    record = read_record(folder)
    if record is None or not process_alive(record.pid):
        return None
    if record.prefect_version != prefect_version:
        stop_server(folder)
        return None
    return record if healthy(record.url) else None


def _start(folder: Path, prefect_version: str, timeout_s: float, notice) -> ServerRecord:
    log_path = folder / "server.log"
    idle_s = seconds_from_env(IDLE_TIMEOUT_ENV, DEFAULT_IDLE_TIMEOUT_S)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # Bound and listening before the server process exists: connections wait in the backlog until it serves them,
    # and nothing else can bind the port in between.
    with socket.socket() as listener, open(log_path, "ab") as log:
        listener.bind(("127.0.0.1", 0))
        listener.listen(_BACKLOG)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        command = [sys.executable, "-m", "sftflow.flows.local_api", str(listener.fileno()), str(idle_s)]
        # A session of its own: Ctrl-C in the terminal of the command that started it does not stop the server
        # that later commands share.
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            pass_fds=(listener.fileno(),),
        )
    started = time.monotonic()
    told = False
    while True:
        if healthy(url):
            record = ServerRecord(url=url, pid=process.pid, prefect_version=prefect_version)
            _write_record(folder, record)
            return record
        code = process.poll()
        waited = time.monotonic() - started
        if code is not None:
            raise LocalAPIError(
                f"the local Prefect API server exited with code {code} while starting ({_log_tail(log_path)}); "
                f"see {log_path}, or set PREFECT_API_URL to a running server (`prefect server start`)"
            )
        if waited > timeout_s:
            process.kill()
            raise LocalAPIError(
                f"the local Prefect API server did not answer within {timeout_s:g} s (see {log_path}); on a loaded "
                f"machine raise {START_TIMEOUT_ENV}, or set PREFECT_API_URL to a running server "
                "(`prefect server start`)"
            )
        if not told and waited > _PATIENCE_NOTICE_S:
            notice(
                f"waiting for the local Prefect API server to start (the first start creates its database; up to "
                f"{timeout_s:g} s, {START_TIMEOUT_ENV})"
            )
            told = True
        time.sleep(0.25)


def ensure_server(prefect_home: Path, prefect_version: str, notice=lambda message: None) -> tuple[ServerRecord, bool]:
    """The shared local server of `prefect_home`, started if none answers: (its record, whether this call started it).
    Only one process starts it; the others wait on `start.lock` and then find it running."""
    folder = state_dir(prefect_home)
    folder.mkdir(parents=True, exist_ok=True)
    record = _running(folder, prefect_version)
    if record is not None:
        return record, False
    timeout_s = seconds_from_env(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)
    with open(folder / "start.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = _running(folder, prefect_version)  # another command may have started it while we waited
        if record is not None:
            return record, False
        return _start(folder, prefect_version, timeout_s, notice), True


def stop_server(folder: Path) -> bool:
    """Stop the recorded server (SIGTERM, then SIGKILL after 20 s). Whether one was running."""
    record = read_record(folder)
    if record is None or not process_alive(record.pid):
        return False
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while process_alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if process_alive(record.pid):
        os.kill(record.pid, signal.SIGKILL)
    (folder / "server.json").unlink(missing_ok=True)
    return True


@contextmanager
def prefect_api(notice=lambda message: None):
    """Run the block against a Prefect API: `PREFECT_API_URL` when configured, else the shared local server (started
    when needed). The block holds a client lock, so the server does not idle out under it."""
    import prefect
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    folder = state_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "clients.lock", "a+") as clients:
        # Shared: any number of commands at once. Blocks only while a server that went idle is shutting down.
        fcntl.flock(clients, fcntl.LOCK_SH)
        record, started = ensure_server(home, prefect.__version__, notice)
        if started:
            notice(f"started a local Prefect API server: {record.url.removesuffix('/api')} (UI; stops when idle)")
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = record.url  # for subprocesses (process pools, Dask workers)
        try:
            with temporary_settings({PREFECT_API_URL: record.url}):
                yield record.url
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous


def _idle_watchdog(server, clients_lock: Path, idle_s: float) -> None:
    """Ask uvicorn to exit once no command has held `clients_lock` for `idle_s` seconds. The exclusive lock is kept
    from then on (until the process ends), so a command arriving during shutdown waits and then starts a new server."""
    idle_since = None
    with open(clients_lock, "a+") as lock:
        while not server.should_exit:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                idle_since = None
            else:
                now = time.monotonic()
                idle_since = idle_since or now
                if now - idle_since >= idle_s:
                    server.should_exit = True
                    return
                fcntl.flock(lock, fcntl.LOCK_UN)
            time.sleep(min(5.0, idle_s / 4))


def serve(fd: int, idle_s: float) -> None:
    """The server process: Prefect's app under uvicorn on the listening socket inherited as `fd`, until idle or
    SIGTERM."""
    import uvicorn
    from prefect.settings import PREFECT_HOME

    listener = socket.socket(fileno=fd)
    host, port = listener.getsockname()[:2]
    config = uvicorn.Config(
        "prefect.server.api.server:create_app",
        factory=True,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    clients_lock = state_dir(Path(PREFECT_HOME.value()).expanduser()) / "clients.lock"
    threading.Thread(target=_idle_watchdog, args=(server, clients_lock, idle_s), daemon=True).start()
    server.run(sockets=[listener])


if __name__ == "__main__":
    serve(int(sys.argv[1]), float(sys.argv[2]))
