"""Varlen causal attention on one GPU: ours (triton) vs torch varlen_attn vs FlexAttention with a document BlockMask,
and FlashAttention-4 (through sftflow's op, `flash_attn_4`, and called directly, `fa4-direct`).

    python benchmarks/attention.py [--docs packed|long] [--sweep] [--rounds N] [--out results.md]
        [--variants triton triton-pack triton-pointers triton-tma torch flex flash_attn_4 fa4-nondet fa4-direct
         dispatch]

`--docs packed` (default): one packed row of T=16384 tokens, document lengths lognormal (median 600, sigma 1,
clipped to [16, 4096]; the last document is cut to fill the row). `--docs long`: one row of T=65536 tokens of long
documents, lognormal (median 16384, sigma 0.7, clipped to [8192, 65536]; the last one cut to fill the row, and kept
at 8192 or more by merging it into the one before). bf16; (H, K, D) shapes: packed (32, 32, 64), (32, 8, 64),
(16, 16, 128), (16, 4, 128); long (32, 8, 64), (16, 16, 128), (16, 4, 128), (16, 8, 256).
Useful FLOPs: forward sum over documents of 2*L^2*H*D (QK^T and PV over the causal half:
2 matmuls x 2*(L^2/2)*D per head), backward 2.5x that, so forward+backward 3.5x. Timed with triton.testing.do_bench
(median). Each variant's output is checked against torch varlen_attn (or sdpa's dense reference where that cannot run).
`triton-pack`: our kernels with query tiles packed per GQA group (`PACK`: the forward's and dQ's programs per kv head,
the group's query heads stacked as the rows of every query tile, in the dK/dV loop too), on the default tiles; at
K = H it is the same as `triton`. `triton-pointers`: the default tiles loaded and stored through per-thread pointers and
masks instead of TMA tensor descriptors (`TMA` off: the path GPUs before Hopper take); `triton-tma`: TMA on in every
kernel (as the shipped configs have it).
"""

# ruff: noqa: B023 - closures over loop variables are timed inside the same iteration

from __future__ import annotations

import argparse
import datetime
import os
import platform
from unittest import mock

import harness
import numpy as np
import torch
import triton
from harness import do_bench_matmul_tflops as matmul_tflops
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from sftflow.kernels.attention import BACKENDS, varlen_attention
from sftflow.kernels.attention_triton import triton_varlen_attention

SHAPES = [(32, 32, 64), (32, 8, 64), (16, 16, 128), (16, 4, 128)]  # (H, K, D)
LONG_SHAPES = [(32, 8, 64), (16, 16, 128), (16, 4, 128), (16, 8, 256)]
# Variants of our kernels: the shipped configs with a flag set, per kernel.
_EVERY = ("fwd", "dq", "dkdv")
FLAG_VARIANTS = {
    "triton-pack": {part: {"PACK": True} for part in _EVERY},
    "triton-pointers": {part: {"TMA": False} for part in _EVERY},
    "triton-tma": {part: {"TMA": True} for part in _EVERY},
}
DOCS = {  # name: (default T, lognormal median, sigma, shortest, longest)
    "packed": (16384, 600, 1.0, 16, 4096),
    "long": (65536, 16384, 0.7, 8192, 65536),
}


def doc_lengths(total: int, seed: int = 0, docs: str = "packed") -> list[int]:
    _, median, sigma, shortest, longest = DOCS[docs]
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(np.clip(rng.lognormal(np.log(median), sigma), shortest, longest)))
    lengths[-1] -= sum(lengths) - total
    if docs == "long" and len(lengths) > 1 and lengths[-1] < shortest:
        last = lengths.pop()
        lengths[-1] += last
    return lengths


def flex_fn(lengths, T, H, K):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention)

    def run(q, k, v, cu, max_len):  # flex wants (B, H, T, D); the layout change is timed with it
        o = flex(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            block_mask=block_mask,
            enable_gqa=H != K,
        )
        return o[0].transpose(0, 1)

    return run


def fa4_direct(q, k, v, cu, max_len):
    """FlashAttention-4 as its users call it: `flash_attn.cute.flash_attn_varlen_func`, its own autograd function."""
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True
    )[0]


def variant_env(name: str):
    """`fa4-nondet`: sftflow's FlashAttention-4 op with `SFTFLOW_FA4_DETERMINISTIC=0` while the variant is timed."""
    changes = {"SFTFLOW_FA4_DETERMINISTIC": "0"} if name == "fa4-nondet" else {}
    return mock.patch.dict(os.environ, changes)


