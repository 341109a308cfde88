"""Fused linear cross-entropy on one GPU: ours (triton, reference) vs Liger-Kernel vs F.cross_entropy on logits.

    python benchmarks/cross_entropy.py [--T 16384 --D 2048 --V 128256] [--out results.md]

Forward + backward (torch.autograd.grad of the summed loss w.r.t. hidden and weight), bf16, timed with
triton.testing.do_bench (median). "peak extra" is the peak allocated memory during one forward + backward minus what
was allocated before it (inputs), the returned gradients included. Also checks each variant's loss and gradients
against an fp32 F.cross_entropy on materialised logits, and prints the matmul floor: 3 matmuls of 2*N*D*V FLOPs over
the measured bf16 matmul rate, N = trained tokens.
"""

# ruff: noqa: B023 - closures over loop variables are timed inside the same iteration

from __future__ import annotations

import argparse
import datetime
import platform
from functools import partial

import harness
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from sftflow.kernels.cross_entropy import linear_cross_entropy


def variants():
    out = {
        "ours_triton": lambda h, w, y: linear_cross_entropy(h, w, y, backend="triton"),
        "ours_reference": lambda h, w, y: linear_cross_entropy(h, w, y, backend="reference"),
        "torch_logits": lambda h, w, y: F.cross_entropy((h @ w.T).float(), y, reduction="sum"),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        out["liger"] = lambda h, w, y: liger(w, h, y)
    except ImportError as err:
        print(f"liger-kernel not importable ({err}); skipping it")
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=16384)
    parser.add_argument("--D", type=int, default=2048)
    parser.add_argument("--V", type=int, default=128256)
    parser.add_argument("--masks", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    parser.add_argument("--kernel-sweep", action="store_true", help="time the CE kernel's block shapes on a chunk")
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    T, D, V = args.T, args.D, args.V
    if args.kernel_sweep:
        kernel_sweep(V)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(V, D, device="cuda", generator=g) * D**-0.5).bfloat16().requires_grad_()
    rate = harness.do_bench_matmul_tflops()
    fns = variants()
    rows = []
    for mask in args.masks:
        labels = torch.randint(0, V, (T,), device="cuda", generator=g)
        labels[torch.randperm(T, device="cuda", generator=g)[: round(T * mask)]] = -100
        n = int((labels != -100).sum())

        def fwd_bwd(fn):
            return torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight))

        h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        ref_loss = F.cross_entropy(h32 @ w32.T, labels, reduction="sum")
        ref = torch.autograd.grad(ref_loss, (h32, w32))
        del h32, w32
        results = {}
        for name, fn in fns.items():
            loss = fn(hidden, weight, labels).float()
            grads = fwd_bwd(fn)
            errs = (abs(loss.item() / ref_loss.item() - 1), rel_err(grads[0], ref[0]), rel_err(grads[1], ref[1]))
            del grads, loss
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            res = fwd_bwd(fn)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            del res
            ms = do_bench(lambda fn=fn: fwd_bwd(fn), warmup=200, rep=1000, return_mode="median")
            results[name] = (ms, peak, errs)
        floor = 3 * 2 * n * D * V / rate / 1e9
        for name, (ms, peak, errs) in results.items():
            liger_ms, liger_peak = results.get("liger", (float("nan"), float("nan"), None))[:2]
            rows.append((mask, n, name, ms, ms / liger_ms, peak, peak / liger_peak, floor, errs))
        del ref, ref_loss
    now = datetime.date.today().isoformat()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        versions += f", liger-kernel {version('liger-kernel')}"
    except ImportError:
        pass
    lines = [
        f"### Fused linear cross-entropy, T={T} D={D} V={V} bf16 fwd+bwd ({now}, {torch.cuda.get_device_name()}, "
        f"{versions}, python {platform.python_version()}; bf16 matmul {rate:.0f} TFLOP/s)",
        "",
        "| masked | trained N | variant | ms | × Liger | peak extra GiB | × Liger | matmul floor ms | "
        "loss err | grad_h err | grad_w err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mask, n, name, ms, r_ms, peak, r_peak, floor, errs in rows:
        lines.append(
            f"| {mask:.1f} | {n} | {name} | {ms:.2f} | {r_ms:.2f} | {peak:.3f} | {r_peak:.2f} | {floor:.2f} | "
            f"{errs[0]:.1e} | {errs[1]:.1e} | {errs[2]:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n\n")
    if args.jsonl:
        env, figures = harness.environment(), []
        for mask, _, name, ms, _, peak, _, _, _ in rows:
            row = partial(harness.result_row, "benchmarks/cross_entropy.py", name, env=env,
                          workload=f"T={T} D={D} V={V} bf16; {mask:.0%} of targets masked")  # fmt: skip
            figures += [row("fwd_bwd_time", ms, "ms"), row("peak_extra_memory", peak, "GiB")]
        harness.write_rows(args.jsonl, figures)


def kernel_sweep(V: int, rows: int = 512) -> None:
    """The softmax/gradient step alone on one chunk of logits: reads the chunk twice and writes it once."""
    from sftflow.kernels import cross_entropy_triton as ct

    logits = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, V, (rows,), device="cuda")
    saved = ct.BLOCK_V_MAX, ct.NUM_WARPS
    for block_v, warps in [(2048, 4), (4096, 8), (4096, 16), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]:
        ct.BLOCK_V_MAX, ct.NUM_WARPS = block_v, warps
        ms = do_bench(lambda: ct.ce_loss_and_grad_(logits, target), warmup=50, rep=300, return_mode="median")
        gbps = 3 * logits.numel() * 2 / ms / 1e6
        print(f"kernel sweep BLOCK_V={block_v} warps={warps}: {ms * 1e3:.0f} us, {gbps:.0f} GB/s")
    ct.BLOCK_V_MAX, ct.NUM_WARPS = saved


if __name__ == "__main__":
    main()
