"""Per shard, what the index's word filters need from each document, so that the words are read once per shard, in
parallel on the task runner, and a refresh that adds shards scans only the new ones.

`scan.npz` (written with `allow_pickle=False`), one row per document of the pbin shard:

    words           int64  (N,)     words in the rendered text (0: nothing to compare)
    matches         int32  (N,)     distinct benchmark n-grams shared, when at least `min_matches`, else 0
    benchmark_item  int64  (N, 2)   (benchmark file position, line) of one shared n-gram's item; (-1, -1) for none
    signatures      uint64 (N, P)   MinHash signatures (P = num_perm; P = 0 when near-dedup is off)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.data.decontam import Decontaminator
from sftflow.tasks.data.doc_texts import shard_texts
from sftflow.tasks.data.index_config import NearDedupConfig
from sftflow.tasks.data.near_dup import NearDuplicates
from sftflow.tasks.data.ngrams import WordHasher
from sftflow.tasks.data.pbin import PbinFile

SCAN_FORMAT_VERSION = 1
SCAN_ARRAYS = ("words", "matches", "benchmark_item", "signatures")


@dataclass(frozen=True)
class ScanInfo:
    path: str
    num_docs: int
    num_contaminated: int


def scan_shard(
    rendered_path: str | Path,
    pbin_path: str | Path,
    out_path: str | Path,
    decontaminator: Decontaminator | None,
    near_dedup: NearDedupConfig | None,
) -> ScanInfo:
    """Read the shard's rendered texts once and write `out_path` (see the module docstring)."""
    with PbinFile(pbin_path) as f:
        n = len(f)
    near = NearDuplicates(near_dedup) if near_dedup is not None and near_dedup.enabled else None
    arrays = {
        "words": np.zeros(n, dtype=np.int64),
        "matches": np.zeros(n, dtype=np.int32),
        "benchmark_item": np.full((n, 2), -1, dtype=np.int64),
        "signatures": np.zeros((n, near.config.num_perm if near is not None else 0), dtype=np.uint64),
    }
    hasher = WordHasher()
    for doc, _, text in shard_texts(rendered_path, pbin_path, np.arange(n)):
        word_hashes = hasher.text(text)  # one pass over the words for both filters
        arrays["words"][doc] = len(word_hashes)
        if decontaminator is not None and (match := decontaminator.check(word_hashes)) is not None:
            arrays["matches"][doc] = match.matches
            arrays["benchmark_item"][doc] = match.item_position
        if near is not None and len(word_hashes):
            arrays["signatures"][doc] = near.signature(word_hashes)
    with atomic_writer(Path(out_path)) as out:
        np.savez(out, **arrays)
    return ScanInfo(str(out_path), n, int((arrays["matches"] > 0).sum()))


def load_scan(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in SCAN_ARRAYS if k not in z.files]
        if missing:
            raise ValueError(f"{path}: not a text scan (no {missing}); rerun the data stages")
        return {k: z[k] for k in SCAN_ARRAYS}
