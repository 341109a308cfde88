"""A flow run's process started by a Prefect runner (`deployments/serve.py`, a process work pool's worker) ends when
its Prefect API goes away, so it never holds a work folder's lock for nobody.

The runner starts each flow run as a child, `python -m prefect.engine`, and stops it on a cancel (SIGTERM, which
Prefect's engine turns into a Cancelled run, and the training launcher into a killed torchrun group). When the API
goes away instead (the server stopped or killed, or a runner's temporary server that died with it), the child
trained on: every state, log and artifact call retries for minutes, and a SIGTERM meanwhile waits behind them. The
API watch (`sftflow.flows.api_watch`) ends it within seconds, with one line naming the API. (A runner killed
outright already takes its flow run process with it, training included: the child's output goes to the runner
through a pipe that closes with it.)

On a cancel the runner, not the child, records the flow run's Cancelled state (after the child has exited), so
Prefect's engine ends its log with the state it last knew, `Finished in state Running()`, below its own "Flow run was
cancelled." That line is dropped here: a finished run is never Running.

The watch and the filter are set up once per process, by the first flow that takes a work folder's lock
(`work_dir_lock`), and only in a runner's child: a flow called from your own Python code is left alone, and
`sftflow run` watches its API itself.
"""

from __future__ import annotations

import logging
import os
import threading

FLOW_RUN_ID_VAR = "PREFECT__FLOW_RUN_ID"  # set by Prefect's runner for the flow run process it starts

_armed = threading.Event()


def started_by_runner() -> bool:
    return bool(os.environ.get(FLOW_RUN_ID_VAR))


class _NoFinishedRunning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Finished in state Running(")


def guard_runner_child() -> None:
    """In a runner's flow run process: end the process if its API goes away, and keep a cancelled run's log from
    ending `Finished in state Running()`. Once per process; elsewhere nothing."""
    if not started_by_runner() or _armed.is_set():
        return
    _armed.set()
    logging.getLogger("prefect.flow_runs").addFilter(_NoFinishedRunning())
    from prefect.settings import PREFECT_API_URL

    from sftflow.flows.api_watch import APIWatch, exit_lost, lost_timeout_s

    url = PREFECT_API_URL.value()
    if url:
        APIWatch(url, lost_timeout_s(), lambda reason: exit_lost(url, reason)).start()
