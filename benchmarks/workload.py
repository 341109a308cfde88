"""Run a shipped training workload end to end through the `sftflow` commands, and report what a user gets.

    python benchmarks/workload.py llama8b-16k [--steps 160] [--warmup 10] [--baseline MODE] [--out DIR] [--set K=V ...]
                                              [--jsonl FILE]

`benchmarks/workloads/NAME.yaml` is an ordinary run config (the file `sftflow run` and the stage commands take). This
script writes mock documents of the workload's shape as a dataset index (random tokens, lognormal lengths, loss on
the trailing part of each turn: `sftflow.tasks.train.mock`), then runs, as separate processes, exactly what a user
types:

    sftflow plan  --config NAME.yaml --data DIR/data --out DIR/plan
    sftflow train --config NAME.yaml --data DIR/data --plan DIR/plan --out DIR/run --max-steps STEPS

(`python -m sftflow.flows` where the console script is not installed). Both run without Prefect on a bare GPU image:
a dataset index is planned and trained without the pipeline's cache. It prints one JSON summary, from the run's
`metrics.jsonl`: median tokens/s and MFU of the steps after `--warmup`; their aggregate (their tokens over the sum of
their step times); the end-to-end rate (every token over the `sftflow train` command's wall time, start-up and
compilation included); peak memory; and the activation checkpointing `auto` chose. With `--baseline MODE` it then
runs `benchmarks/train_throughput.py --modes MODE` (under torchrun on as many ranks as the config trains on) on
documents of the same shape, rows and timed steps, and adds its numbers and the two ratios: one call per comparison.
`--jsonl FILE` appends the summary's figures (and the baseline's) to FILE as result rows (`harness.py`) once the call
is done.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import harness

WORKLOADS = Path(__file__).resolve().parent / "workloads"
# Document shapes of the workloads (the run configs hold no data section: the documents are mock ones).
DOCS = {
    "packed": dict(median_length=600, sigma=1.0, min_length=16, max_length=4096),
    "long": dict(median_length=16384, sigma=0.7, min_length=4096, max_length=65536),
    "tiny": dict(median_length=24, sigma=1.0, min_length=4, max_length=96),  # the CPU check's 256-token rows
}
WORKLOAD_DOCS = {
    "llama8b-16k": "packed",
    "llama1b-16k": "packed",
    "llama1b-64k": "long",
    "llama8b-64k": "long",
    "tiny-cpu": "tiny",
}
# The same model shapes in benchmarks/train_throughput.py, whose modes are the baselines.
WORKLOAD_PRESET = {
    "llama8b-16k": "llama8b",
    "llama1b-16k": "llama1b",
    "llama1b-64k": "llama1b",
    "llama8b-64k": "llama8b",
}
BASELINES = Path(__file__).resolve().parent / "train_throughput.py"
BENCHMARK = "benchmarks/workload.py"


def sftflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "sftflow.flows", *args]


def mock_documents(docs: str, vocab_size: int, tokens: int, seed: int):
    """A mock source of `docs`-shaped documents holding about `tokens` tokens, with a tenth more for the planner's
    last partial rows."""
    from sftflow.tasks.train.mock import MockConfig, sample_lengths

    shape = dict(DOCS[docs], vocab_size=vocab_size, loss_spans=True, seed=seed)
    probe = sample_lengths(MockConfig(num_docs=4096, **shape))
    num_docs = max(8, math.ceil(1.1 * tokens / float(probe.mean())))
    return MockConfig(num_docs=num_docs, **shape)


def run(cmd: list[str], log: Path) -> tuple[int, float, str]:
    """Run `cmd` with its output going to `log` as it is written (a run cut short still leaves what it printed);
    its exit code, wall time and output."""
    timer = harness.Timer().start()
    with log.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = timer.stop()
    return proc.returncode, wall, log.read_text()


def checkpointing_chosen(run_dir: Path) -> tuple[str | None, str | None]:
    """What the run was asked for (`auto`, `full`, ...) and the layers it checkpointed, as the launcher resolved them
    into `RUN_DIR/run.json`; (None, None) where there is no such file."""
    from sftflow.tasks.train.activations import checkpointed_layers
    from sftflow.tasks.train.resolved import read_resolved

    try:
        resolved = read_resolved(run_dir)
    except (OSError, ValueError) as err:
        print(f"[workload] {run_dir}: no resolved run to read the activation checkpointing from ({err})", flush=True)
        return None, None
    choice = resolved.activation_checkpointing
    count = checkpointed_layers(choice.value, resolved.num_layers)
    return str(choice.setting), f"{count} of {resolved.num_layers} layers"


def summarize(metrics: Path, warmup: int, wall_s: float) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > warmup]
    if not timed:
        raise SystemExit(f"{metrics}: no steps after the {warmup} warm-up steps")
    setting, chosen = checkpointing_chosen(metrics.parent)
    peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
    reserved = [r["peak_reserved_gib"] for r in records if r.get("peak_reserved_gib") is not None]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "steps": len(records),
        "timed_steps": len(timed),
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in timed)),
        "tokens_per_s_aggregate": round(sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)),
        "tokens_per_s_end_to_end": round(sum(r["tokens"] for r in records) / wall_s),
        "train_command_wall_s": round(wall_s, 1),
        "mfu_median": round(statistics.median(mfus), 4) if mfus else None,
        "peak_memory_gib": round(max(peaks), 1) if peaks else None,
        "peak_reserved_gib": round(max(reserved), 1) if reserved else None,
        "activation_checkpointing_setting": setting,
        "activation_checkpointing_auto": chosen,  # what the setting resolved to (the key's name is historical)
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }


def run_baseline(args, cfg, mode: str, work: Path) -> dict:
    """`benchmarks/train_throughput.py --modes MODE` on documents of the workload's shape (its own draw, same seed),
    the same rows, ranks (torchrun for several) and number of timed steps; its result."""
    ranks = cfg.train.nproc * cfg.train.nnodes
    preset = "tiny" if cfg.train.model == "tiny-llama" else WORKLOAD_PRESET[args.workload]
    shape = DOCS[WORKLOAD_DOCS[args.workload]]
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd = [*launch, str(BASELINES), "--preset", preset, "--modes", mode]
    cmd += ["--device", "cpu" if cfg.train.device == "cpu" else "cuda", "--row-tokens", str(cfg.plan.tokens_per_rank)]
    cmd += ["--median-length", str(shape["median_length"]), "--sigma", str(shape["sigma"])]
    cmd += ["--min-length", str(shape["min_length"]), "--max-length", str(shape["max_length"])]
    cmd += ["--steps", str(args.steps - args.warmup), "--warmup", str(args.warmup)]
    cmd += ["--compile-warmup", str(args.warmup), "--breakdown-steps", "0", "--profile-steps", "0"]
    cmd += ["--seed", str(args.seed), "--out", str(work / "baseline")]
    code, wall, out = run(cmd, work / "baseline.log")
    if code != 0:
        raise SystemExit(f"baseline {mode} failed ({code}):\n{out[-4000:]}")
    (result,) = json.loads((work / "baseline" / "train_throughput.json").read_text())["results"]
    if "error" in result:
        raise SystemExit(f"baseline {mode} failed: {result['error']}")
    return {
        "mode": mode,
        "what": result["what"],
        "timed_steps": result["timed_steps"],
        "tokens_per_s_median": round(result["tokens_per_s"]),
        "tokens_per_s_aggregate": round(result["tokens_per_s_aggregate"]),
        "peak_memory_gib": None if result["peak_gib"] is None else round(result["peak_gib"], 1),
        "command_wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=sorted(WORKLOAD_DOCS))
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median and aggregate")
    p.add_argument("--work", type=Path, default=Path("/tmp/sftflow-workload"))
    p.add_argument("--out", type=Path, default=None, help="copy the summary and the logs here")
    p.add_argument("--set", action="append", default=[], help="a config override passed to both commands")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        default=None,
        metavar="MODE",
        help="then run benchmarks/train_throughput.py's MODE (Cac, Clac, Cn, ...) on the same shape, in this call",
    )
    harness.add_common_args(p)  # --jsonl
    args = p.parse_args()
    # `timeout` (benchmarks/fa4_suite.sh) stops a step with SIGTERM: raised as SystemExit, so what was measured is kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from sftflow.flows.config import load_config, parse_assignments
    from sftflow.tasks.train.mock import write_mock_index

    config_path = WORKLOADS / f"{args.workload}.yaml"
    overrides = [a for kv in args.set for a in ("--set", kv)]
    cfg = load_config(config_path, parse_assignments(args.set))  # read as the CLI reads them (null, lists)
    work = args.work / args.workload
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    model = cfg.train.model
    if model.endswith(".json"):
        vocab_size = json.loads(Path(model).read_text())["vocab_size"]
    else:  # a preset (a CPU check of this script): its stand-in vocabulary
        vocab_size = 256
    ranks = cfg.train.nproc * cfg.train.nnodes
    tokens = args.steps * cfg.plan.tokens_per_rank * ranks * (cfg.plan.micro_batches_per_step or 1)
    mock = mock_documents(WORKLOAD_DOCS[args.workload], vocab_size, tokens, args.seed)
    timer = harness.Timer().start()
    write_mock_index(mock, work / "data")
    data_s = timer.stop()

    common = ["--config", str(config_path), "--data", str(work / "data"), *overrides]
    code, plan_s, out = run(sftflow("plan", *common, "--out", str(work / "plan"), "--stats-json"), work / "plan.log")
    if code != 0:
        raise SystemExit(f"sftflow plan failed ({code}):\n{out[-4000:]}")
    train = sftflow("train", *common, "--plan", str(work / "plan"), "--out", str(work / "run"))
    code, train_s, out = run([*train, "--max-steps", str(args.steps)], work / "train.log")
    if code != 0:
        raise SystemExit(f"sftflow train failed ({code}):\n{out[-6000:]}")
    summary = {
        "workload": args.workload,
        "config": str(config_path.relative_to(WORKLOADS.parent.parent)),
        "overrides": list(args.set),  # --set, so a saved summary says which variant of the config it measured
        "documents": mock.num_docs,
        "data_s": round(data_s, 1),
        "plan_s": round(plan_s, 1),
        **summarize(work / "run" / "metrics.jsonl", args.warmup, train_s),
    }
    # sftflow's numbers are reported before the baseline runs, so that a run cut short (a GPU taken back) keeps them.
    report(args, work, summary)
    if args.baseline is not None:
        try:
            baseline = run_baseline(args, cfg, args.baseline, work)
        except BaseException:  # a baseline that fails, or a limit's SIGTERM, leaves sftflow's own rows
            harness.write_rows(args.jsonl, result_rows(summary, ranks))
            raise
        summary["baseline"] = baseline
        summary["ratio_median"] = round(summary["tokens_per_s_median"] / baseline["tokens_per_s_median"], 3)
        summary["ratio_aggregate"] = round(summary["tokens_per_s_aggregate"] / baseline["tokens_per_s_aggregate"], 3)
        report(args, work, summary)
    harness.write_rows(args.jsonl, result_rows(summary, ranks))


# summary key -> (metric, unit), and the baseline's key for the figures it has too
FIGURES = {
    "tokens_per_s_median": ("tokens/s median", "tokens/s", "tokens_per_s_median"),
    "tokens_per_s_aggregate": ("tokens/s aggregate", "tokens/s", "tokens_per_s_aggregate"),
    "tokens_per_s_end_to_end": ("tokens/s end to end", "tokens/s", None),
    "mfu_median": ("MFU median (worker estimate, of the datasheet peak)", "%", None),
    "peak_memory_gib": ("peak allocated memory", "GiB", "peak_memory_gib"),
}


def result_rows(summary: dict, ranks: int) -> list[dict]:
    """The summary's figures as result rows, sftflow's against the baseline's where it ran."""
    env = harness.environment()
    baseline = summary.get("baseline")
    workload = f"{summary['workload']} ({summary['config']}, {ranks} rank(s))"
    row = dict(env=env, workload=workload, note="; ".join(summary["overrides"]) or None)
    checkpointing = f"{summary['activation_checkpointing_setting']}: {summary['activation_checkpointing_auto']}"
    mode = "sftflow train" + (f", activation checkpointing {checkpointing}"
                              if summary["activation_checkpointing_auto"] else "")  # fmt: skip
    rows = []
    for key, (metric, unit, peer_key) in FIGURES.items():
        if summary.get(key) is None:
            continue
        peer = {}
        if baseline and peer_key and baseline.get(peer_key):
            basis = "this / peer" if unit == "tokens/s" else "this GiB / peer GiB"
            peer = dict(peer=f"{baseline['mode']}: {baseline['what']}", peer_value=baseline[peer_key],
                        ratio=round(summary[key] / baseline[peer_key], 3), ratio_basis=basis)  # fmt: skip
        value = round(100 * summary[key], 1) if unit == "%" else summary[key]  # the summary's MFU is a fraction
        rows.append(harness.result_row(BENCHMARK, mode, metric, value, unit, **row, **peer))
    if baseline:
        for metric, unit, peer_key in FIGURES.values():
            if peer_key and baseline.get(peer_key) is not None:
                rows.append(harness.result_row(BENCHMARK, f"{baseline['mode']}: {baseline['what']}", metric,
                                               baseline[peer_key], unit, **row))  # fmt: skip
    return rows


def report(args, work: Path, summary: dict) -> None:
    """Print the summary and, with --out, write it there with the logs and the run's metrics."""
    print(f"[workload] {json.dumps(summary)}", flush=True)
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.workload}.json").write_text(json.dumps(summary, indent=2))
    for name in ("plan.log", "train.log", "baseline.log"):
        if (work / name).is_file():
            (args.out / f"{args.workload}-{name}").write_text((work / name).read_text())
    (args.out / f"{args.workload}-metrics.jsonl").write_text((work / "run" / "metrics.jsonl").read_text())


if __name__ == "__main__":
    main()
