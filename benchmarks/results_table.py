"""RESULTS.md's table of latest figures, generated from the measurements kept as data in `benchmarks/results/*.jsonl`.

Each line of a results file is one measured figure: when and where it was measured (`date`, `gpu` or `machine`,
`versions`, `commit`), what (`benchmark`, `workload`, `mode`, `metric`), the figure (`value`, `unit`), and, where the
measurement was a side-by-side, the `peer`, its `peer_value` and the `ratio` as the source quoted it (`ratio_basis`
says which way round). A file lists its records oldest first. The table keeps, for each (benchmark, workload, mode,
GPU or machine), the figures of its latest date (among records of that date, the last one written for each metric).

    python benchmarks/results_table.py            # print the table
    python benchmarks/results_table.py --write    # rewrite it between the markers at the top of RESULTS.md
    python benchmarks/results_table.py --check    # exit 1 when RESULTS.md's table is not what the data gives
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
BEGIN = "<!-- results-table:begin -->"
END = "<!-- results-table:end -->"

# field -> the types its value may take (None: the field may be null when the source does not say)
REQUIRED = {
    "date": (str,),
    "gpu": (str, type(None)),
    "versions": (dict,),
    "commit": (str, type(None)),
    "benchmark": (str,),
    "workload": (str,),
    "mode": (str,),
    "metric": (str,),
    "value": (int, float),
    "unit": (str,),
    "note": (str, type(None)),
}
OPTIONAL = {
    "machine": (str, type(None)),
    "command": (str, type(None)),
    "peer": (str, type(None)),
    "peer_value": (int, float, type(None)),
    "ratio": (int, float, type(None)),
    "ratio_basis": (str, type(None)),
    "run": (str, type(None)),
    "source": (str, type(None)),
}


def record_problems(record: object) -> list[str]:
    """What is wrong with one results record (empty when nothing is)."""
    if not isinstance(record, dict):
        return ["not a JSON object"]
    problems = [f"missing field {name!r}" for name in REQUIRED if name not in record]
    for name, value in record.items():
        types = REQUIRED.get(name) or OPTIONAL.get(name)
        if types is None:
            problems.append(f"unknown field {name!r}")
        elif isinstance(value, bool) or not isinstance(value, types):
            problems.append(f"field {name!r} has a {type(value).__name__}")
    if not problems:
        try:
            datetime.date.fromisoformat(record["date"])
        except ValueError:
            problems.append(f"date {record['date']!r} is not YYYY-MM-DD")
        if record["gpu"] is None and not record.get("machine"):
            problems.append("neither 'gpu' nor 'machine' says where it ran")
        if record.get("ratio") is not None and not record.get("peer"):
            problems.append("a ratio without the peer it is against")
    return problems


def load(results_dir: Path = RESULTS_DIR) -> tuple[list[dict], list[str]]:
    """Every record of every results file (files in name order, lines in order), and every problem found."""
    records, problems = [], []
    for path in sorted(results_dir.glob("*.jsonl")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{where}: not JSON ({e.msg})")
                continue
            problems += [f"{where}: {p}" for p in record_problems(record)]
            if isinstance(record, dict):
                records.append(record)
    return records, problems


def key(record: dict) -> tuple[str, str, str, str]:
    return (record["benchmark"], record["workload"], record["mode"], record["gpu"] or record.get("machine") or "")


def origin(record: dict) -> tuple:
    """Which measurement a record came from: records of one origin were measured together."""
    return (record["date"], record.get("source"), record.get("run"), record.get("command"))


def latest(records: list[dict]) -> dict[tuple[str, str, str, str], list[dict]]:
    """For each key, the figures of its latest measurement: of the records of its latest date, those from the same
    measurement as the last one written (one per metric, the last written), in first-written order."""
    last: dict[tuple, dict] = {}
    for r in records:
        k = key(r)
        if k not in last or r["date"] >= last[k]["date"]:
            last[k] = r
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        k = key(r)
        if origin(r) == origin(last[k]):
            metrics = rows.setdefault(k, {})
            metrics.pop(r["metric"], None)
            metrics[r["metric"]] = r
    return {k: sorted(v.values(), key=lambda r: list(v).index(r["metric"])) for k, v in rows.items()}


def number(value: float | int) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return json.dumps(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def amount(value: float | int, unit: str) -> str:
    if unit == "%":
        return f"{number(value)}%"
    if unit == "x":
        return f"{number(value)}×"
    return f"{number(value)} {unit}"


def figure(r: dict) -> str:
    return f"{r['metric']} {amount(r['value'], r['unit'])}"


def versus(r: dict) -> str:
    if r.get("ratio") is None:
        return ""
    peer = f"{r['peer']} ({amount(r['peer_value'], r['unit'])})" if r.get("peer_value") is not None else r["peer"]
    basis = f" [{r['ratio_basis']}]" if r.get("ratio_basis") else ""
    return f"{r['metric']}: {number(r['ratio'])}× {peer}{basis}"


def table(records: list[dict]) -> str:
    rows = latest(records)
    out = [
        "| benchmark | workload | mode | GPU / machine | date | figures | against the peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in sorted(rows):
        rs = rows[k]
        benchmark, workload, mode, where = k
        figures = "; ".join(figure(r) for r in rs)
        peers = "; ".join(v for v in (versus(r) for r in rs) if v)
        out.append(
            "| " + " | ".join(cell(x) for x in (benchmark, workload, mode, where, rs[0]["date"], figures, peers)) + " |"
        )
    return "\n".join(out)


def block(records: list[dict]) -> str:
    return (
        f"{BEGIN}\n"
        "<!-- generated by `python benchmarks/results_table.py --write` from benchmarks/results/*.jsonl; "
        "edit the data, not this table -->\n\n"
        f"{table(records)}\n\n{END}"
    )


def current_block(text: str) -> str | None:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start : end + len(END)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the table in RESULTS.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when RESULTS.md's table is stale")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--results-md", type=Path, default=RESULTS_MD)
    args = ap.parse_args(argv)

    records, problems = load(args.results_dir)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    new = block(records)
    if not (args.write or args.check):
        print(new)
        return 0
    text = args.results_md.read_text(encoding="utf-8")
    old = current_block(text)
    if old is None:
        print(f"{args.results_md}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    if args.check:
        if old != new:
            print(f"{args.results_md}: the results table is stale; run python benchmarks/results_table.py --write")
            return 1
        return 0
    if old != new:
        args.results_md.write_text(text.replace(old, new, 1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
