"""The optimizer step of a 1B model on one GPU: `MasterAdamW`'s kernel against torch's fused AdamW.

    python benchmarks/adamw.py [--layers 16 --hidden 2048 --intermediate 8192 --kv 512 --vocab 128256] [--out F.md]

Parameter tensors of a Llama-3.2-1B shape (tied embeddings: 1.24 B parameters). Three ways to update them, each
timed with triton.testing.do_bench (median), gradient clipping factor and the non-finite flag passed as device
tensors to all three:

- **ours**: `sftflow.kernels.adamw` (Triton): bf16 gradients in, fp32 masters (held as the bf16 parameter + int16
  low bits) and moments, the bf16 parameter written in the same pass (the one-device path, `parallel="single"`).
- **torch_fused_fp32**: torch's `AdamW(fused=True)` on fp32 parameters and fp32 gradients: what the FSDP path runs
  (it then needs FSDP's bf16 copy of each layer before compute; not timed here).
- **torch_fused_plus_copy**: torch's fused AdamW on fp32 masters with the bf16 gradients cast to fp32 first and the
  bf16 parameters copied from the masters after (`_foreach_copy_`): the same job as ours from library parts.

Bytes moved per parameter: ours 26 (read grad 2, param 2, low 2, m 4, v 4; write param, low, m, v); torch's fused
AdamW over fp32 parameters 28. The table's GB/s column counts 28 for every variant (a common yardstick).
"""

from __future__ import annotations

import argparse
import datetime
import platform

import harness
import torch
import triton
from triton.testing import do_bench

from sftflow.kernels.adamw import AdamWHyper, MasterTensors, adamw_master_step_, split_master

HYPER = AdamWHyper(lr=2e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def shapes(layers: int, hidden: int, intermediate: int, kv: int, vocab: int) -> list[tuple[int, ...]]:
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
    per_layer += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--kv", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default=None)
    harness.add_common_args(p)  # --jsonl
    args = p.parse_args()
    dev = torch.device("cuda")
    sizes = shapes(args.layers, args.hidden, args.intermediate, args.kv, args.vocab)
    n = sum(torch.Size(s).numel() for s in sizes)
    scale, found_inf = torch.tensor(1.3, device=dev), torch.zeros((), device=dev)
    results = {}

    # ours
    masters = [torch.randn(s, device=dev) * 0.02 for s in sizes]
    params, lows = zip(*(split_master(m) for m in masters), strict=True)
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 1e-3 for s in sizes]
    tensors = [
        MasterTensors(p_, g, low, torch.zeros_like(m), torch.zeros_like(m), torch.zeros((), device=dev))
        for p_, g, low, m in zip(params, grads, lows, masters, strict=True)
    ]
    results["ours"] = do_bench(lambda: adamw_master_step_(tensors, HYPER, scale, found_inf), return_mode="median")

    # torch fused AdamW on fp32 parameters (the FSDP path's optimizer)
    fp32 = [torch.nn.Parameter(m) for m in masters]
    for q, g in zip(fp32, grads, strict=True):
        q.grad = g.float()
    opt = torch.optim.AdamW(fp32, lr=HYPER.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    opt.grad_scale, opt.found_inf = scale, found_inf
    results["torch_fused_fp32"] = do_bench(opt.step, return_mode="median")

    def fused_plus_copy():
        torch._foreach_copy_([q.grad for q in fp32], grads)  # bf16 -> fp32 gradients
        opt.step()
        torch._foreach_copy_(list(params), fp32)  # fp32 masters -> bf16 parameters

    results["torch_fused_plus_copy"] = do_bench(fused_plus_copy, return_mode="median")

    lines = [
        f"AdamW step, {n / 1e9:.3f} B parameters in {len(sizes)} tensors; {torch.cuda.get_device_name()}, "
        f"{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}, python "
        f"{platform.python_version()}",
        "",
        "| variant | ms | GB/s at 28 B/param | ours x |",
        "|---|---|---|---|",
    ]
    for name, ms in results.items():
        lines.append(f"| {name} | {ms:.2f} | {28 * n / ms / 1e6:,.0f} | {ms / results['ours']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.jsonl:
        env, workload = harness.environment(), f"{n / 1e9:.3f}B parameters"
        rows = [
            harness.result_row("benchmarks/adamw.py", k, "step_time", ms, "ms", env, workload=workload)
            for k, ms in results.items()
        ]
        harness.write_rows(args.jsonl, rows)


if __name__ == "__main__":
    main()
