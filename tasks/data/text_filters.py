"""The index's filters over the documents' words: decontamination, then near-duplicates.

They run after the exact-duplicate filter, over the kept rows in index order (shard order, then document order), and
read each document's rendered text (`sftflow.tasks.data.doc_texts`). A contaminated document under `action: drop` is
dropped before the near-duplicate check, so it never stands in for a group of near-duplicates; under `flag` it stays
and is only counted and listed. Every document either filter names goes into `rejects.jsonl` in the index folder,
one JSON line each, in index order:

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
from sftflow.tasks.data.decontam import BenchmarkNgrams, Decontaminator
from sftflow.tasks.data.doc_texts import shard_texts
from sftflow.tasks.data.index_config import DecontamConfig, NearDedupConfig
from sftflow.tasks.data.near_dup import NearDuplicates
from sftflow.tasks.data.ngrams import WordHasher

REJECTS = "rejects.jsonl"


@dataclass(frozen=True)
class TextFilters:
    """What to run: a benchmark set with its config (decontamination), and/or the near-duplicate config."""

    decontaminate: DecontamConfig | None = None
    benchmark: BenchmarkNgrams | None = None
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
    rendered_paths: Sequence[str | Path],
    shard_source_names: Sequence[str],
    out_dir: Path,
) -> TextFilterResult:
    """Run the configured filters over the rows `(rows_shard, rows_doc)` and write `out_dir/rejects.jsonl`."""
    decontam = None
    if filters.decontaminate is not None and filters.decontaminate.action != "off":
        decontam = Decontaminator(filters.benchmark, filters.decontaminate)
    near = NearDuplicates(filters.near_dedup) if filters.near_dedup is not None and filters.near_dedup.enabled else None
    reasons = [r for r, on in (("contaminated", decontam), ("near_duplicate", near)) if on is not None]
    by_source = {name: dict.fromkeys(reasons, 0) for name in dict.fromkeys(shard_source_names)}
    keep = np.ones(len(rows_shard), dtype=bool)
    kept_source: dict[int, str] = {}  # rows the near-duplicate filter remembers, by row
    rejects = []
    hasher = WordHasher()
    for s in range(len(pbin_paths)):
        rows = np.flatnonzero(rows_shard == s)
        if not len(rows):
            continue
        row_of_doc = dict(zip(rows_doc[rows].tolist(), rows.tolist(), strict=True))
        counts = by_source[shard_source_names[s]]
        for doc, source, text in shard_texts(rendered_paths[s], pbin_paths[s], rows_doc[rows]):
            row = row_of_doc[doc]
            word_hashes = hasher.text(text)  # one pass over the words for both filters
            if decontam is not None and (match := decontam.check(word_hashes)) is not None:
                counts["contaminated"] += 1
                action = filters.decontaminate.action
                rejects.append(
                    {
                        "source": source,
                        "reason": "contaminated",
                        "action": action,
                        "matches": match.matches,
                        "benchmark": match.item,
                    }
                )
                if action == "drop":
                    keep[row] = False
                    continue
            if near is not None:
                if (near_match := near.check(row, word_hashes)) is not None:
                    counts["near_duplicate"] += 1
                    rejects.append(
                        {
                            "source": source,
                            "reason": "near_duplicate",
                            "kept": kept_source[near_match.kept],
                            "jaccard": round(near_match.jaccard, 4),
                        }
                    )
                    keep[row] = False
                else:
                    kept_source[row] = source
    with atomic_writer(out_dir / REJECTS) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects).encode("utf-8"))
    total = {r: sum(c[r] for c in by_source.values()) for r in reasons}
    report: dict = {"rejects": REJECTS, "by_source": by_source}
    dropped = {}
    if decontam is not None:
        b = filters.benchmark
        report["contaminated"] = {
            "action": filters.decontaminate.action,
            "count": total["contaminated"],
            "benchmark": {"cache": b.dir.name, "files": b.paths, **b.counts},
        }
        if filters.decontaminate.action == "drop":
            dropped["contaminated"] = total["contaminated"]
    if near is not None:
        report["near_duplicate"] = {"count": total["near_duplicate"], "bands": near.bands, "rows": near.rows}
        dropped["near_duplicate"] = total["near_duplicate"]
    return TextFilterResult(keep, dropped, report)
