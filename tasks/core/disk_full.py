"""A full disk (or quota), told as one line: which file, while doing what, and what a rerun after freeing space does.

    error: RUN/checkpoints/step-6: no space left on device while writing checkpoint step-6; free space and rerun:
    it resumes from step-3

A full disk is not bad input, nor a crash that a retry fixes: the retry meets the same disk. Whoever knows more
adds it: `atomic_writer` names the file (a bare `write` error names none), a checkpoint save names its step, the
training launcher the checkpoint a rerun resumes from, the command line the advice for what it ran. What the
writers wrote stays safe: every file is written aside and renamed into place, so a full disk leaves the last
complete one.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from sftflow.tasks.core.atomic import DISK_FULL_ERRNOS


class DiskFull(OSError):
    """A write that failed for want of space: `path` (the file or folder being written), `doing` (`while writing
    checkpoint step-6`), and `rerun` (what a rerun does once there is space), each added by whoever knows it."""

    def __init__(self, path: str | Path, doing: str | None = None, rerun: str | None = None):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.path, self.doing, self.rerun = str(path), doing, rerun

    def __reduce__(self):  # OSError's would call __init__ with (errno, strerror, filename)
        return DiskFull, (self.path, self.doing, self.rerun)

    def __str__(self) -> str:
        line = f"{self.path}: no space left on device"
        if self.doing:
            line += f" {self.doing}"
        return line + (f"; free space and rerun: {self.rerun}" if self.rerun else "; free space and rerun")

    def adding(self, *, doing: str | None = None, rerun: str | None = None) -> DiskFull:
        """This error with `doing` and `rerun` filled in where they are not known yet."""
        return DiskFull(self.path, self.doing or doing, self.rerun or rerun)


def disk_full_error(err: BaseException | None) -> OSError | None:
    """The full-disk error behind `err`: `err` itself, one in its chain of causes, or (a DCP save that failed on
    some rank) one among a `CheckpointException`'s failures. None when the disk is not what failed."""
    seen = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def as_disk_full(err: BaseException, path: str | Path, doing: str | None = None) -> DiskFull | None:
    """`err` as a `DiskFull` (naming its own file when it has one, else `path`), or None when it is no full disk."""
    full = disk_full_error(err)
    if full is None:
        return None
    if isinstance(full, DiskFull):
        return full.adding(doing=doing)
    return DiskFull(full.filename or path, doing)


# How a training worker tells its launcher (`sftflow.tasks.train.launch`), on a line of its output, every line of
# which the launcher reads: a file written to say so could fail for the same want of space.
REPORT_PREFIX = "[sftflow] disk full: "


def report_line(err: DiskFull) -> str:
    return REPORT_PREFIX + json.dumps({"path": err.path, "doing": err.doing})


def from_report_line(line: str) -> DiskFull | None:
    """The `DiskFull` a worker's `report_line` reported, or None for any other line."""
    if REPORT_PREFIX not in line:
        return None
    try:
        report = json.loads(line.split(REPORT_PREFIX, 1)[1])
        return DiskFull(report["path"], report.get("doing"))
    except (ValueError, KeyError, TypeError):
        return None
