"""What the benchmark scripts share: the common options, timing, the environment a figure was measured in, and
results as JSON lines, and the host-memory benchmarks' process-per-mode runs.

A script runs from `benchmarks/` (its folder is on `sys.path`), so it imports this module as `harness`. A result row
is one figure, with the fields of the records in `benchmarks/results/*.jsonl` (`results_table.py` reads them):

    {"date", "gpu", "machine", "versions", "commit", "benchmark", "command", "workload", "mode", "metric", "value",
     "unit", "peer", "peer_value", "ratio", "ratio_basis", "run", "source", "note"}

`gpu` is the CUDA device's name (None on a CPU run), `machine` the host's CPU and core count, `versions` the packages
the figure depends on, `commit` the checkout's git commit (None outside a git checkout), `command` the command line
that measured it; `peer`, `peer_value`, `ratio` and `ratio_basis` say what a side-by-side figure was against.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# distribution name -> the key it has in `versions()`
PACKAGES = {"transformers": "transformers", "triton": "triton", "liger-kernel": "liger_kernel"}


# ---------------------------------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------------------------------


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    steps: int | None = None,
    warmup: int | None = None,
    out: str | None = None,
    out_type=None,
    jsonl: bool = True,
) -> argparse.ArgumentParser:
    """The options most scripts take, each only where its default is given: `--steps` (timed steps), `--warmup`
    (steps left out of the timing), `--out` (`out` is its help: what the script writes there) and `--jsonl` (a file
    to append one JSON line a figure to, `write_rows`)."""
    if steps is not None:
        parser.add_argument("--steps", type=int, default=steps, help="timed steps")
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help="steps before the timed ones, not timed")
    if out is not None:
        kwargs = {"type": out_type} if out_type is not None else {}
        parser.add_argument("--out", default=None, help=out, **kwargs)
    if jsonl:
        parser.add_argument("--jsonl", default=None, help="append the figures to this file, one JSON line each")
    return parser


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------


def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Seconds between `start()` and `stop()`: CUDA events on a GPU (the device's time for the work queued between
    them), the host clock after a synchronisation otherwise."""

    def __init__(self, device="cpu"):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> Timer:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


def time_calls(fn, repeats: int, warmup: int = 0, device="cpu") -> list[float]:
    """Seconds of each of `repeats` calls of `fn()` after `warmup` untimed ones (`Timer`)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        timer = Timer(device).start()
        fn()
        times.append(timer.stop())
    return times


def matmul_tflops(device="cuda", n: int = 8192) -> float | None:
    """The device's bf16 matmul rate (TFLOP/s) on `n` x `n` operands: the median of 20 products timed with CUDA
    events after 3 untimed; None on a CPU. What an MFU is measured against."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = time_calls(lambda: a @ b, repeats=20, warmup=3, device=device)
    return 2 * n**3 / statistics.median(times) / 1e12


def do_bench_matmul_tflops(n: int = 8192) -> float:
    """The GPU's bf16 matmul rate (TFLOP/s) on `n` x `n` operands as the kernel benchmarks time their kernels:
    Triton's `do_bench` median."""
    import torch
    from triton.testing import do_bench

    a, b = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    return 2 * n**3 / do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median") / 1e9


# ---------------------------------------------------------------------------------------------------------------------
# the environment
# ---------------------------------------------------------------------------------------------------------------------


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """Python, torch, transformers, triton and Liger's versions (None: not installed), and the GPU's name where there
    is one."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist, key in PACKAGES.items():
        out[key] = package_version(dist)
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checkout's commit, with `+dirty` when tracked files differ from it; None outside a git checkout.
    `SFTFLOW_BENCH_COMMIT` names it instead where the tree was copied with git metadata that is not its own (a
    device machine's copy of a working tree keeps the `.git` of an earlier copy)."""
    if os.environ.get("SFTFLOW_BENCH_COMMIT"):
        return os.environ["SFTFLOW_BENCH_COMMIT"]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The host, as a CPU figure names where it ran: the CPU's name and the cores this process sees."""
    return f"{cpu_name()}, {os.cpu_count()} cores"


def command() -> str:
    """This process's command line, its script named from the checkout's root (`benchmarks/planner.py --skip-real`)."""
    script = Path(sys.argv[0]).resolve()
    name = str(script.relative_to(REPO_ROOT)) if script.is_relative_to(REPO_ROOT) else sys.argv[0]
    return " ".join([name, *sys.argv[1:]])


def environment(*packages: str) -> dict:
    """The fields every result row carries: date, GPU, machine, versions (`versions()` plus FlashAttention-4's and
    those of the distributions named in `packages`), commit and command."""
    found = versions()
    gpu = found.pop("gpu", None)
    found["flash_attn_4"] = package_version("flash-attn-4")
    for dist in packages:
        found[dist.replace("-", "_")] = package_version(dist)
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "machine": machine(),
        "versions": found,
        "commit": git_commit(),
        "command": command(),
    }


def versions_line(env: dict, *keys: str) -> str:
    """`python 3.12.3, torch 2.11.0, ...`: the environment's versions named in `keys` (all that are known if none)."""
    found = env["versions"]
    return ", ".join(f"{k} {found[k]}" for k in (keys or found) if found.get(k) is not None)


def env_line(env: dict | None = None) -> str:
    """The environment in one line, for a Markdown table's header."""
    env = environment() if env is None else env
    return f"{env['date']}, {env['gpu'] or 'cpu'}, {versions_line(env)}, commit {env['commit'] or '?'}"


# ---------------------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------------------


def result_row(
    benchmark: str,
    mode: str,
    metric: str,
    value,
    unit: str,
    env: dict | None = None,
    *,
    workload: str,
    peer: str | None = None,
    peer_value=None,
    ratio=None,
    ratio_basis: str | None = None,
    run: str | None = None,
    source: str | None = None,
    note: str | None = None,
) -> dict:
    """One figure as a `benchmarks/results/*.jsonl` record: `benchmark` is the script (`benchmarks/planner.py`),
    `workload` what it ran on, `mode` which side; the environment (`environment()`) fills in where and how."""
    env = environment() if env is None else env
    return {
        "date": env["date"],
        "gpu": env["gpu"],
        "machine": env["machine"],
        "versions": env["versions"],
        "commit": env["commit"],
        "benchmark": benchmark,
        "command": env["command"],
        "workload": workload,
        "mode": mode,
        "metric": metric,
        "value": value,
        "unit": unit,
        "peer": peer,
        "peer_value": peer_value,
        "ratio": ratio,
        "ratio_basis": ratio_basis,
        "run": run,
        "source": source,
        "note": note,
    }


def write_rows(path: Path | str | None, rows: Iterable[dict]) -> list[dict]:
    """Append `rows` to the JSON-lines file `path` (made with its folder if absent; nothing written for None)."""
    rows = list(rows)
    if path is not None and rows:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows


def read_rows(path: Path | str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------------
# host memory (`export_memory.py`, `checkpoint_memory.py`)
# ---------------------------------------------------------------------------------------------------------------------


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
    """Run `script --mode M --out TMP *args` for each mode, each in its own process (so one mode's freed memory
    never lowers the next one's numbers); a row is the JSON object its last output line holds, or the mode and the
    last line of its error."""
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
