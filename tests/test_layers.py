"""The package's layers, as import-linter checks them (the contracts are in pyproject.toml): flows over tasks over
kernels, the stage packages in pipeline order over core, no import cycle among the modules of any package, no
Prefect in the kernels, and in tasks Prefect only in the stage tasks and their glue."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "5 kept, 0 broken" in result.stdout, result.stdout[-2000:]
