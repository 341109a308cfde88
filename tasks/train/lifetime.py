"""A training run's processes live no longer than the launcher that started them.

torchrun runs in a session of its own (so the launcher can stop the whole group on a timeout or a cancel), which
also means that a launcher killed outright (SIGKILL, the OOM killer) used to leave torchrun and its workers running:
a `--resume` started next would then train beside them, and both wrote the same metrics and checkpoints. Two
guards, one for each end:

- On Linux each process asks the kernel to SIGKILL it when its parent dies (`PR_SET_PDEATHSIG`): torchrun (started
  through `sftflow.tasks.train.torchrun`) dies with the launcher, each worker with torchrun. A stopped process is
  killed as well.
- On every platform each worker holds a shared `flock` on the run's writers file for its whole life, and a launcher
  takes it exclusively (and lets go) before starting torchrun: while any worker of an earlier launch lives, even a
  stopped one, the new launch is refused with its PID (`sftflow.tasks.core.locks.check_no_writers`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_PID_VAR = "SFTFLOW_LAUNCHER_PID"  # set by the launcher for torchrun
TORCHRUN_PID_VAR = "SFTFLOW_TORCHRUN_PID"  # set by torchrun's entry point for the workers
WRITERS_VAR = "SFTFLOW_RUN_WRITERS"  # the writers file the workers hold


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask for SIGKILL when the parent process dies (Linux; elsewhere a no-op that returns False). If the parent is
    already gone, exit at once: no signal would ever come. Gone means not `expected_parent` where the parent said who
    it is (a launcher that is a container's first process has PID 1), else adopted by init."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    parent = os.getppid()
    if parent != expected_parent if expected_parent is not None else parent == 1:
        os._exit(1)
    return True
