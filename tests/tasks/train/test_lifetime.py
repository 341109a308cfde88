"""A training process checks that its parent still lives before trusting the kernel's parent-death signal; a parent
that is PID 1 (a launcher that is a container's first process) is alive."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CHILD = "from sftflow.tasks.train.lifetime import die_with_parent; die_with_parent({expected}); print('alive')"


def _run_child(expected: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(expected=expected)], capture_output=True, text=True)


def test_a_child_of_the_expected_parent_lives_and_one_of_another_exits():
    import os

    assert _run_child(str(os.getpid())).stdout.strip() == "alive"
    gone = _run_child("1")  # its parent is this test, not 1: the parent it was started for is gone
    assert gone.returncode == 1 and "alive" not in gone.stdout


def test_a_launcher_that_is_pid_1_keeps_its_children():
    """In a PID namespace of its own the launcher is PID 1, as a container's first process is; its child must stay."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare")
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys
        assert os.getpid() == 1, os.getpid()
        child = subprocess.run([sys.executable, "-c", {CHILD.format(expected=1)!r}], capture_output=True, text=True)
        print(child.returncode, child.stdout.strip())
        """
    )
    probe = subprocess.run([unshare, "-Urpf", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user and PID namespaces not allowed here: {probe.stderr.decode().strip()}")
    result = subprocess.run([unshare, "-Urpf", sys.executable, "-c", launcher], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "alive"]
