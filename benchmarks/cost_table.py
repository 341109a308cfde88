"""Measure the planner's cost table: the worker's training step time per token on rows made of documents of one
length, at several lengths, on this GPU and model shape.

    python benchmarks/cost_table.py --preset llama1b --out DIR          # H200: lengths 256 ... 65536, rows of 64k
    python benchmarks/cost_table.py --preset tiny --device cpu --lengths 16,64,256 --row-tokens 256 --steps 2
    python benchmarks/cost_table.py ... --simulate-ranks 2      # then: what the table buys a plan over 2 ranks

Writes `DIR/cost_table.json` (`{"points": [[length, seconds_per_token], ...], ...}`, what `plan.cost_table` reads)
and `DIR/cost_table.md`. Every length is timed on rows of the same size (`--row-tokens`, at least the longest
length) with the same model, compile and activation-checkpointing settings, one optimizer step per row, so the
per-token times differ only by how documents split the row: what the planner needs to weigh a long document against
many short ones. Beside each point: the two-term estimate's per-token cost (`1 + L/row_tokens`, the planner's
default, scaled to the table's shortest length) and the FLOP model's (`a + b·L` from `cost_coefficients_from_model`).

`--simulate-ranks R` then plans documents with long tails (lognormal, median `--sim-median`, sigma 1.5, up to the
row size) for R ranks twice, once with the default estimate and once with the measured table, and times each rank's
row of every step on this one GPU: a step of R ranks lasts as long as its slowest rank, so
`sum(max over ranks) / sum(mean over ranks)` is the time a real R-GPU run would spend (communication left out), and
`1 - mean/max` the share its GPUs would wait for each other.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    add_common_args,
    environment,
    package_version,
    result_row,
    sync,
    versions,
    write_rows,
)
from train_throughput import PAD_ID, init_single_process, llama_config  # noqa: E402

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def rows_of_length(length: int, row_tokens: int, rows: int, vocab_size: int, seed: int):
    """Mock documents all `length` tokens long, planned into rows of `row_tokens` (`row_tokens // length` each)."""
    from sftflow.tasks.plan.planner import PlanConfig, plan
    from sftflow.tasks.train.mock import MockConfig, MockDataset

    per_row = max(1, row_tokens // length)
    config = MockConfig(
        num_docs=per_row * rows,
        vocab_size=vocab_size,
        length_distribution="fixed",
        median_length=length,
        min_length=length,
        max_length=length,
        loss_spans=True,
        seed=seed,
    )
    dataset = MockDataset(config)
    arrays, _ = plan(
        dataset.lengths,
        dataset.loss_token_counts,
        PlanConfig(num_ranks=1, tokens_per_rank=row_tokens, micro_batches_per_step=1, seed=seed, shuffle=False),
    )
    return dataset, arrays


def ran(kernel: str) -> str:
    """The backend `kernel` last ran with in this process (the dispatch records each call's choice)."""
    from sftflow.kernels.dispatch import last_choice

    choice = last_choice(kernel)
    if choice is None:
        raise RuntimeError(f"no {kernel} kernel ran in the timed steps")
    return choice.name


def measure(args) -> dict:
    from sftflow.kernels import attention, cross_entropy
    from sftflow.tasks.plan.planner import cost_coefficients_from_model
    from sftflow.tasks.train import config as cfg
    from sftflow.tasks.train.activations import apply_activation_checkpointing
    from sftflow.tasks.train.compile import compile_layers, resolve_compile
    from sftflow.tasks.train.config import parallel_path
    from sftflow.tasks.train.data import RankBatches
    from sftflow.tasks.train.fsdp import compute_dtype
    from sftflow.tasks.train.model import build_model, decoder_layers
    from sftflow.tasks.train.worker import Prefetch, parallelize, stage_inputs, train_step

    env = init_single_process(args.device)
    dtype = compute_dtype(env, "auto")
    lm_config = llama_config(args.preset)
    path = Path(args.tmp) / "model-config.json"
    lm_config.to_json_file(str(path))
    torch.manual_seed(args.seed)
    with torch.device(env.device):
        lm = build_model(str(path), vocab_size=lm_config.vocab_size, packed=True)
    compiled = resolve_compile(args.compile, env.device)
    if compiled:
        compile_layers(decoder_layers(lm), device=env.device, dtype=dtype)
    apply_activation_checkpointing(decoder_layers(lm), args.activation_checkpointing)
    optim_c = cfg.optim_config(cfg.TrainConfig(data="unused", plan="unused", model="unused", out="unused"))
    model, optimizer, _ = parallelize(lm, env, parallel_path("auto", env.world_size, env.device.type), dtype, optim_c)
    stage = partial(stage_inputs, device=env.device, vocab_size=getattr(model, "vocab_size", None))

    points, rows = [], []
    for length in sorted(args.lengths):
        dataset, arrays = rows_of_length(length, args.row_tokens, args.warmup + args.steps, lm_config.vocab_size, 0)
        batches = RankBatches(arrays, dataset, rank=0, world_size=1, pad_id=PAD_ID)
        prefetch = Prefetch(batches, arrays, arrays.num_steps, stage=stage)
        times, tokens = [], []
        for s in range(min(arrays.num_steps, args.warmup + args.steps)):
            sync(env.device)
            t0 = time.perf_counter()
            result = train_step(
                model,
                optimizer,
                prefetch.take(s),
                int(arrays.step_loss_tokens[s]),
                optim_c.grad_clip,
                env.device,
                host_work=partial(prefetch.collate, s + 1),
            )
            sync(env.device)
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(result.tokens)
        per_token = [t / n for t, n in zip(times, tokens, strict=True)]
        seconds = statistics.median(per_token)
        points.append([length, seconds])
        rows.append(
            {
                "length": length,
                "docs_per_row": max(1, args.row_tokens // length),
                "us_per_token_median": 1e6 * seconds,
                "us_per_token_aggregate": 1e6 * sum(times) / sum(tokens),
                "timed_steps": len(times),
            }
        )
        print(f"[cost_table] {json.dumps(rows[-1])}", flush=True)

    shortest, t0 = points[0]
    head_dim = getattr(lm_config, "head_dim", None) or lm_config.hidden_size // lm_config.num_attention_heads
    a, b = cost_coefficients_from_model(
        hidden_size=lm_config.hidden_size,
        num_layers=lm_config.num_hidden_layers,
        num_heads=lm_config.num_attention_heads,
        num_kv_heads=lm_config.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=lm_config.intermediate_size,
        vocab_size=lm_config.vocab_size,
    )
    for row in rows:
        L = row["length"]
        row["relative_measured"] = row["us_per_token_median"] / (1e6 * t0)
        row["relative_default_estimate"] = (1 + L / args.row_tokens) / (1 + shortest / args.row_tokens)
        row["relative_flop_model"] = (a + b * L) / (a + b * shortest)
    if args.simulate_ranks:
        step = partial(_time_row, model, optimizer, optim_c, env.device, stage)
        sim = simulate_ranks(args, lm_config.vocab_size, points, step)
    return {
        **({"simulated_ranks": sim} if args.simulate_ranks else {}),
        "date": datetime.date.today().isoformat(),
        "versions": {**versions(), "flash_attn_4": package_version("flash-attn-4")},
        # the kernels the steps ran: a table measured with one attention kernel misweighs long documents for another
        "attention": ran(attention.KERNEL),
        "loss": ran(cross_entropy.KERNEL),
        "preset": args.preset,
        "model": {k: getattr(lm_config, k, None) for k in ("hidden_size", "num_hidden_layers", "head_dim")},
        "row_tokens": args.row_tokens,
        "compile": bool(compiled),
        "activation_checkpointing": args.activation_checkpointing,
        "dtype": str(dtype),
        "points": points,  # seconds per token: what `plan.cost_table` reads
        "rows": rows,
    }


def _time_row(model, optimizer, optim_c, device, stage, batches, arrays, s: int) -> float:
    """Seconds of one training step on this rank's micro-batches of step `s` (collated before the clock starts)."""
    from sftflow.tasks.train.worker import train_step

    micro_batches = stage(batches(s))
    sync(device)
    t0 = time.perf_counter()
    train_step(model, optimizer, micro_batches, int(arrays.step_loss_tokens[s]), optim_c.grad_clip, device)
    sync(device)
    return time.perf_counter() - t0


def simulate_ranks(args, vocab_size: int, points: list, time_row) -> dict:
    from sftflow.tasks.plan.planner import PlanConfig, plan, plan_stats
    from sftflow.tasks.train.data import RankBatches
    from sftflow.tasks.train.mock import MockConfig, MockDataset

    R, T = args.simulate_ranks, args.row_tokens
    steps = args.warmup + args.sim_steps
    mock = MockConfig(
        num_docs=int(2.2 * steps * R * T / args.sim_median),
        vocab_size=vocab_size,
        median_length=args.sim_median,
        sigma=1.5,
        min_length=64,
        max_length=T,
        loss_spans=True,
        seed=args.seed,
    )
    dataset = MockDataset(mock)
    base = dict(num_ranks=R, tokens_per_rank=T, micro_batches_per_step=1, seed=args.seed)
    table = PlanConfig(**base, cost_table=points)
    out = {"ranks": R, "median_length": args.sim_median, "docs": len(dataset)}
    for name, config in (("default_estimate", PlanConfig(**base)), ("measured_table", table)):
        arrays, _ = plan(dataset.lengths, dataset.loss_token_counts, config)
        judged = plan_stats(arrays, dataset.lengths, table, [arrays.num_steps], 0.0)
        ranks = [RankBatches(arrays, dataset, rank=r, world_size=R, pad_id=PAD_ID) for r in range(R)]
        slowest, mean = [], []
        for s in range(min(steps, arrays.num_steps)):
            times = [time_row(ranks[r], arrays, s) for r in range(R)]
            if s >= args.warmup:
                slowest.append(max(times))
                mean.append(sum(times) / R)
        out[name] = {
            "timed_steps": len(slowest),
            "step_s_slowest_rank_total": sum(slowest),
            "step_s_mean_rank_total": sum(mean),
            "idle_share": 1 - sum(mean) / sum(slowest),
            "token_imbalance": judged.token_imbalance,
            "cost_imbalance_by_table": judged.cost_imbalance,
        }
        print(f"[cost_table] {name}: {json.dumps(out[name])}", flush=True)
    d, m = out["default_estimate"], out["measured_table"]
    out["speedup_slowest_rank"] = d["step_s_slowest_rank_total"] / m["step_s_slowest_rank_total"]
    return out


def markdown(report: dict) -> str:
    lines = [
        f"Cost table, {report['versions'].get('gpu', 'cpu')}, preset {report['preset']}, rows of "
        f"{report['row_tokens']} tokens, compile={report['compile']}, activation checkpointing "
        f"{report['activation_checkpointing']}, attention {report['attention']} ({report['date']})",
        "",
        "| doc length | docs/row | µs/token (median) | µs/token (total/total) | measured ÷ shortest | default "
        "estimate ÷ shortest | FLOP model ÷ shortest |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['length']} | {r['docs_per_row']} | {r['us_per_token_median']:.3f} | "
            f"{r['us_per_token_aggregate']:.3f} | {r['relative_measured']:.2f} | "
            f"{r['relative_default_estimate']:.2f} | {r['relative_flop_model']:.2f} |"
        )
    sim = report.get("simulated_ranks")
    if sim:
        lines += [
            "",
            f"{sim['ranks']} ranks simulated on one GPU (each rank's row timed in turn; a step lasts as long as its "
            f"slowest rank), documents lognormal median {sim['median_length']}, sigma 1.5, up to the row size:",
            "",
            "| plan balanced by | timed steps | Σ slowest rank (s) | Σ mean rank (s) | GPUs waiting | token "
            "imbalance | cost imbalance (table) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ("default_estimate", "measured_table"):
            r = sim[name]
            lines.append(
                f"| {name.replace('_', ' ')} | {r['timed_steps']} | {r['step_s_slowest_rank_total']:.2f} | "
                f"{r['step_s_mean_rank_total']:.2f} | {r['idle_share']:.1%} | {r['token_imbalance']:.3f} | "
                f"{r['cost_imbalance_by_table']:.3f} |"
            )
        lines += ["", f"Step time, estimate ÷ table: {sim['speedup_slowest_rank']:.3f}×"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_LENGTHS))
    p.add_argument("--row-tokens", type=int, default=None, help="tokens per row (default: the longest length)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per length")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--activation-checkpointing", default="full", choices=("off", "selective", "full"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-ranks", type=int, default=0, help="then time plans for this many ranks, both ways")
    p.add_argument("--sim-steps", type=int, default=20, help="timed steps of each simulated plan")
    p.add_argument("--sim-median", type=int, default=2000, help="median document length of the simulated data")
    p.add_argument("--out", type=Path, default=None)
    add_common_args(p)  # --jsonl
    args = p.parse_args(argv)
    args.row_tokens = args.row_tokens or max(args.lengths)
    if args.row_tokens < max(args.lengths):
        p.error(f"--row-tokens {args.row_tokens} is shorter than the longest length {max(args.lengths)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        report = measure(args)
    text = markdown(report)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cost_table.json").write_text(json.dumps(report, indent=2))
        (args.out / "cost_table.md").write_text(text)
    if args.jsonl:
        env, workload = environment(), f"{args.preset}, {args.row_tokens}-token rows"
        metric = "step_time_per_token_median"
        rows = [
            result_row(
                "benchmarks/cost_table.py", f"length{r['length']}, attention {report['attention']}", metric,
                r["us_per_token_median"], "us", env,
                workload=workload,
            )
            for r in report["rows"]
        ]  # fmt: skip
        write_rows(args.jsonl, rows)
    return report


if __name__ == "__main__":
    main()
