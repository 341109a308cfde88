"""The index's filters over the documents' words: decontamination, then near-duplicates.

They run after the exact-duplicate filter, over the kept rows in index order (shard order, then document order),
from each shard's text scan (`sftflow.tasks.data.text_scan`: benchmark matches and MinHash signatures, computed per
shard on the task runner). A contaminated document under `action: drop` is dropped before the near-duplicate check,
so it never stands in for a group of near-duplicates; under `flag` it stays and is only counted and listed. Every
document either filter names goes into `rejects.jsonl` in the index folder, one JSON line each, in index order:

    {"source": "a.jsonl:7", "reason": "contaminated", "action": "drop", "matches": 4, "benchmark": "gsm8k.jsonl:3"}
    {"source": "b.jsonl:2", "reason": "near_duplicate", "kept": "a.jsonl:5", "jaccard": 0.9141}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.data.decontam import BenchmarkNgrams
from sftflow.tasks.data.index_config import DecontamConfig, NearDedupConfig
from sftflow.tasks.data.near_dup import NearDuplicates
from sftflow.tasks.data.pbin import PbinFile
from sftflow.tasks.data.text_scan import load_scan

REJECTS = "rejects.jsonl"


@dataclass(frozen=True)
class TextFilters:
    """What to run, and each shard's text scan (made with the same configs)."""

    scan_paths: Sequence[str | Path]
    decontaminate: DecontamConfig | None = None
    benchmark: BenchmarkNgrams | None = None  # names the matched items
    near_dedup: NearDedupConfig | None = None


@dataclass
class TextFilterResult:
    keep: np.ndarray  # bool per row given
    dropped: dict[str, int]  # reason -> documents dropped
    report: dict = field(default_factory=dict)  # what index.json records under "text_filters"


def apply_text_filters(
    filters: TextFilters,
    rows_shard: np.ndarray,
    rows_doc: np.ndarray,
    pbin_paths: Sequence[str | Path],
    shard_source_names: Sequence[str],
    out_dir: Path,
) -> TextFilterResult:
    """Run the configured filters over the rows `(rows_shard, rows_doc)` and write `out_dir/rejects.jsonl`."""
    if len(filters.scan_paths) != len(pbin_paths):
        raise ValueError(f"got {len(filters.scan_paths)} text scans for {len(pbin_paths)} pbin shards")
    decontam = filters.decontaminate if filters.decontaminate and filters.decontaminate.action != "off" else None
    near = NearDuplicates(filters.near_dedup) if filters.near_dedup is not None and filters.near_dedup.enabled else None
    reasons = [r for r, on in (("contaminated", decontam), ("near_duplicate", near)) if on is not None]
    by_source = {name: dict.fromkeys(reasons, 0) for name in dict.fromkeys(shard_source_names)}
    keep = np.ones(len(rows_shard), dtype=bool)
    kept_source: dict[int, str] = {}  # rows the near-duplicate filter remembers, by row
    rejects = []
    for s in range(len(pbin_paths)):
        rows = np.flatnonzero(rows_shard == s)
        if not len(rows):
            continue
        scan = load_scan(filters.scan_paths[s])
        counts = by_source[shard_source_names[s]]
        with PbinFile(pbin_paths[s]) as pbin:
            if len(scan["words"]) != len(pbin):
                raise ValueError(
                    f"{filters.scan_paths[s]}: a text scan of {len(scan['words'])} documents for "
                    f"{pbin_paths[s]} of {len(pbin)}; rerun the data stages"
                )
            for row, doc in zip(rows.tolist(), rows_doc[rows].tolist(), strict=True):
                if decontam is not None and scan["matches"][doc] > 0:
                    counts["contaminated"] += 1
                    file, line = scan["benchmark_item"][doc].tolist()
                    rejects.append(
                        {
                            "source": pbin.source(doc),
                            "reason": "contaminated",
                            "action": decontam.action,
                            "matches": int(scan["matches"][doc]),
                            "benchmark": filters.benchmark.item(file, line),
                        }
                    )
                    if decontam.action == "drop":
                        keep[row] = False
                        continue
                if near is not None:
                    sig = scan["signatures"][doc] if scan["words"][doc] > 0 else None
                    if (match := near.check(row, sig)) is not None:
                        counts["near_duplicate"] += 1
                        rejects.append(
                            {
                                "source": pbin.source(doc),
                                "reason": "near_duplicate",
                                "kept": kept_source[match.kept],
                                "jaccard": round(match.jaccard, 4),
                            }
                        )
                        keep[row] = False
                    elif sig is not None:
                        kept_source[row] = pbin.source(doc)
    with atomic_writer(out_dir / REJECTS) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects).encode("utf-8"))
    total = {r: sum(c[r] for c in by_source.values()) for r in reasons}
    report: dict = {"rejects": REJECTS, "by_source": by_source}
    dropped = {}
    if decontam is not None:
        b = filters.benchmark
        report["contaminated"] = {
            "action": decontam.action,
            "count": total["contaminated"],
            "benchmark": {"cache": b.dir.name, "files": b.paths, **b.counts},
        }
        if decontam.action == "drop":
            dropped["contaminated"] = total["contaminated"]
    if near is not None:
        report["near_duplicate"] = {"count": total["near_duplicate"], "bands": near.bands, "rows": near.rows}
        dropped["near_duplicate"] = total["near_duplicate"]
    return TextFilterResult(keep, dropped, report)
