"""The working tree's Triton attention against another version of `kernels/attention_triton.py`, in one process.

    git show REV:kernels/attention_triton.py > /tmp/old_attention.py
    python benchmarks/attention_ab.py --old /tmp/old_attention.py [--docs packed long] [--jsonl FILE]

Both run fwd+bwd on the rows of `benchmarks/attention.py` (`doc_lengths`) at its shapes, alternating old and new
twice per shape so that clock drift shows as a spread; times are `triton.testing.do_bench` medians. The old file's
`torch.library` ops are renamed (`sftflow_old::`) so that both can be loaded. `--jsonl FILE` appends the new
kernel's time against the old one's, per shape, to FILE as result rows (`harness.py`).
"""

# ruff: noqa: B023 - closures over loop variables are timed inside the same iteration

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import harness  # noqa: E402
from attention import DOCS, LONG_SHAPES, SHAPES, doc_lengths  # noqa: E402

from sftflow.kernels import attention_triton as new  # noqa: E402


def load_old(path: str):
    text = pathlib.Path(path).read_text().replace('"sftflow::', '"sftflow_old::')
    tmp = pathlib.Path(tempfile.mkdtemp()) / "old_attention_triton.py"
    tmp.write_text(text)
    spec = importlib.util.spec_from_file_location("old_attention_triton", tmp)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True)
    parser.add_argument("--docs", nargs="+", default=["packed", "long"], choices=sorted(DOCS))
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    old = load_old(args.old)
    env, figures = harness.environment(), []
    print(f"{env['gpu']}, {harness.versions_line(env, 'torch')}")
    print("| docs | H | K | D | old ms (slower run) | new ms (slower run) | new / old | gradients new vs old |")
    print("|---|---|---|---|---|---|---|---|")
    for docs in args.docs:
        T = DOCS[docs][0]
        lengths = doc_lengths(T, docs=docs)
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
        max_len = max(lengths)
        for H, K, D in LONG_SHAPES if docs == "long" else SHAPES:
            g = torch.Generator(device="cuda").manual_seed(H * D + K)
            q, k, v = (
                torch.randn(T, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                for n in (H, K, K)
            )
            do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            scale = D**-0.5
            grads = {}
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(2):
                for name, mod in (("old", old), ("new", new)):

                    def fb(mod=mod):
                        o = mod.triton_varlen_attention(q, k, v, cu, max_len, scale)
                        return torch.autograd.grad(o, (q, k, v), do)

                    grads[name] = fb()
                    times[name].append(do_bench(fb, warmup=50, rep=300, return_mode="median"))
            ref = torch.cat([x.float().flatten() for x in grads["old"]])
            newg = torch.cat([x.float().flatten() for x in grads["new"]])
            err = ((newg - ref).norm() / ref.norm()).item()
            o_ms, n_ms = min(times["old"]), min(times["new"])
            print(
                f"| {docs} | {H} | {K} | {D} | {o_ms:.3f} ({max(times['old']):.3f}) | {n_ms:.3f} "
                f"({max(times['new']):.3f}) | {n_ms / o_ms:.3f} | {err:.1e} |",
                flush=True,
            )
            workload = f"{docs} row T={T}; H={H} K={K} D={D} bf16"
            note = f"fwd+bwd, do_bench median, faster of 2 alternating runs; gradients new vs old {err:.1e}"
            figures += [
                harness.result_row("benchmarks/attention_ab.py", "new (working tree)", "fwd+bwd time", n_ms, "ms", env,
                                   workload=workload, peer=f"old ({args.old})", peer_value=o_ms, ratio=n_ms / o_ms,
                                   ratio_basis="this ms / peer ms", note=note),
                harness.result_row("benchmarks/attention_ab.py", f"old ({args.old})", "fwd+bwd time", o_ms, "ms", env,
                                   workload=workload, note=note),
            ]  # fmt: skip
    harness.write_rows(args.jsonl, figures)


if __name__ == "__main__":
    main()
