"""Atomic file writes, the one way sftflow writes a file that something else reads back.

A temporary file in the same folder, fsync, rename over the target, fsync the folder: readers see the old file or
the new one, never a partial one, and a crash leaves at most a hidden `.name~<host>~<pid>~<uuid>.tmp`, which the
next run of the stage that owns the folder removes once that process is gone (`sftflow.tasks.core.leftovers`). On
any error the temporary file is removed before the error propagates, so a full disk is not left fuller; a full disk
is raised naming the file that was being written (a bare `write` error names none).
"""

from __future__ import annotations

import errno
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

# Errors that a retry cannot fix: the disk, quota or filesystem stays as it is.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG})


# Errors of a full disk or quota: the user frees space and reruns.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def temporary_name(path: Path) -> Path:
    """A hidden name beside `path` tagged with this host and process, so that a later run can tell a killed
    writer's leftover (its process gone) from a live writer's file."""
    return path.parent / f".{path.name}~{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex}.tmp"


def temporary_writer(path: Path) -> tuple[str, int] | None:
    """(host, PID) of the process that made the temporary name `path` (`temporary_name`), or None for another name."""
    if not is_temporary(path):
        return None
    parts = path.name.removesuffix(".tmp").rsplit("~", 3)
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def is_temporary(path: Path) -> bool:
    """A name `atomic_writer` uses for its temporary files (never part of a finished output)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is atomic regardless
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """`with atomic_writer(path) as f: f.write(...)`: `path` appears complete when the block ends without error."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer: mode {mode!r}; expected 'wb' or 'w'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    exclusive = "xb" if mode == "wb" else "x"  # never clobber; default permissions (mkstemp would make it 0600)
    try:
        with open(tmp, exclusive, encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in DISK_FULL_ERRNOS and err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically."""
    if isinstance(data, str):
        with atomic_writer(path, "w", encoding="utf-8") as f:
            f.write(data)
    else:
        with atomic_writer(path) as f:
            f.write(data)
    return Path(path)
