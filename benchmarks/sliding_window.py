"""Sliding-window attention against full attention on one GPU: what a window saves, ours (triton) and torch varlen.

    python benchmarks/sliding_window.py [--append-results]

Mistral-7B's attention shape (H=32, K=8, D=128), bf16, forward+backward, on one 32768-token document and on a packed
row of 16384 tokens (lognormal document lengths, median 600, up to 4096), with no window and windows of 4096 (Mistral)
and 1024 (Gemma 3's local layers). Each windowed output is checked against torch `varlen_attn` with the same window.
Timed with `triton.testing.do_bench` (median).
"""

# ruff: noqa: B023 - closures over loop variables are timed inside the same iteration

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from attention import doc_lengths, matmul_tflops  # noqa: E402

from sftflow.kernels.attention import varlen_attention  # noqa: E402

H, K, D = 32, 8, 128
RESULTS = Path(__file__).with_name("RESULTS.md")


def visible_pairs(lengths: list[int], window: int | None) -> int:
    """(query, key) pairs a causal (windowed) attention computes: the useful work."""
    total = 0
    for n in lengths:
        w = n if window is None else min(window, n)
        total += w * (w + 1) // 2 + (n - w) * w
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append-results", action="store_true")
    args = parser.parse_args()
    peak = matmul_tflops()
    rows = {"one 32k document": [32768], "packed 16k row": doc_lengths(16384)}
    lines = [
        f"### Sliding windows, H={H} K={K} D={D} bf16 fwd+bwd ({datetime.date.today()}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, python "
        f"{platform.python_version()}; bf16 matmul {peak:.0f} TFLOP/s)",
        "",
        "| row | window | triton ms | torch ms | torch / triton | triton full / windowed | triton useful TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, lengths in rows.items():
        T = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(T, n, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for n in (H, K, K)
        )
        do = torch.randn_like(q)
        full_ms = None
        for window in (None, 4096, 1024):
            times = {}
            for backend in ("triton", "torch"):

                def fb():
                    o = varlen_attention(q, k, v, cu, max(lengths), window=window, backend=backend)
                    o.backward(do)

                times[backend] = do_bench(fb, warmup=10, rep=100, return_mode="median")
            with torch.no_grad():
                ours = varlen_attention(q, k, v, cu, max(lengths), window=window, backend="triton")
                ref = varlen_attention(q, k, v, cu, max(lengths), window=window, backend="torch")
            err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, f"{row} window {window}: relative error {err:.3e} against torch"
            full_ms = full_ms or times["triton"]
            flops = 3.5 * 4 * visible_pairs(lengths, window) * H * D  # fwd: QK^T and PV; bwd 2.5x
            lines.append(
                f"| {row} | {window or 'none'} | {times['triton']:.2f} | {times['torch']:.2f} | "
                f"{times['torch'] / times['triton']:.2f}x | {full_ms / times['triton']:.2f}x | "
                f"{flops / times['triton'] / 1e9:.0f} |"
            )
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.append_results:
        with open(RESULTS, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
