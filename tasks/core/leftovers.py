"""Removing things on disk: what killed writers left behind, and anything else, without following a symlink.

A writer killed mid-write (SIGKILL, a lost node) leaves its temporary file (`.name~<host>~<pid>~<uuid>.tmp`,
`sftflow.tasks.core.atomic`), which nothing else would ever remove: a 7 MB `.rendered.jsonl…tmp` stays forever.
The next run of the stage that owns the folder removes the ones whose writer is gone: written on this host by a
PID that no longer runs. A temporary file of another host, or of a live process (a concurrent writer), is left.
The top of a work folder (a killed write of `data.json` or `plan.json`) is swept by the next flow that takes it.

Every removal goes through `remove`, which deletes a symbolic link itself, never what it points to: a `step-N` or
a temporary name that is a link to a folder elsewhere loses the link, and the folder stays.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from sftflow.tasks.core.atomic import temporary_writer
from sftflow.tasks.core.locks import process_alive


def remove(path: Path) -> None:
    """Delete `path`: a file or a link (to anything) is unlinked, a real folder removed with what it holds (links
    inside are unlinked, not followed). Nothing there is no error."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path)  # does not follow links below the top (it refuses a link at the top: handled above)


def is_stale(path: Path) -> bool:
    """Whether `path` is a temporary name of a writer that ran on this host and is gone."""
    writer = temporary_writer(path)
    return writer is not None and writer[0] == socket.gethostname() and not process_alive(writer[1])


def remove_stale_temporaries(folder: Path, *, top_only: bool = False) -> list[Path]:
    """Remove the stale temporary files and folders (`is_stale`) under `folder`, at any depth, without descending
    into linked folders; with `top_only`, only those directly in `folder` (a work folder, whose stage folders are
    each swept by their own stage). Returns what was removed."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return removed
    if top_only:
        for path in sorted(folder.iterdir()):
            if is_stale(path):
                remove(path)
                removed.append(path)
        return removed
    for root, dirs, files in os.walk(folder):  # followlinks=False: a linked folder is listed, never entered
        for name in [*files, *dirs]:
            path = Path(root) / name
            if is_stale(path):
                remove(path)
                removed.append(path)
        dirs[:] = [d for d in dirs if (Path(root) / d) not in removed]
    return removed
