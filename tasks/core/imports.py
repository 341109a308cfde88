"""Keep a checkout's source folders from standing in for real top-level packages.

The folders `flows/`, `tasks/` and `kernels/` are installed only as `sftflow.flows`, `sftflow.tasks` and
`sftflow.kernels`. With the checkout's root on `sys.path` (anything started with `python -m` or `python -c` from it,
such as the torchrun workers, or Prefect loading `flows/sft.py` by path from a deployment's working directory) they
would also import as top-level `flows`, `tasks` and `kernels`. `kernels` is a real PyPI package that transformers
depends on and imports when it loads a model; finding this folder instead fails every model load with "cannot import
name ... from 'kernels'". A finder placed first on `sys.meta_path` looks those three names up on `sys.path` without
any sftflow checkout's root (this one's, or another clone's that a command was started from), so the installed
package wins; where none is installed, the normal lookup goes on unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

# tasks/core/imports.py -> the folder that holds `tasks/` (a checkout's root, or site-packages/sftflow in a wheel)
SOURCE_ROOT = Path(__file__).resolve().parents[2]
_NAMES = frozenset({"flows", "tasks", "kernels"})
_CHECKOUT_MARKERS = ("tasks/core/imports.py", "kernels/__init__.py", "flows/__init__.py")


def _is_source_root(entry: str) -> bool:
    """Whether `entry` is this checkout's root or another sftflow checkout's (a second clone started from while this
    one is installed): either would shadow the installed packages the same way."""
    try:
        root = Path(entry or os.getcwd()).resolve()
        return root == SOURCE_ROOT or all((root / marker).is_file() for marker in _CHECKOUT_MARKERS)
    except OSError:  # a deleted working directory or an unreadable entry: not ours
        return False


class _InstalledFirst(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in _NAMES:
            return None
        search = [entry for entry in sys.path if not _is_source_root(entry)]
        if len(search) == len(sys.path):
            return None  # the checkout is not on sys.path: nothing to step around
        return importlib.machinery.PathFinder.find_spec(name, search, target)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once per process)."""
    if not any(isinstance(finder, _InstalledFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstalledFirst())
