"""What the benchmark scripts share: the common options, timing, the environment a figure was measured in, and
results as JSON lines.

A script runs from `benchmarks/` (its folder is on `sys.path`), so it imports this module as `harness`. A result row
is one figure:

    {"date", "gpu", "versions", "commit", "benchmark", "mode", "metric", "value", "unit"}

`gpu` is the CUDA device's name (None on a CPU run), `versions` the packages the figure depends on, `commit` the
checkout's git commit (None outside a git checkout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
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
    """The checkout's commit, with `+dirty` when tracked files differ from it; None outside a git checkout."""
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


def environment() -> dict:
    """The fields every result row carries: date, GPU, versions (`versions()` plus FlashAttention-4's), commit."""
    found = versions()
    gpu = found.pop("gpu", None)
    found["flash_attn_4"] = package_version("flash-attn-4")
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "versions": found, "commit": git_commit()}


def env_line(env: dict | None = None) -> str:
    """The environment in one line, for a Markdown table's header."""
    env = environment() if env is None else env
    packages = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
    return f"{env['date']}, {env['gpu'] or 'cpu'}, {packages}, commit {env['commit'] or '?'}"


# ---------------------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------------------


def result_row(benchmark: str, mode: str, metric: str, value, unit: str, env: dict | None = None) -> dict:
    env = environment() if env is None else env
    return {
        "date": env["date"],
        "gpu": env["gpu"],
        "versions": env["versions"],
        "commit": env["commit"],
        "benchmark": benchmark,
        "mode": mode,
        "metric": metric,
        "value": value,
        "unit": unit,
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
