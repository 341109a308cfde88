"""Atomic file writes, the one way sftflow writes a file that something else reads back.

A temporary file in the same folder, fsync, rename over the target, fsync the folder: readers see the old file or
the new one, never a partial one, and a crash leaves at most a hidden `.name.<pid>.<uuid>.tmp`. On any error the
temporary file is removed before the error propagates, so a full disk is not left fuller.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

# Errors that a retry cannot fix: the disk, quota or filesystem stays as it is.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG})


def temporary_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


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
