"""The throughput report: its Markdown table and its figures as result rows (`harness`)."""

from __future__ import annotations


def markdown(report: dict) -> str:
    results = {r["mode"]: r for r in report["results"] if r.get("tokens_per_s")}
    a, b = results.get("A"), results.get("B")
    lines = [
        "| mode | what | tokens/s (median) | aggregate tokens/s | MFU | peak GiB | × A | × B | timed steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if not r.get("tokens_per_s"):
            lines.append(f"| {r['mode']} | failed: {r.get('error', '?')[:120]} | | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        xa = f"{tps / a['tokens_per_s']:.2f}" if a else "-"
        xb = f"{tps / b['tokens_per_s']:.2f}" if b else "-"
        lines.append(
            f"| {r['mode']} | {r['what']} | {tps:,.0f} | {r['tokens_per_s_aggregate']:,.0f} | {mfu} | {peak} | "
            f"{xa} | {xb} | {r['timed_steps']}" + (f" ({r['oom_steps']} OOM)" if r.get("oom_steps") else "") + " |"
        )
    return "\n".join(lines) + "\n"


# a mode's figures in the result rows: report key -> (metric, unit)
FIGURES = {
    "tokens_per_s": ("tokens_per_s", "tokens/s"),
    "tokens_per_s_aggregate": ("tokens_per_s_aggregate", "tokens/s"),
    "mfu": ("mfu", "fraction"),
    "peak_gib": ("peak_memory", "GiB"),
    "step_s_median": ("step_time_median", "s"),
}


def result_rows(report: dict) -> list[dict]:
    """One row per figure of each mode that ran (`harness.result_row`), the workload named by its preset and row
    size: `llama1b, 16384-token rows`."""
    from harness import environment, result_row

    env = environment()
    args = report["args"]
    benchmark, workload = "benchmarks/train_throughput.py", f"{args['preset']}, {args['row_tokens']}-token rows"
    rows = []
    for r in report["results"]:
        if not r.get("tokens_per_s"):
            continue
        for key, (metric, unit) in FIGURES.items():
            if r.get(key) is not None:
                rows.append(result_row(benchmark, r["mode"], metric, r[key], unit, env, workload=workload))
    return rows
