"""Data prep scaling: `sft-data` records/s on the Dask runner with 1 vs 2 worker processes (threads for reference).

The input is the largest conversational dataset in ../shared/data (sharegpt-zh-1k, JSONL) repeated to `--records`
lines in one file, which sharding splits into byte ranges (`--shard-bytes`); without the shared data, generated demo
conversations (`sftflow.tasks.demo.write_demo`) and their tokenizer stand in. Each run gets a fresh work folder, so
nothing is cached, and runs on Prefect's ephemeral API in a temporary PREFECT_HOME, as `sftflow data` does.

Tokenizer threads are pinned to one per process (RAYON_NUM_THREADS=1), so a worker is one core. Two times per run:

    map    first render task start → last pbin task end (task-run times from the Prefect API): the sharded,
           parallel part, which is what the runner scales; "tasks running" is the mean number of per-shard tasks
           running during it (task-seconds / map seconds), which shows whether workers did run side by side
    total  the whole flow call: hashing and sharding the source, starting the cluster (Dask: worker processes import
           the stack), the map, and the serial index (hash, dedup, split) in the flow process

    python benchmarks/data_prep_scaling.py [--records 200000] [--shard-bytes 8000000] [--record] [--jsonl FILE]

`--jsonl FILE` appends each run's map records/s (against dask with 1 worker) and total seconds to FILE as result rows
(`harness.py`).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
if "PREFECT_HOME" not in os.environ:  # not setdefault: Dask's spawned workers import this module again
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="sftflow-bench-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import harness  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SFTFLOW_SHARED_DATA", REPO.parent / "shared" / "data"))
RUNS = (("threads", 2), ("dask", 1), ("dask", 2))
BENCHMARK = "benchmarks/data_prep_scaling.py"


def _inputs(work: Path, records: int) -> tuple[Path, Path, str, int]:
    """(source JSONL repeated to `records` lines, tokenizer folder, dataset name, distinct records)."""
    source = SHARED / "datasets" / "sharegpt-zh-1k" / "sharegpt_zh_1K_format.jsonl"
    tokenizer = SHARED / "tokenizers" / "smollm2-135m-chatml"
    name = "sharegpt-zh-1k"
    if not (source.is_file() and tokenizer.is_dir()):
        from sftflow.tasks.demo import write_demo

        demo = write_demo(work / "demo", n=2000)
        source, tokenizer, name = demo["data"], demo["tokenizer"], "demo (generated)"
    lines = [line for line in source.read_bytes().split(b"\n") if line.strip()]
    out = work / "data.jsonl"
    with open(out, "wb") as f:
        for i in range(records):
            f.write(lines[i % len(lines)] + b"\n")
    return out, tokenizer, name, len(lines)


def _start_api() -> None:
    """Start the ephemeral API before timing, so its start-up is not charged to the first run."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.hello()


