"""One writer per work folder and per training run: an exclusive lock held for as long as the work runs.

Two `sftflow run` on one `work_dir` would otherwise resume each other's live checkpoints and interleave their
metrics. The lock is `flock` on a file in the folder, so the operating system releases it when its holder dies: a
lock left by a killed process is taken over by the next run, with nothing to clean up. The file records who holds
it (PID, host, since when, command), which is what a refused run is told. Nested holds of the same lock in one
process (the `sft` flow and the stage flows it calls) are counted, not re-locked.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HELD: dict[str, int] = {}
_GUARD = threading.Lock()


def holder(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


@contextmanager
def exclusive(path: str | Path, what: str) -> Iterator[None]:
    """Hold the lock file `path` for the block, or raise `ValueError` naming the process that holds it."""
    path = Path(path).resolve()
    key = str(path)
    with _GUARD:
        if _HELD.get(key):
            _HELD[key] += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = holder(path)
            who = f"PID {info.get('pid', '?')} on {info.get('host', '?')}"
            since = info.get("since")
            when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
            raise ValueError(
                f"{what} is in use by {who}{when} ({info.get('command', 'unknown command')}); wait for it to finish "
                f"or stop it (the lock, {path}, is released when that process exits)"
            ) from None
        f.seek(0)
        f.truncate()
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": " ".join(sys.argv)}
        f.write(json.dumps(record) + "\n")
        f.flush()
        with _GUARD:
            _HELD[key] = 1
        try:
            yield
        finally:
            with _GUARD:
                _HELD.pop(key, None)
    finally:
        f.close()  # closing the descriptor releases the flock


def check_no_writers(path: str | Path, what: str, wait_s: float = 5.0) -> None:
    """Raise `ValueError` while any process holds a shared lock on `path` (`hold_as_writer`: a training worker of an
    earlier launch, alive or stopped, that could still write the run); else start the file afresh. Waits up to
    `wait_s` first: workers killed with their launcher take a moment to exit, and hold the lock until they have."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + wait_s
        while not _try_exclusive(f):
            if time.monotonic() > deadline:
                f.seek(0)
                pids = sorted({int(line) for line in f.read().split() if line.isdigit()})
                alive = ", ".join(str(pid) for pid in pids if process_alive(pid)) or "?"
                raise ValueError(
                    f"{what}: training worker(s) of an earlier launch still run (PID {alive}) and could write its "
                    "checkpoints and metrics; stop them (kill -9 PID) and run again"
                )
            time.sleep(0.1)
        f.seek(0)
        f.truncate()
        # closing releases the probe's lock


def _try_exclusive(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


_writer_files: list = []  # open for the life of the process: closing one would release its lock


def hold_as_writer(path: str | Path) -> None:
    """Hold a shared lock on `path` until this process exits, and add its PID to the file."""
    f = open(path, "a")  # noqa: SIM115 - held until exit
    fcntl.flock(f, fcntl.LOCK_SH)
    f.write(f"{os.getpid()}\n")
    f.flush()
    _writer_files.append(f)


def process_alive(pid: int) -> bool:
    """Whether a process with this PID exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
