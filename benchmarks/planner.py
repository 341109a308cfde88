"""Planner benchmark: ours vs naive padding, first-fit decreasing, best-fit decreasing and multipack V2 (token LPT).

    python benchmarks/planner.py [--num-docs 1000000] [--skip-real] [--no-record] [--jsonl FILE]

All methods see the same lengths in the same run, at `tokens_per_rank=8192`, 8 ranks, one micro-batch per step,
and cost `L + L²/8192` per document. Rows are grouped `num_ranks` at a time into micro-batches in each method's own
output order; imbalance is max/mean over the ranks of a micro-batch (mean and p99 over micro-batches).
Efficiency is real tokens / slot tokens: `rows × 8192` for the packers, `Σ 8 × longest` for naive padding (whose rows
ignore the capacity). Length sets:
  - `lognormal`: `--num-docs` lengths, median 600, sigma 1, clipped to [1, 8192] (seed 0);
  - `real`: the five conversation datasets in ../shared/data rendered with the SmolLM2 ChatML template and tokenized
    (documents longer than 8192 dropped, as the index would). Skipped when the folder is absent.
FFD and BFD are exact, vectorised over runs of equal lengths; multipack V2 follows the published loop (binary search
on the prefix, LPT check) in plain Python, without numba, so its time is not comparable to a numba build.
The table is printed and appended to benchmarks/RESULTS.md under "## Planner"; `--jsonl FILE` appends each method's
packing efficiency, cost imbalance and planning time to FILE as result rows (`harness.py`).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
from pathlib import Path

import harness
import numpy as np

from sftflow.tasks.plan.planner import PlanConfig, plan

CAPACITY = 8192
NUM_RANKS = 8
COST_B = 1.0 / CAPACITY
ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SFTFLOW_SHARED_DATA", ROOT.parent / "shared" / "data"))


# ---------------------------------------------------------------------------------------------------------------------
# baselines: each returns (doc_ids, row_ptr) with rows in the order they go to ranks, num_ranks at a time
# ---------------------------------------------------------------------------------------------------------------------


def naive_padding(lengths: np.ndarray, stream: np.ndarray, per_rank: int = 8):
    """`per_rank` consecutive documents per rank, padded to the longest."""
    row_ptr = np.minimum(np.arange(0, len(stream) + per_rank, per_rank), len(stream))
    return stream, np.unique(row_ptr)


def _bins_to_csr(sorted_docs: np.ndarray, bin_of_item: np.ndarray, num_bins: int):
    order = np.argsort(bin_of_item, kind="stable")
    row_ptr = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of_item, minlength=num_bins), out=row_ptr[1:])
    return sorted_docs[order], row_ptr


def first_fit_decreasing(lengths: np.ndarray, stream: np.ndarray):
    """Exact FFD: a run of k equal items goes, leftmost first, into the bins that can take it, filling each."""
    docs = stream[np.argsort(-lengths[stream], kind="stable")]
    sizes = lengths[docs]
    remaining = np.zeros(len(docs), dtype=np.int64)
    bin_of_item = np.empty(len(docs), dtype=np.int64)
    num_bins = 0
    values, starts, counts = np.unique(-sizes, return_index=True, return_counts=True)
    for value, start, count in zip(-values, starts, counts, strict=True):
        cand = np.flatnonzero(remaining[:num_bins] >= value)
        take = remaining[cand] // value
        cum = np.cumsum(take)
        if len(cand) and cum[-1] >= count:
            last = int(np.searchsorted(cum, count))
            take = take[: last + 1].copy()
            take[-1] -= cum[last] - count
            cand = cand[: last + 1]
        placed_bins = np.repeat(cand, take)
        rest = count - len(placed_bins)
        per_new = CAPACITY // value
        new_bins = num_bins + np.arange(rest) // per_new
        bins = np.concatenate([placed_bins, new_bins])
        bin_of_item[start : start + count] = bins
        np.subtract.at(remaining, placed_bins, value)
        if rest:
            opened = -(-rest // per_new)
            remaining[num_bins : num_bins + opened] = CAPACITY - value * np.bincount(new_bins - num_bins)
            num_bins += opened
    return _bins_to_csr(docs, bin_of_item, num_bins)


def best_fit_decreasing(lengths: np.ndarray, stream: np.ndarray):
    """Exact BFD (ties: any bin): bins bucketed by remaining capacity, a Python-int bitmap finds the tightest bucket."""
    docs = stream[np.argsort(-lengths[stream], kind="stable")]
    sizes = lengths[docs]
    buckets: list[list[int]] = [[] for _ in range(CAPACITY + 1)]
    bitmap = 0
    num_bins = 0
    fills: list[tuple[int, int]] = []  # (bin, items) in item order
    values, counts = np.unique(-sizes, return_counts=True)
    for value, count in zip((-values).tolist(), counts.tolist(), strict=True):
        while count:
            above = bitmap >> value
            if above == 0:  # open bins, each filled with as many as fit
                per_new = CAPACITY // value
                while count:
                    take = min(per_new, count)
                    fills.append((num_bins, take))
                    rem = CAPACITY - take * value
                    buckets[rem].append(num_bins)
                    bitmap |= 1 << rem
                    num_bins += 1
                    count -= take
                break
            r = value + (above & -above).bit_length() - 1
            bucket = buckets[r]
            per_bin = r // value
            while bucket and count:
                b = bucket.pop()
                take = min(per_bin, count)
                fills.append((b, take))
                rem = r - take * value
                buckets[rem].append(b)
                bitmap |= 1 << rem
                count -= take
            if not bucket:
                bitmap &= ~(1 << r)
    fill_bins, fill_counts = np.array(fills, dtype=np.int64).T
    return _bins_to_csr(docs, np.repeat(fill_bins, fill_counts), num_bins)


def _lpt(sizes: list[int], n: int, capacity: int, result: bool):
    heap = [(0, i) for i in range(n)]
    bins: list[list[int]] = [[] for _ in range(n)]
    for index, size in sorted(enumerate(sizes), key=lambda t: -t[1]):
        load, b = heap[0]
        if load + size > capacity:
            return None
        heapq.heapreplace(heap, (load + size, b))
        if result:
            bins[b].append(index)
    return bins


def multipack_v2(lengths: np.ndarray, stream: np.ndarray, n: int = NUM_RANKS):
    """Multipack V2 as published: binary-search the longest prefix of the stream that LPT packs into `n` bins of
    `CAPACITY` tokens, emit it as one micro-batch, repeat. (The published sampler drops the last, incomplete batch;
    we keep it so every method plans every document.)"""
    sizes = lengths[stream].tolist()
    cumsum = np.cumsum(lengths[stream])
    start, total = 0, len(sizes)
    doc_rows: list[np.ndarray] = []
    while start < total:
        before = int(cumsum[start - 1]) if start else 0
        hi = min(total - start, int(np.searchsorted(cumsum[start:], before + CAPACITY * n, "right")) + 1) + 1
        lo = 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _lpt(sizes[start : start + mid], n, CAPACITY, result=False) is not None:
                lo = mid
            else:
                hi = mid
        bins = _lpt(sizes[start : start + lo], n, CAPACITY, result=True)
        doc_rows.extend(stream[start + np.array(b, dtype=np.int64)] for b in bins)
        start += lo
    row_ptr = np.zeros(len(doc_rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in doc_rows], out=row_ptr[1:])
    return np.concatenate(doc_rows), row_ptr


def shuffled_bins(pack):
    """`pack`'s bins in a seeded random order: what a training sampler must do with FFD/BFD bins, which otherwise
    come out sorted by length (a fixed curriculum in which consecutive bins are alike)."""

    def shuffled(lengths: np.ndarray, stream: np.ndarray):
        doc_ids, row_ptr = pack(lengths, stream)
        order = np.random.default_rng(1).permutation(len(row_ptr) - 1)
        rows = [doc_ids[row_ptr[i] : row_ptr[i + 1]] for i in order]
        new_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=new_ptr[1:])
        return np.concatenate(rows), new_ptr

    return shuffled


def ours(lengths: np.ndarray, stream: np.ndarray, cost_b: float = COST_B):
    cfg = PlanConfig(
        num_ranks=NUM_RANKS, tokens_per_rank=CAPACITY, micro_batches_per_step=1, cost_per_token_pair=cost_b
    )
    arrays, _ = plan(lengths, lengths - 1, cfg)
    return arrays.doc_ids, arrays.row_ptr


# ---------------------------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------------------------


def metrics(lengths: np.ndarray, doc_ids: np.ndarray, row_ptr: np.ndarray, padded: bool) -> dict:
    num_rows = len(row_ptr) - 1
    num_rows_padded = -(-num_rows // NUM_RANKS) * NUM_RANKS
    row = np.repeat(np.arange(num_rows), np.diff(row_ptr))
    doc_length = lengths[doc_ids].astype(np.float64)
    tokens = np.bincount(row, weights=doc_length, minlength=num_rows_padded)
    if padded:
        longest = np.zeros(num_rows_padded)
        np.maximum.at(longest, row, doc_length)
        count = np.bincount(row, minlength=num_rows_padded)
        compute, cost = count * longest, count * (longest + COST_B * longest**2)
        slots = compute.sum()
    else:
        compute = tokens
        cost = tokens + COST_B * np.bincount(row, weights=doc_length**2, minlength=num_rows_padded)
        slots = num_rows_padded * CAPACITY

    def imbalance(x):
        x = x.reshape(-1, NUM_RANKS)
        mean = x.mean(axis=1)
        ratio = x[mean > 0].max(axis=1) / mean[mean > 0]
        return float(ratio.mean()), float(np.percentile(ratio, 99))

    assert len(doc_ids) == len(lengths) == len(np.unique(doc_ids)), "every document planned exactly once"
    token_mean, token_p99 = imbalance(compute)
    cost_mean, cost_p99 = imbalance(cost)
    return {
        "efficiency": float(tokens.sum() / slots),
        "token_imbalance": token_mean,
        "token_imbalance_p99": token_p99,
        "cost_imbalance": cost_mean,
        "cost_imbalance_p99": cost_p99,
        "micro_batches": num_rows_padded // NUM_RANKS,
    }


METHODS = [
    ("naive padding (8/rank)", naive_padding, True),
    ("first-fit decreasing (length-sorted bins)", first_fit_decreasing, False),
    ("best-fit decreasing (length-sorted bins)", best_fit_decreasing, False),
    ("first-fit decreasing, bins shuffled", shuffled_bins(first_fit_decreasing), False),
    ("best-fit decreasing, bins shuffled", shuffled_bins(best_fit_decreasing), False),
    ("multipack V2 (token LPT)", multipack_v2, False),
    ("ours, tokens only (b=0)", lambda lengths, stream: ours(lengths, stream, cost_b=0.0), False),
    ("ours", ours, False),
]


def run(name: str, lengths: np.ndarray) -> tuple[list[str], dict[str, tuple[dict, float]]]:
    """The Markdown block of one length set, and each method's metrics and planning seconds."""
    stream = np.random.default_rng(0).permutation(len(lengths))
    lines = [
        f"**{name}**: {len(lengths):,} documents, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
        f"max {lengths.max()} tokens",
        "",
        "| method | efficiency | token imbalance (mean / p99) | cost imbalance (mean / p99) | micro-batches "
        "| time (s) |",
        "|---|---|---|---|---|---|",
    ]
    results = {}
    for label, fn, padded in METHODS:
        timer = harness.Timer().start()
        doc_ids, row_ptr = fn(lengths, stream)
        seconds = timer.stop()
        m = metrics(lengths, doc_ids, row_ptr, padded)
        results[label] = (m, seconds)
        lines.append(
            f"| {label} | {m['efficiency']:.2%} | {m['token_imbalance']:.3f} / {m['token_imbalance_p99']:.3f} | "
            f"{m['cost_imbalance']:.3f} / {m['cost_imbalance_p99']:.3f} | {m['micro_batches']:,} | {seconds:.2f} |"
        )
        print(lines[-1], flush=True)
    base, our = results["multipack V2 (token LPT)"][0], results["ours"][0]
    lines += [
        "",
        f"ours vs multipack V2: cost imbalance {our['cost_imbalance']:.3f} vs {base['cost_imbalance']:.3f} "
        f"(ratio {our['cost_imbalance'] / base['cost_imbalance']:.3f}), efficiency {our['efficiency']:.2%} vs "
        f"{base['efficiency']:.2%}",
        "",
    ]
    return lines, results