def figure_rows(rows: list[tuple], base: dict, rate: float, workload: str) -> list[dict]:
    """`rows` (one per shape and variant) as result rows: fwd+bwd milliseconds against torch's `varlen_attn` in the
    same process, and the share of the bf16 matmul rate measured there."""
    env, out = harness.environment(), []
    for H, K, D, name, _ms_f, _tf_f, ms_fb, tf_fb, _err in rows:
        peer = base.get((H, K, D)) if name != "torch" else None  # torch's row of the same shape
        shape = f"{workload}, H={H} K={K} D={D}"
        out.append(harness.result_row(
            "benchmarks/attention.py", name, "fwd+bwd time", round(ms_fb, 4), "ms", env, workload=shape,
            peer="torch varlen_attn" if peer else None, peer_value=round(peer[6], 4) if peer else None,
            ratio=round(peer[6] / ms_fb, 3) if peer else None, ratio_basis="peer ms / this ms" if peer else None,
        ))  # fmt: skip
        out.append(harness.result_row(
            "benchmarks/attention.py", name, "share of the bf16 matmul rate", round(100 * tf_fb / rate, 1), "%", env,
            workload=shape, note=f"bf16 matmul {rate:.0f} TFLOP/s in the same process",
        ))  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", choices=sorted(DOCS), default="packed")
    parser.add_argument("--T", type=int, default=None, help="row length (default: 16384 packed, 65536 long)")
    parser.add_argument("--variants", nargs="+", default=["triton", "torch"])
    parser.add_argument("--sweep", action="store_true", help="time block-shape configs of our kernel at every shape")
    parser.add_argument("--shapes", default=None, help="H,K,D[;H,K,D...]: only these shapes (default: all four)")
    harness.add_common_args(parser, out="append the Markdown table to this file")  # --out, --jsonl
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every variant this many times, in reverse order every other round, and report the median round: "
        "drift in the GPU's clocks then lands on every variant alike",
    )
    args = parser.parse_args()
    default_shapes = LONG_SHAPES if args.docs == "long" else SHAPES
    shapes = (
        default_shapes if args.shapes is None else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    )
    T = args.T or DOCS[args.docs][0]
    lengths = doc_lengths(T, docs=args.docs)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    max_len = max(lengths)
    sum_l2 = float(sum(length**2 for length in lengths))
    rate = matmul_tflops()
    print(f"{len(lengths)} docs, max {max_len}, median {int(np.median(lengths))}; bf16 matmul {rate:.0f} TFLOP/s")
    rows = []
    for H, K, D in shapes:
        g = torch.Generator(device="cuda").manual_seed(H * D + K)
        q, k, v = (
            torch.randn(T, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for n in (H, K, K)
        )
        do = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        fwd_flops = 2 * sum_l2 * H * D
        fns = {}
        for name in args.variants:
            if name == "flex":
                fns[name] = flex_fn(lengths, T, H, K)
            elif name == "fa4-direct":
                fns[name] = fa4_direct
            elif name == "fa4-nondet":  # FlashAttention-4's backward without its deterministic mode (`variant_env`)
                fns[name] = lambda q, k, v, cu, m: varlen_attention(q, k, v, cu, m, backend="flash_attn_4")
            elif name == "dispatch":  # what training runs: the first backend available here
                fns[name] = lambda q, k, v, cu, m: varlen_attention(q, k, v, cu, m)
            elif name in FLAG_VARIANTS:
                fns[name] = lambda q, k, v, cu, m, c=FLAG_VARIANTS[name]: triton_varlen_attention(
                    q, k, v, cu, m, D**-0.5, config=c
                )
            else:
                fns[name] = lambda q, k, v, cu, m, name=name: varlen_attention(q, k, v, cu, m, backend=name)
        # The reference: torch's varlen kernel wherever it runs (sdpa's dense mask at T=65536 takes 64 GiB).
        check_name = "torch" if BACKENDS["torch"](q.device, q.dtype) is None else "sdpa"
        with torch.no_grad():
            ref = varlen_attention(q, k, v, cu, max_len, backend=check_name).float()
        times: dict[str, list[tuple[float, float]]] = {}
        errs: dict[str, float] = {}
        for r in range(args.rounds):
            for name, fn in list(fns.items())[:: -1 if r % 2 else 1]:

                def fb(fn=fn):
                    return torch.autograd.grad(fn(q, k, v, cu, max_len), (q, k, v), do)

                try:
                    with torch.no_grad(), variant_env(name):
                        o = fn(q, k, v, cu, max_len).float()
                    errs[name] = ((o - ref).norm() / ref.norm()).item()
                    with variant_env(name):
                        ms_f = do_bench(
                            lambda fn=fn: fn(q, k, v, cu, max_len), warmup=100, rep=500, return_mode="median"
                        )
                        ms_fb = do_bench(fb, warmup=100, rep=500, return_mode="median")
                except OutOfResources as oor:  # a variant's tiles over this GPU's shared memory: the others still run
                    print(f"({H}, {K}, {D}) {name}: skipped, {oor}", flush=True)
                    del fns[name]
                    continue
                times.setdefault(name, []).append((ms_f, ms_fb))
                if args.rounds > 1:
                    print(f"({H}, {K}, {D}) {name} round {r}: fwd {ms_f:.3f} ms, fwd+bwd {ms_fb:.3f} ms", flush=True)
        for name in fns:
            ms_f = float(np.median([t[0] for t in times[name]]))
            ms_fb = float(np.median([t[1] for t in times[name]]))
            rows.append((H, K, D, name, ms_f, fwd_flops / ms_f / 1e9, ms_fb, 3.5 * fwd_flops / ms_fb / 1e9, errs[name]))
            print(rows[-1], flush=True)
        if args.sweep:
            sweep(q, k, v, do, cu, max_len, D, fwd_flops)
    base = {(r[0], r[1], r[2]): r for r in rows if r[3] == "torch"}
    now = datetime.date.today().isoformat()
    lines = [
        f"### Varlen causal attention, T={T} {args.docs}, {len(lengths)} docs (lognormal median "
        f"{DOCS[args.docs][1]}, sigma {DOCS[args.docs][2]}, [{DOCS[args.docs][3]}, {DOCS[args.docs][4]}]; "
        f"longest {sorted(lengths, reverse=True)[:6]}), bf16 ({now}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, "
        f"triton {triton.__version__}, python {platform.python_version()}; bf16 matmul {rate:.0f} TFLOP/s)",
        "",
        "| H | K | D | variant | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | × torch (fwd+bwd) | "
        "fwd × torch | % of matmul | out err vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for H, K, D, name, ms_f, tf_f, ms_fb, tf_fb, err in rows:
        b = base.get((H, K, D))
        speed = f"{b[6] / ms_fb:.2f}" if b else "-"
        speed_f = f"{b[4] / ms_f:.2f}" if b else "-"
        lines.append(
            f"| {H} | {K} | {D} | {name} | {ms_f:.3f} | {tf_f:.0f} | {ms_fb:.3f} | {tf_fb:.0f} | {speed} | "
            f"{speed_f} | {100 * tf_fb / rate:.0f}% | {err:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    workload = f"T={T} {args.docs} rows, {len(lengths)} docs, causal varlen, bf16"
    harness.write_rows(args.jsonl, figure_rows(rows, base, rate, workload))
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n\n")


PACK_GRID = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (256, 64, 8, 2)]
# Packed dK/dV tiles that compile for sm_90 without spilling at D=128 and group 4 (python -m sftflow.kernels.aot with
# triton 3.6); a fifth field splits the dV and dK passes.
PACK_DKDV_GRID = [(32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3, True)]


def sweep(q, k, v, do, cu, max_len, D, fwd_flops):
    """Coordinate descent over each kernel's block shape, then each kernel's program order, timing fwd+bwd."""
    from sftflow.kernels.attention_triton import LONG_DOC, resolve_config

    scale = D**-0.5
    H, K = q.shape[1], k.shape[1]
    current = resolve_config(D, H != K, q.device, max_seqlen=max_len)
    grids = {
        "fwd": [(64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3), (32, 64, 4, 3)],
        "dkdv": [
            (32, 64, 4, 3),
            (32, 64, 4, 2),
            (64, 64, 4, 3),
            (64, 64, 4, 2),
            (64, 64, 8, 3),
            (32, 128, 4, 3),
            (32, 128, 8, 3),
            (64, 128, 8, 2),
            (64, 128, 8, 3),
            (128, 128, 8, 2),
            (16, 64, 4, 3),
            (32, 128, 8, 3, True),  # split dV/dK passes (a fifth field), as D=256 uses
            (64, 128, 8, 3, True),
        ],
        "dq": [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (32, 64, 4, 3)],
    }

    if max_len >= LONG_DOC and D <= 128:  # long documents: few masked blocks, so deeper tiles (Hopper's wgmma)
        grids = {
            "fwd": [
                (64, 64, 4, 3),
                (128, 64, 4, 3),
                (128, 64, 8, 3),
                (128, 128, 8, 3),
                (128, 128, 8, 2),
                (128, 32, 4, 4),
                (64, 128, 4, 3),
            ],
            "dkdv": [
                (32, 64, 4, 3),
                (64, 64, 4, 3),
                (32, 128, 4, 3),
                (32, 128, 8, 3),
                (64, 128, 8, 3),
                (64, 128, 8, 2),
                (128, 128, 8, 2),
                (64, 64, 8, 3),
                (64, 128, 8, 3, True),
                (128, 128, 8, 2, True),
            ],
            "dq": [(64, 32, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
        }
    if D > 128:  # shallower tiles: the D=128 grid's deep ones do not fit shared memory at D=256
        grids = {
            # (64, 64, 8, 2): no spills and 172 KB of shared memory at sm_90 (python -m sftflow.kernels.aot)
            "fwd": [(64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 3), (128, 32, 8, 2), (64, 64, 8, 2)],
            # ... and split dV/dK passes (a fifth field): one fp32 accumulator a program, so deeper key tiles
            "dkdv": [
                (32, 32, 8, 2),
                (32, 32, 4, 2),
                (16, 32, 4, 2),
                (32, 64, 8, 2),
                (16, 64, 4, 2),
                (32, 64, 4, 2, True),
                (32, 64, 8, 2, True),
                (64, 64, 8, 2, True),
                (32, 128, 8, 2, True),
                (16, 128, 8, 2, True),
                (64, 128, 8, 2, True),
            ],
            "dq": [(64, 32, 8, 2), (32, 32, 4, 2), (64, 16, 4, 2), (128, 32, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2)],
        }

    def grads(config):
        o = triton_varlen_attention(q, k, v, cu, max_len, scale, config=config)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    want = grads(current)

    def time_config(config):
        def fb():
            return grads(config)[1:]

        try:
            # A config that computes something else is not a candidate: its output and gradients must agree with
            # the default config's to bf16 rounding.
            got = grads(config)
            errs = [((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want, strict=True)]
            if max(errs) > 1e-2:
                print(f"sweep H={H} K={K} D={D} {config}: wrong (relative errors {errs})", flush=True)
                return float("inf")
            ms = do_bench(fb, warmup=50, rep=300, return_mode="median")
        except Exception as err:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            print(f"sweep H={H} K={K} D={D} {config}: failed {type(err).__name__}", flush=True)
            return float("inf")
        print(f"sweep H={H} K={K} D={D} fwd+bwd {config}: {ms:.3f} ms {3.5 * fwd_flops / ms / 1e9:.0f} TFLOP/s")
        return ms

    def choose(part: str, trials: list[dict]) -> None:
        """Keep the fastest of `trials` for kernel `part`, the other kernels as chosen so far."""
        current[part] = min(trials, key=lambda cfg: time_config({**current, part: cfg}))

    for part, grid in grids.items():
        trials = []
        for bm, bn, w, st, *split in grid:
            trial = {**current[part], "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            if part == "dkdv":
                trial["SPLIT"] = bool(split and split[0])
            trials.append(trial)
        choose(part, trials)
    for part in grids:
        trials = [{**current[part], "ORDER": order} for order in ("lpt", "row")]
        choose(part, trials)
    for part in grids:  # TMA (the copy engine moves the tiles) against pointers
        trials = [current[part], {**current[part], "TMA": not current[part].get("TMA", False)}]
        choose(part, trials)
    if H != K:  # GQA: query tiles with the group's heads packed as rows, which favours deeper row tiles
        for part in ("fwd", "dq"):
            trials = [current[part]] + [
                {**current[part], "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "PACK": True}
                for bm, bn, w, st in PACK_GRID
            ]
            choose(part, trials)
        trials = [current["dkdv"], {**current["dkdv"], "PACK": True}] + [
            {**current["dkdv"], "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "SPLIT": bool(split),
             "PACK": True}
            for bm, bn, w, st, *split in PACK_DKDV_GRID
        ]  # fmt: skip
        choose("dkdv", trials)
    print(f"sweep best H={H} K={K} D={D}: {current}", flush=True)


if __name__ == "__main__":
    main()
