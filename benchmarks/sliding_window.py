"""Sliding-window attention against full attention on one GPU: what a window saves, ours (triton) and torch varlen.

    python benchmarks/sliding_window.py [--append-results] [--jsonl FILE]

Mistral-7B's attention shape (`mistral-7b` of `sftflow.tasks.shapes`: H=32, K=8, D=128), bf16, forward+backward,
on one 32768-token document and on a packed row of 16384 tokens (lognormal document lengths, median 600, up to 4096),
with no window and windows of 4096 (Mistral) and 1024 (Gemma 3's local layers). Each windowed output is checked
against torch `varlen_attn` with the same window. Timed with `triton.testing.do_bench` (median). `--jsonl FILE`
appends each row's triton and torch times to FILE as result rows (`harness.py`).
"""

# ruff: noqa: B023 - closures over loop variables are timed inside the same iteration

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402
from attention import doc_lengths  # noqa: E402

from sftflow.kernels.attention import varlen_attention  # noqa: E402
from sftflow.tasks.shapes import SHAPES  # noqa: E402

MISTRAL = SHAPES["mistral-7b"]
H, K, D = MISTRAL.heads, MISTRAL.kv_heads, MISTRAL.head_dim
RESULTS = Path(__file__).with_name("RESULTS.md")
BENCHMARK = "benchmarks/sliding_window.py"


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
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    env = harness.environment()
    peak = harness.do_bench_matmul_tflops()
    rows = {"one 32k document": [32768], "packed 16k row": doc_lengths(16384)}
    figures = []
    lines = [
        f"### Sliding windows, H={H} K={K} D={D} bf16 fwd+bwd ({env['date']}, "
        f"{env['gpu']}, {harness.versions_line(env, 'torch', 'triton', 'python')}; bf16 matmul {peak:.0f} TFLOP/s)",
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
            workload = f"{row}, window {window or 'none'}; H={H} K={K} D={D} bf16"
            note = f"fwd+bwd, do_bench median; bf16 matmul {peak:.0f} TFLOP/s in the same run"
            figures += [
                harness.result_row(BENCHMARK, "triton", "fwd+bwd time", times["triton"], "ms", env, workload=workload,
                                   peer="torch varlen_attn", peer_value=times["torch"],
                                   ratio=times["torch"] / times["triton"], ratio_basis="peer ms / this ms", note=note),
                harness.result_row(BENCHMARK, "torch varlen_attn", "fwd+bwd time", times["torch"], "ms", env,
                                   workload=workload, note=note),
            ]  # fmt: skip
    harness.write_rows(args.jsonl, figures)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.append_results:
        with open(RESULTS, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