def result_rows(workload: str, results: dict[str, tuple[dict, float]], env: dict) -> list[dict]:
    """Each method's packing efficiency, attention-cost imbalance (ours against multipack V2's) and planning time."""
    peer = "multipack V2 (token LPT)"
    peer_cost = results[peer][0]["cost_imbalance"]
    workload = f"{NUM_RANKS} ranks x {CAPACITY} tokens, {workload}"
    rows = []
    for label, (m, seconds) in results.items():
        row = dict(benchmark="benchmarks/planner.py", mode=label, env=env, workload=workload)
        against = dict(peer=peer, peer_value=peer_cost, ratio=m["cost_imbalance"] / peer_cost,
                       ratio_basis="this / peer cost imbalance") if label == "ours" else {}  # fmt: skip
        rows += [
            harness.result_row(metric="packing efficiency", value=100 * m["efficiency"], unit="%", **row),
            harness.result_row(
                metric="attention-cost imbalance (mean)", value=m["cost_imbalance"], unit="x", **row, **against
            ),  # fmt: skip
            harness.result_row(metric="planning time", value=seconds, unit="s", **row),
        ]
    return rows


def lognormal_lengths(num_docs: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(np.rint(rng.lognormal(np.log(600), 1.0, num_docs)), 1, CAPACITY).astype(np.int64)


def _messages(record: dict) -> list[dict]:
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    if "conversations" in record:
        return [
            {"role": roles.get(turn["from"], "assistant" if turn["from"] == "function_call" else "user"),
             "content": turn["value"]}
            for turn in record["conversations"]
        ]  # fmt: skip
    prompt = "\n\n".join(x for x in (record.get("instruction", ""), record.get("input", "")) if x)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record.get("output", "")}]