def _map_seconds(flow_run_id) -> tuple[float, float]:
    """Seconds from the first per-shard task's start to the last one's end, and the mean number running meanwhile."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    mapped = [r for r in runs if not r.task_key.startswith("index")]
    span = (max(r.end_time for r in mapped) - min(r.start_time for r in mapped)).total_seconds()
    busy = sum((r.end_time - r.start_time).total_seconds() for r in mapped)
    return span, busy / span


def _run(source: Path, tokenizer: Path, work: Path, runner: str, workers: int, shard_bytes: int) -> dict:
    from sftflow.flows.config import DataConfig, SFTConfig
    from sftflow.flows.data import sft_data

    config = DataConfig(
        sources=[str(source)],
        tokenizer=str(tokenizer),
        render={"format": "sharegpt", "template": "chatml", "on_bad_record": "reject"},
        task_runner=runner,
        workers=workers,
        shard_bytes=shard_bytes,
    )
    timer = harness.Timer().start()
    state = sft_data(config=SFTConfig(work_dir=str(work), data=config), return_state=True)
    total = timer.stop()
    result = state.result()
    return {
        "runner": runner,
        "workers": workers,
        "shards": len(result.pbin),
        "records": sum(r.num_records + r.num_rejected for r in result.rendered),
        "tokens": sum(t.num_tokens for t in result.tokenized),
        **dict(zip(("map_s", "concurrency"), _map_seconds(state.state_details.flow_run_id), strict=True)),
        "total_s": total,
        "pbin_sha256": [p.sha256 for p in result.pbin],
        # index.json names each run's own shard paths; its arrays' hashes are what must match.
        "index_arrays_sha256": json.loads(Path(result.index.path).read_text())["arrays"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000, help="lines in the repeated source file")
    parser.add_argument("--shard-bytes", type=int, default=8_000_000)
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sftflow-bench-scaling-"))
    try:
        source, tokenizer, name, distinct = _inputs(work, args.records)
        _start_api()
        load_before = os.getloadavg()[0]
        rows = []
        for runner, workers in RUNS:
            row = _run(source, tokenizer, work / f"{runner}-{workers}", runner, workers, args.shard_bytes)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "sha256" not in k}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    first = rows[0]
    identical = all(r["pbin_sha256"] == first["pbin_sha256"] for r in rows) and all(
        r["index_arrays_sha256"] == first["index_arrays_sha256"] for r in rows
    )
    base = next(r for r in rows if (r["runner"], r["workers"]) == ("dask", 1))
    env = harness.environment("prefect", "prefect-dask", "dask")
    versions = harness.versions_line(env, "python", "prefect", "prefect_dask", "dask", "transformers")
    header = (
        f"{time.strftime('%Y-%m-%d')}: {name} ({distinct} distinct) repeated to {rows[0]['records']} records, "
        f"{rows[0]['tokens']} tokens, {rows[0]['shards']} shards of ~{args.shard_bytes / 1e6:g} MB; "
        f"{env['machine']} visible; {versions.replace('prefect_dask', 'prefect-dask')}"
    )
    columns = "runner | workers | map records/s | map tokens/s | map s | tasks running | total records/s | total s"
    table = [f"| {columns} | map vs dask×1 |", "|---" * 9 + "|"]
    for r in rows:
        table.append(
            f"| {r['runner']} | {r['workers']} | {r['records'] / r['map_s']:.0f} | {r['tokens'] / r['map_s']:.0f} | "
            f"{r['map_s']:.1f} | {r['concurrency']:.2f} | {r['records'] / r['total_s']:.0f} | {r['total_s']:.1f} | "
            f"{base['map_s'] / r['map_s']:.2f}x |"
        )
    footer = (
        f"Outputs byte-identical across runs (pbin shards and index arrays): {identical}. "
        f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other jobs included)."
    )
    print(header, *table, footer, sep="\n")
    harness.write_rows(args.jsonl, result_rows(rows, base, name, args.shard_bytes, identical, env))
    if args.record:
        with open(REPO / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(f"\n## Data preparation scaling, {header}\n\n" + "\n".join(table) + f"\n\n{footer}\n")
    if not identical:
        raise SystemExit("outputs differ between runners")


def result_rows(rows: list[dict], base: dict, name: str, shard_bytes: int, identical: bool, env: dict) -> list[dict]:
    """Each run's map records/s (against dask with one worker) and its flow call's seconds."""
    workload = f"{name} repeated to {rows[0]['records']:,} records ({rows[0]['tokens']:,} tokens)"
    note = f"{rows[0]['shards']} shards of ~{shard_bytes / 1e6:g} MB; outputs byte-identical across runs: {identical}"
    peer_name, peer_rate = "dask, 1 worker", base["records"] / base["map_s"]
    figures = []
    for r in rows:
        mode, rate = f"{r['runner']}, {r['workers']} worker(s)", r["records"] / r["map_s"]
        peer = {}
        if r is not base:
            peer = dict(peer=peer_name, peer_value=peer_rate, ratio=rate / peer_rate, ratio_basis="this / peer")
        row = dict(env=env, workload=workload, note=note)
        figures += [
            harness.result_row(BENCHMARK, mode, "map records/s", rate, "records/s", **row, **peer),
            harness.result_row(BENCHMARK, mode, "total wall time", r["total_s"], "s", **row),
        ]
    return figures


if __name__ == "__main__":
    main()
