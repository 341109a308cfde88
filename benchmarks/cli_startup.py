"""The fixed cost of a plain command: `sftflow data` on a 3-record file, timed end to end as a user runs it.

Rows, in one run on this machine:
- `first`: an empty `PREFECT_HOME` (no database yet); sftflow starts its local Prefect API and creates the database.
- `again`: the same command again (its stages Cached), reusing the running local API.
- `fresh data`: a new output folder (every stage runs), reusing the running local API.
- `prefect ephemeral`: the baseline, the same flow called from Python with Prefect's own temporary server (given a
  600 s budget instead of its default 20 s, which a first start on a loaded 2-core machine exceeds).
- `imports`: `python -c "import sftflow.flows.data"` alone.

Usage: `python benchmarks/cli_startup.py [--append-results] [--jsonl FILE]`. Each row is the median of `--repeat` runs
(the first row runs once: it needs an empty PREFECT_HOME). `--jsonl FILE` appends each row's median to FILE as result
rows (`harness.py`), the runs on the local API against Prefect's ephemeral server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

RESULTS = Path(__file__).with_name("RESULTS.md")
EPHEMERAL = """
import sys
from sftflow.flows.config import DataConfig
from sftflow.flows.data import run_data
run_data(DataConfig(sources=[sys.argv[1]], tokenizer=sys.argv[2], render={"template": "chatml"}), sys.argv[3])
"""


def _timed(args: list[str], env: dict[str, str]) -> float:
    timer = harness.Timer().start()
    result = subprocess.run(args, env=env, capture_output=True, text=True)
    elapsed = timer.stop()
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--append-results", action="store_true")
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()

    from sftflow.flows.local_api import state_dir, stop_server
    from sftflow.tasks.demo import write_demo

    root = Path(tempfile.mkdtemp(prefix="sftflow-cli-startup-"))
    demo = write_demo(root / "demo", n=3)
    home = root / "prefect-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", SFTFLOW_API_IDLE_TIMEOUT="600")
    exe = str(Path(sys.executable).with_name("sftflow"))
    data = [exe, "data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"]), "--template", "chatml"]
    rows = []
    try:
        rows.append(("first (empty PREFECT_HOME)", [_timed([*data, "--out", str(root / "out")], env)]))
        rows.append(
            (
                "again (Cached, API running)",
                [_timed([*data, "--out", str(root / "out")], env) for _ in range(args.repeat)],
            )
        )
        fresh = [_timed([*data, "--out", str(root / f"new{i}")], env) for i in range(args.repeat)]
        rows.append(("fresh data (API running)", fresh))
        base_env = {k: v for k, v in env.items() if k != "PREFECT_HOME"}
        base = []
        for i in range(args.repeat):
            base_env["PREFECT_HOME"] = str(root / f"ephemeral-home{i}")
            base_env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "600"
            argv = [sys.executable, "-c", EPHEMERAL, str(demo["data"]), str(demo["tokenizer"]), str(root / f"eph{i}")]
            base.append(_timed(argv, base_env))
        rows.append(("prefect ephemeral, empty PREFECT_HOME (baseline)", base))
        imports = [_timed([sys.executable, "-c", "import sftflow.flows.data"], env) for _ in range(args.repeat)]
        rows.append(("imports only", imports))
    finally:
        stop_server(state_dir(home))
        shutil.rmtree(root, ignore_errors=True)

    load = os.getloadavg()[0]
    env = harness.environment("prefect")
    lines = [
        f"### `sftflow data` on 3 records, {env['date']}, {env['machine']} (load {load:.1f} at the end), "
        f"Python {env['versions']['python']}",
        "",
        "| run | median s | all runs s |",
        "|---|---|---|",
    ]
    for name, times in rows:
        lines.append(f"| {name} | {statistics.median(times):.1f} | {', '.join(f'{t:.1f}' for t in times)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    harness.write_rows(args.jsonl, result_rows(rows, args.repeat, load, env))
    if args.append_results:
        with open(RESULTS, "a") as f:
            f.write("\n" + table)


def result_rows(rows: list[tuple[str, list[float]]], repeat: int, load: float, env: dict) -> list[dict]:
    """Each row's median wall time; the runs on the running local API against Prefect's ephemeral server."""
    medians = {name: statistics.median(times) for name, times in rows}
    peer_name = next(name for name in medians if name.startswith("prefect ephemeral"))
    figures = []
    for name, median in medians.items():
        peer = {}
        if "API running" in name:
            peer = dict(peer=peer_name, peer_value=medians[peer_name], ratio=medians[peer_name] / median,
                        ratio_basis="peer s / this s")  # fmt: skip
        runs = 1 if name.startswith("first") else repeat
        figures.append(harness.result_row(
            "benchmarks/cli_startup.py", name, "wall time (median)", median, "s", env,
            workload="sftflow data on 3 records", note=f"median of {runs} run(s); load {load:.1f} at the end", **peer,
        ))  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
