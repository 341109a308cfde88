"""A command whose Prefect API went away ends at once, with one line, instead of hanging.

Prefect's client retries a lost API for minutes at each call (a task's state, a log, an artifact), and its engine
then ends with the state it last had (`Finished in state Running()`), while background threads keep the process
alive. A command (`sftflow run`, `data`, `plan`, `promote`) cannot record anything without its API, so the watch
below probes it every second while the command's flows run; once no probe has reached it for
`SFTFLOW_API_LOST_TIMEOUT` seconds (default 10) it stops the training processes this process started (their
checkpoints stay: a rerun resumes from the latest), prints as the command's last line

    error: lost the Prefect API at http://127.0.0.1:4321/api: <why>; ...

and exits with code 1, which releases the work folder's lock. Any HTTP answer counts as reachable, and so does a server
that takes the connection but is slow to answer: a busy server is not a lost one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sftflow.flows.local_api import seconds_from_env

LOST_TIMEOUT_ENV = "SFTFLOW_API_LOST_TIMEOUT"
DEFAULT_LOST_TIMEOUT_S = 10.0
_PROBE_EVERY_S = 1.0
_PROBE_TIMEOUT_S = 5.0


def lost_timeout_s() -> float:
    return seconds_from_env(LOST_TIMEOUT_ENV, DEFAULT_LOST_TIMEOUT_S, error=ValueError)


def probe(url: str) -> str | None:
    """Why the API at `url` cannot be reached, or None when it answers (with any HTTP status)."""
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=_PROBE_TIMEOUT_S)
    except (httpx.ReadTimeout, httpx.WriteTimeout):
        return None  # it took the connection and is slow to answer: busy (a loaded machine), not gone
    except httpx.TransportError as err:
        return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return None


class APIWatch:
    """Probes `url` from a daemon thread; calls `on_lost(reason)` once, after `timeout_s` without an answer."""

    def __init__(self, url: str, timeout_s: float, on_lost: Callable[[str], None]):
        self.url, self.timeout_s, self.on_lost = url, timeout_s, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sftflow-api-watch", daemon=True)

    def start(self) -> APIWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_PROBE_TIMEOUT_S + 1)

    def _run(self) -> None:
        last_answer = time.monotonic()
        while not self._stop.wait(_PROBE_EVERY_S):
            reason = probe(self.url)
            if reason is None:
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer >= self.timeout_s and not self._stop.is_set():
                self.on_lost(reason)
                return


def exit_lost(url: str, reason: str) -> None:
    """Stop this process's training, say which API was lost and why, and exit 1 without waiting on the API."""
    launch = sys.modules.get("sftflow.tasks.train.launch")
    if launch is not None:  # training ran in this process: stop it before its launcher goes
        launch.stop_running_training()
    # The line comes last: stopping the training makes other threads log (its last output lines, the train task's
    # failure), so their logging is switched off first and nothing can print after it.
    logging.disable(logging.CRITICAL)
    sys.stderr.write(
        f"error: lost the Prefect API at {url}: {reason}; nothing more of this run can be recorded, so it stopped "
        "(a rerun resumes training from its latest checkpoint)\n"
    )
    sys.stderr.flush()
    # Not `sys.exit`: the engine's `finally` blocks and Prefect's exit hooks would call the API and retry for minutes.
    os._exit(1)


@contextmanager
def api_watched(url: str) -> Iterator[None]:
    """Within the block, a lost API at `url` ends the process (`exit_lost`)."""
    watch = APIWatch(url, lost_timeout_s(), lambda reason: exit_lost(url, reason)).start()
    try:
        yield
    finally:
        watch.stop()