def real_lengths() -> np.ndarray | None:
    """Token lengths of the shared conversation datasets, rendered with the SmolLM2 ChatML template."""
    tokenizer_dir = SHARED_DATA / "tokenizers" / "smollm2-135m-chatml"
    if not tokenizer_dir.is_dir():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, model_max_length=10**9)
    texts = []
    for path in sorted((SHARED_DATA / "datasets").glob("*/*.json*")):
        raw = path.read_text()
        records = (
            [json.loads(line) for line in raw.splitlines() if line.strip()]
            if path.suffix == ".jsonl"
            else json.loads(raw)
        )
        texts += [tokenizer.apply_chat_template(_messages(r), tokenize=False) for r in records]
    lengths = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]], dtype=np.int64)
    return lengths[(lengths >= 1) & (lengths <= CAPACITY)]


def append_under_heading(path: Path, heading: str, block: str) -> str:
    """The file's text with `block` added at the end of the `heading` section (created at the end if absent)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.rstrip("\n").split("\n")
    if heading not in lines:
        lines += ["", heading]
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    lines[end:end] = ["", *block.rstrip("\n").split("\n"), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-docs", type=int, default=1_000_000)
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    harness.add_common_args(parser)  # --jsonl
    args = parser.parse_args()
    env = harness.environment("numpy")
    header = (
        f"### {env['date']}: {env['machine']} visible, "
        f"Python {env['versions']['python']}, numpy {env['versions']['numpy']}\n\n"
        f"tokens_per_rank={CAPACITY}, {NUM_RANKS} ranks, 1 micro-batch per step, cost L + L²/{CAPACITY}; "
        "planning time is wall time on one core.\n"
    )
    print(header)
    lines, rows = [header], []
    sets = []
    if not args.skip_real:
        lengths = real_lengths()
        if lengths is None:
            print(f"{SHARED_DATA} is absent: skipping the real length set")
        else:
            sets.append(("real (5 shared datasets, SmolLM2 ChatML)", lengths))
    sets.append((f"lognormal (median 600, sigma 1, clip 8192, n={args.num_docs:,})", lognormal_lengths(args.num_docs)))
    for name, lengths in sets:
        block, results = run(name, lengths)
        lines += block
        rows += result_rows(name if "n=" in name else f"{name}, {len(lengths):,} documents", results, env)
    harness.write_rows(args.jsonl, rows)
    if args.no_record:
        return
    args.results.write_text(append_under_heading(args.results, "## Planner", "\n".join(lines)))
    print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
