"""Decontamination: find training documents that share long word n-grams with benchmark items.

The benchmark side is built once per benchmark set and cached by content, so a refresh that adds training data (or a
rerun of the index) reads it back instead of rebuilding it:

    cache_root/<key>/           key = sha256 of (format version, n, fields, each benchmark file's sha256, in order)
        ngrams.npy      uint64 (M,)    distinct n-gram hashes of every item's text, sorted (`sftflow.tasks.data.ngrams`)
        ngram_item.npy  int64  (M, 2)  per n-gram, the first item that has it: (benchmark file position, line)
        benchmark.json  counts and the arrays' sha256; written last, so its presence means the folder is complete

An item is one JSON object per line of a benchmark file; each of the configured `fields` present in it holds a
string or a list of strings (multiple-choice options), and each string is n-grammed alone (an n-gram never spans
two fields, as a question and its answer sit in different turns of a conversation). A text shorter than n words
has no n-gram, and is counted as `too_short`.

A training document is contaminated when its text shares at least `min_matches` distinct n-grams with the set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.core.fingerprint import sha256_file, sha256_json
from sftflow.tasks.data.index_config import DecontamConfig
from sftflow.tasks.data.ngrams import WordHasher, distinct_ngrams, ngram_hashes

BENCHMARK_FORMAT_VERSION = 1


@dataclass(frozen=True)
class BenchmarkNgrams:
    """A benchmark set's n-grams, loaded; `reused` says whether they came from the cache."""

    dir: Path
    paths: list[str]  # the benchmark files, in config order (what `ngram_item[:, 0]` points into)
    ngrams: np.ndarray
    ngram_item: np.ndarray
    counts: dict[str, int]
    reused: bool

    def item(self, file: int, line: int) -> str:
        """`file:line` of a benchmark item, by its file's position."""
        return f"{self.paths[file]}:{line}"


def _item_texts(path: Path, line_number: int, record: object, fields: Sequence[str]) -> list[str]:
    where = f"{path}:{line_number}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a benchmark record must be a JSON object, got {type(record).__name__}")
    texts = []
    for name in fields:
        value = record.get(name)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        # A number is read as its text: a numeric answer, or a choice task's answer index (sft-bench's own files).
        if not all(isinstance(v, str) or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values):
            raise ValueError(
                f"{where}: field '{name}' must be a string, a number or a list of them for decontamination"
            )
        texts += [v if isinstance(v, str) else str(v) for v in values]
    if not any(name in record for name in fields):
        raise ValueError(
            f"{where}: none of the fields {list(fields)} is in this record (it has {sorted(record)}); name its text "
            "fields in data.index.decontaminate.fields"
        )
    return texts


def _read_benchmarks(paths: Sequence[Path], config: DecontamConfig) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    hasher = WordHasher()
    grams, items = [], []
    counts = {"files": len(paths), "items": 0, "texts": 0, "too_short": 0}
    for position, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_number}: not valid JSON ({err.msg}); one object per line") from None
                counts["items"] += 1
                for text in _item_texts(path, line_number, record, config.fields):
                    counts["texts"] += 1
                    g = ngram_hashes(hasher.text(text), config.ngram)
                    counts["too_short"] += int(len(g) == 0)
                    grams.append(g)
                    items.append(np.tile(np.array([[position, line_number]], dtype=np.int64), (len(g), 1)))
    all_grams = np.concatenate(grams) if grams else np.zeros(0, dtype=np.uint64)
    all_items = np.concatenate(items) if items else np.zeros((0, 2), dtype=np.int64)
    ngrams, first = np.unique(all_grams, return_index=True)  # the first item (file order, line order) per n-gram
    counts["ngrams"] = len(ngrams)
    return ngrams, all_items[first], counts


def _save(path: Path, arr: np.ndarray) -> str:
    with atomic_writer(path) as f:
        np.save(f, arr, allow_pickle=False)
    return sha256_file(path)


def _load_cached(folder: Path) -> tuple[np.ndarray, np.ndarray, dict] | None:
    meta_path = folder / "benchmark.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    for name, digest in meta["arrays"].items():
        if not (folder / name).is_file() or sha256_file(folder / name) != digest:
            return None  # changed or half-deleted: build it again
    ngrams = np.load(folder / "ngrams.npy", allow_pickle=False)
    ngram_item = np.load(folder / "ngram_item.npy", allow_pickle=False)
    return ngrams, ngram_item, meta["counts"]


def benchmark_ngrams(paths: Sequence[str | Path], config: DecontamConfig, cache_root: str | Path) -> BenchmarkNgrams:
    """The n-gram set of the benchmark files `paths`, read from `cache_root` when it is there, else built and saved."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: benchmark file not found (data.index.decontaminate.benchmarks)")
    key = sha256_json(
        {
            "version": BENCHMARK_FORMAT_VERSION,
            "ngram": config.ngram,
            "fields": list(config.fields),
            "files": [sha256_file(p) for p in paths],
        }
    )[:24]
    folder = Path(cache_root) / key
    cached = _load_cached(folder)
    if cached is not None:
        return BenchmarkNgrams(folder, [str(p) for p in paths], *cached, reused=True)
    ngrams, ngram_item, counts = _read_benchmarks(paths, config)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "ngrams.npy": _save(folder / "ngrams.npy", ngrams),
        "ngram_item.npy": _save(folder / "ngram_item.npy", ngram_item),
    }
    meta = {
        "kind": "sftflow-benchmark-ngrams",
        "version": BENCHMARK_FORMAT_VERSION,
        "ngram": config.ngram,
        "fields": list(config.fields),
        "counts": counts,
        "arrays": arrays,
    }
    with atomic_writer(folder / "benchmark.json") as f:
        f.write((json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return BenchmarkNgrams(folder, [str(p) for p in paths], ngrams, ngram_item, counts, reused=False)


@dataclass(frozen=True)
class Match:
    matches: int  # distinct benchmark n-grams the document shares
    item_position: tuple[int, int]  # (benchmark file position, line) of one shared n-gram's item (smallest hash)


class Decontaminator:
    """Checks documents, one at a time, against a benchmark set.

    A bit table indexed by the top bits of an n-gram's hash (about 16 slots per benchmark n-gram) answers most
    lookups, and only the few n-grams that land on a set slot are looked up in the sorted set.
    """

    _MAX_TABLE_BITS = 26  # 64 MiB of bools at most, per process

    def __init__(self, benchmark: BenchmarkNgrams, config: DecontamConfig):
        self.benchmark, self.config = benchmark, config
        bits = int(np.clip(np.ceil(np.log2(max(len(benchmark.ngrams), 1) * 16)), 16, self._MAX_TABLE_BITS))
        self._shift = np.uint64(64 - bits)
        self._table = np.zeros(1 << bits, dtype=bool)
        self._table[benchmark.ngrams >> self._shift] = True

    def check(self, word_hashes: np.ndarray) -> Match | None:
        """The match of a document (its word hashes, `WordHasher.text`) when it shares at least `min_matches`
        n-grams with the benchmark set, else None."""
        bench = self.benchmark.ngrams
        grams = distinct_ngrams(word_hashes, self.config.ngram)
        grams = grams[self._table[grams >> self._shift]]
        if not len(grams) or not len(bench):
            return None
        at = np.minimum(np.searchsorted(bench, grams), len(bench) - 1)
        hit = bench[at] == grams
        count = int(hit.sum())
        if count < self.config.min_matches:
            return None
        file, line = self.benchmark.ngram_item[int(at[np.argmax(hit)])]
        return Match(count, (int(file), int(line)))
