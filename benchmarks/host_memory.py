"""What the host-memory benchmarks (`export_memory.py`, `checkpoint_memory.py`) share: reading a process's resident
memory and its peak, and running each mode in a process of its own (so one mode's freed memory never lowers the
next one's numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
    return _status("VmRSS")


def peak_bytes() -> int:
    """The peak resident memory since the process started or since `reset_peak`."""
    return _status("VmHWM")


def reset_peak() -> int:
    """Reset the peak resident memory to the current one (Linux), and return that."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident_bytes()


def run_modes(script: str, modes: list[str], args: list[str]) -> list[dict]:
    """Run `script --mode M --out TMP *args` for each mode, each in its own process; a row is the JSON object its
    last output line holds, or the mode and the last line of its error."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            cmd = [sys.executable, script, "--mode", mode, "--out", tmp, *args]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                rows.append(dict(mode=mode, error=proc.stderr.strip().splitlines()[-1:]))
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def print_rows(rows: list[dict], headers: list[str], cells) -> dict[str, dict]:
    """Print `run_modes` rows as a markdown table (`cells(row)` gives the cells after the mode; a failed mode gets
    its error), and return the rows that ran, by mode."""
    print("| mode | " + " | ".join(headers) + " |")
    print("|---" * (len(headers) + 1) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error']} |" + " |" * (len(headers) - 1))
            continue
        print(f"| {r['mode']} | " + " | ".join(cells(r)) + " |")
    return {r["mode"]: r for r in rows if "error" not in r}
