"""Dataset index: merge pbin shards into small per-document arrays, filter, dedup and split train/eval.

On disk, `out_dir` holds one `.npy` per array (written with `allow_pickle=False`), one row per *kept* document, in
shard order then document order:

    shard.npy          int32   which shard (position in `index.json["shards"]`)
    doc.npy            int64   document number inside that shard
    length.npy         int32   tokens
    loss_tokens.npy    int32   trained tokens
    targets.npy        int32   trained tokens that are prediction targets: all but a trained first token, which
                               nothing predicts (what the collator counts, so the planner reads the index alone)
    tag.npy            int32   position of the document's tag in `index.json["tags"]`, -1 for an untagged one
    content_hash.npy   uint64  blake2b-64 of (length, span count, token ids as uint32 LE, spans as int32 LE)
    split.npy          uint8   0 = train, 1 = eval
    train_ids.npy      int64   positions (rows above) in the train split, ascending
    eval_ids.npy       int64   positions in the eval split, ascending

and `index.json` (written last, so its presence means the index is complete) with the config, counts, the dropped
counts per reason, the source names, the tag names (in order of first appearance), each shard's path (absolute and
relative to `out_dir`), sha256 and source (a position in `sources`, so a document's source is
`sources[shards[shard]["source"]]`), and each array's sha256. `index.json.sha256` (written just before it, as
`sha256  index.json`) holds index.json's own sha256: a changed byte in index.json, most of which is the arrays'
hashes, is reported as index.json's change, not as a change of the array whose recorded hash it hit.

Filters, in order: `too_long` (length > max_length), `no_loss_tokens` (nothing to train), `duplicate` (same content
hash as an earlier kept document; "earlier" is shard order, then document order), then, when configured, the filters
over the rendered words (`sftflow.tasks.data.text_filters`): `contaminated` (shares long n-grams with a benchmark; or
only flagged) and `near_duplicate` (MinHash-similar to an earlier kept document), from each shard's text scan
(`sftflow.tasks.data.text_scan`). These add their counts per source under `index.json["text_filters"]` and list each
document they name in `rejects.jsonl`.

The split is a pure function of (content hash, salt, eval_fraction): a document is eval when
`splitmix64(content_hash ^ salt64) / 2**64 < eval_fraction`. Adding shards or records therefore never moves an existing
record between splits, and the content hash does not depend on which shard, position or token dtype holds a record.
A file written without spans hashes as if it had one span `[0, L)`, which is what it trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.data.pbin import PbinFile
from sftflow.tasks.data.text_filters import TextFilters, apply_text_filters

INDEX_FORMAT_VERSION = 3
INDEX_SHA256 = "index.json.sha256"
ARRAY_NAMES = (
    "shard",
    "doc",
    "length",
    "loss_tokens",
    "targets",
    "tag",
    "content_hash",
    "split",
    "train_ids",
    "eval_ids",
)
DROP_REASONS = ("too_long", "no_loss_tokens", "duplicate")
MAX_TAGS = 64  # distinct tags an index keeps (see `fold_rare_tags`)
OTHER_TAG = "(other)"
TRAIN, EVAL = 0, 1
_HASH_CHUNK_TOKENS = 1 << 24  # tokens converted to uint32 at a time while hashing


@dataclass(frozen=True)
class IndexInfo:
    """What `build_index` wrote; the counts match the `DatasetIndex` manifest's fields."""

    path: str  # index.json
    sha256: str  # of index.json, which holds every array's sha256
    shard_paths: list[str]
    shard_sha256s: list[str]
    num_docs_in: int
    num_train: int
    num_eval: int
    num_train_tokens: int
    num_eval_tokens: int
    num_train_loss_tokens: int
    num_eval_loss_tokens: int
    dropped: dict[str, int] = field(default_factory=dict)
    # per source, documents the text filters named: contaminated (dropped or flagged) and near-duplicates (dropped)
    filtered_by_source: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class IndexData:
    """A loaded index: the arrays (one row per kept document) plus `index.json` as `meta`."""

    dir: Path
    meta: dict[str, Any]
    shard_paths: list[str]  # resolved: relative to the index folder when that exists, else the recorded absolute path
    shard: np.ndarray
    doc: np.ndarray
    length: np.ndarray
    loss_tokens: np.ndarray
    targets: np.ndarray
    tag: np.ndarray
    content_hash: np.ndarray
    split: np.ndarray
    train_ids: np.ndarray
    eval_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.shard)

    @property
    def source_names(self) -> list[str]:
        return list(self.meta.get("sources", ["data"]))

    @property
    def source(self) -> np.ndarray:
        """int32 per row: the position of its source in `source_names`."""
        of_shard = np.asarray([s.get("source", 0) for s in self.meta["shards"]], dtype=np.int32)
        return of_shard[self.shard] if len(of_shard) else np.zeros(len(self.shard), dtype=np.int32)

    @property
    def tag_names(self) -> list[str]:
        """The records' tags (`render.tag_field`); `tag` holds each row's position in it, -1 for none."""
        return list(self.meta.get("tags", []))

    def ids(self, split: str) -> np.ndarray:
        """Row positions of `split`: "train", "eval" or "all"."""
        if split == "train":
            return self.train_ids
        if split == "eval":
            return self.eval_ids
        if split == "all":
            return np.arange(len(self.shard), dtype=np.int64)
        raise ValueError(f"{self.dir}: split must be 'train', 'eval' or 'all', got {split!r}")


# --------------------------------------------------------------------------------------------------- hashing


def _content_hashes(f: PbinFile, docs: np.ndarray) -> np.ndarray:
    """uint64 blake2b-64 per document in `docs` (ascending, non-empty docs), canonical across token dtypes.

    One Python-level hash call per document (no per-token Python); about 1-2 us per document plus the hashing itself.
    """
    out = bytearray(8 * len(docs))
    if not len(docs):
        return np.zeros(0, dtype=np.uint64)
    offsets = f.section("doc_offsets")
    tokens = f.section("tokens")
    if f.has_spans:
        span_offsets = f.section("span_offsets").tolist()
        spans = memoryview(np.ascontiguousarray(f.section("spans"), dtype="<i4").reshape(-1).view(np.uint8))
    else:
        span_offsets = None
    pack_counts = struct.Struct("<qq").pack  # (length, span count): keeps token and span bytes unambiguous
    pack_span = struct.Struct("<ii").pack
    blake2b = hashlib.blake2b
    k = 0
    while k < len(docs):
        # A chunk of whole documents, converted to uint32 once; hashing then works on byte slices only.
        first = int(docs[k])
        base = int(offsets[first])
        stop = max(int(np.searchsorted(offsets, base + _HASH_CHUNK_TOKENS, side="right")) - 1, first + 1)
        end = int(np.searchsorted(docs, stop, side="left"))  # candidates among docs [first, stop)
        chunk_docs = docs[k:end]
        chunk = np.ascontiguousarray(tokens[base : int(offsets[int(chunk_docs[-1]) + 1])], dtype="<u4")
        chunk_bytes = memoryview(chunk.view(np.uint8))
        starts = (offsets[chunk_docs] - base).tolist()
        ends = (offsets[chunk_docs + 1] - base).tolist()
        for j, i in enumerate(chunk_docs.tolist()):
            o0, o1 = starts[j], ends[j]
            if span_offsets is not None:
                s0, s1 = span_offsets[i], span_offsets[i + 1]
                h = blake2b(pack_counts(o1 - o0, s1 - s0), digest_size=8)
                h.update(chunk_bytes[4 * o0 : 4 * o1])
                h.update(spans[8 * s0 : 8 * s1])
            else:  # no spans: hash as the single span [0, L) it trains (L > 0 for every doc hashed here)
                h = blake2b(pack_counts(o1 - o0, 1), digest_size=8)
                h.update(chunk_bytes[4 * o0 : 4 * o1])
                h.update(pack_span(0, o1 - o0))
            out[8 * (k + j) : 8 * (k + j + 1)] = h.digest()
        k = end
    return np.frombuffer(bytes(out), dtype="<u8").astype(np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_of(content_hash: np.ndarray, eval_fraction: float, split_salt: str) -> np.ndarray:
    """uint8 split per content hash (0 train, 1 eval): a pure function of hash, salt and fraction."""
    salt64 = np.uint64(int.from_bytes(hashlib.blake2b(split_salt.encode(), digest_size=8).digest(), "little"))
    mixed = _splitmix64(content_hash ^ salt64)
    u = (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1)
    return (u < eval_fraction).astype(np.uint8)


# --------------------------------------------------------------------------------------------------- building


def build_index(
    pbin_paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    max_length: int | None = None,
    dedup: bool = True,
    eval_fraction: float = 0.0,
    split_salt: str = "sftflow",
    shard_sha256s: Sequence[str] | None = None,
    shard_sources: Sequence[str] | None = None,
    text_filters: TextFilters | None = None,
) -> IndexInfo:
    """Merge `pbin_paths` (in this order) into a dataset index under `out_dir`; see the module docstring.

    `shard_sha256s`, when given (e.g. from the `PbinShard` manifests), are recorded instead of re-hashing the files.
    `shard_sources` names each shard's source (the config's source names); without it all shards are one source,
    `data`. `text_filters` (decontamination, near-duplicates) read each shard's text scan.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    if max_length is not None and max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if shard_sha256s is not None and len(shard_sha256s) != len(pbin_paths):
        raise ValueError(f"got {len(shard_sha256s)} shard_sha256s for {len(pbin_paths)} pbin paths")
    if shard_sources is not None and len(shard_sources) != len(pbin_paths):
        raise ValueError(f"got {len(shard_sources)} shard_sources for {len(pbin_paths)} pbin paths")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scan = _scan_shards(pbin_paths, out_dir, max_length, shard_sha256s)
    names = list(dict.fromkeys(shard_sources)) if shard_sources is not None else ["data"]
    for s, meta in enumerate(scan.shards_meta):
        meta["source"] = names.index(shard_sources[s]) if shard_sources is not None else 0
    scan.sources = names
    arrays = _dedup(scan, dedup)
    config = {"max_length": max_length, "dedup": dedup, "eval_fraction": eval_fraction, "split_salt": split_salt}
    if text_filters is not None:
        shard_names = [names[meta["source"]] for meta in scan.shards_meta]
        result = apply_text_filters(text_filters, arrays["shard"], arrays["doc"], pbin_paths, shard_names, out_dir)
        arrays = {k: v[result.keep] for k, v in arrays.items()}
        scan.dropped.update(result.dropped)
        scan.text_filters = result.report
        # Recorded only when on, so that an index built without them is byte for byte what it was before.
        if text_filters.decontaminate is not None:
            config["decontaminate"] = text_filters.decontaminate.model_dump(mode="json")
        if text_filters.near_dedup is not None:
            config["near_dedup"] = text_filters.near_dedup.model_dump(mode="json")
    _split(arrays, eval_fraction, split_salt)
    return _write_index(out_dir, arrays, scan, config, pbin_paths)


@dataclass
class _Scan:
    """The kept documents of every shard, as columns, and what was dropped on the way."""

    arrays: dict[str, np.ndarray]
    dropped: dict[str, int]
    shards_meta: list[dict]
    vocab_size: int | None
    num_docs_in: int
    sources: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    text_filters: dict | None = None  # what the text filters report, when they ran


def _scan_shards(pbin_paths, out_dir: Path, max_length: int | None, shard_sha256s) -> _Scan:
    """Read each shard's lengths and trained-token counts, drop documents over `max_length` or without trained
    tokens, and hash the rest."""
    names = ("shard", "doc", "length", "loss_tokens", "targets", "tag", "content_hash")
    columns: dict[str, list[np.ndarray]] = {k: [] for k in names}
    tags: dict[str, int] = {}  # across shards, in order of first appearance
    dropped = dict.fromkeys(DROP_REASONS, 0)
    shards_meta, vocab_size, num_docs_in = [], None, 0
    for s, path in enumerate(pbin_paths):
        with PbinFile(path) as f:
            if vocab_size is not None and f.vocab_size != vocab_size:
                raise ValueError(f"{path}: vocab_size {f.vocab_size} differs from the first shard's {vocab_size}")
            vocab_size = f.vocab_size
            lengths = f.doc_lengths.astype(np.int64)
            loss = f.loss_token_counts
            keep = np.ones(len(f), dtype=bool)
            if max_length is not None:
                too_long = lengths > max_length
                dropped["too_long"] += int(too_long.sum())
                keep &= ~too_long
            no_loss = keep & (loss == 0)
            dropped["no_loss_tokens"] += int(no_loss.sum())
            keep &= ~no_loss
            docs = np.flatnonzero(keep)
            columns["shard"].append(np.full(len(docs), s, dtype=np.int32))
            columns["doc"].append(docs.astype(np.int64))
            columns["length"].append(lengths[docs].astype(np.int32))
            columns["loss_tokens"].append(loss[docs].astype(np.int32))
            columns["targets"].append((loss[docs] - _first_token_trained(f, docs)).astype(np.int32))
            # the shard's tag numbers, renumbered into the index's list (-1, untagged, stays -1)
            to_index = np.array([tags.setdefault(t, len(tags)) for t in f.tag_names] + [-1], dtype=np.int32)
            columns["tag"].append(to_index[f.tag_ids[docs]])
            columns["content_hash"].append(_content_hashes(f, docs))
            num_docs_in += len(f)
            shards_meta.append(
                {
                    "path": str(Path(path).resolve()),
                    "relpath": os.path.relpath(Path(path).resolve(), out_dir.resolve()),
                    "sha256": shard_sha256s[s] if shard_sha256s is not None else sha256_file(path),
                    "num_docs": len(f),
                    "num_tokens": f.num_tokens,
                    "has_spans": f.has_spans,
                    "token_dtype": f.token_dtype,
                    "provenance": f.provenance,
                }
            )
    arrays = {k: np.concatenate(v) if v else np.zeros(0, dtype=_EMPTY_DTYPES[k]) for k, v in columns.items()}
    arrays["tag"], tag_names = fold_rare_tags(arrays["tag"], list(tags))
    return _Scan(arrays, dropped, shards_meta, vocab_size, num_docs_in, tags=tag_names)


def fold_rare_tags(tag: np.ndarray, names: list[str], limit: int = MAX_TAGS) -> tuple[np.ndarray, list[str]]:
    """At most `limit` tags: beyond that (a `tag` field that really holds ids, say) the `limit - 1` most frequent
    are kept, in order of first appearance, and the rest become `OTHER_TAG`, so every step's breakdown, its
    all-reduce and the trackers stay a bounded size. A warning names how many were folded."""
    if len(names) <= limit:
        return tag, names
    counts = np.bincount(tag[tag >= 0], minlength=len(names))
    kept = np.sort(np.argsort(-counts, kind="stable")[: limit - 1])  # most frequent; ties: first appearance
    new_position = np.full(len(names) + 1, limit - 1, dtype=np.int32)  # everything else: OTHER_TAG
    new_position[kept] = np.arange(len(kept), dtype=np.int32)
    new_position[-1] = -1  # untagged stays untagged
    stage_logger("sftflow.index").warning(
        "index: %d distinct tags (render.tag_field); the %d most frequent are kept and %d are counted as %r",
        len(names), limit - 1, len(names) - (limit - 1), OTHER_TAG,
    )  # fmt: skip
    return new_position[tag], [names[i] for i in kept] + [OTHER_TAG]


def _first_token_trained(f: PbinFile, docs: np.ndarray) -> np.ndarray:
    """Per document: whether its token 0 is trained (always, in a file without spans), vectorised over the spans."""
    if not f.has_spans:
        return np.ones(len(docs), dtype=np.int64)
    span_offsets, spans = f.section("span_offsets"), f.section("spans").reshape(-1, 2)
    if len(spans) == 0:
        return np.zeros(len(docs), dtype=np.int64)
    has_span = span_offsets[docs + 1] > span_offsets[docs]
    first_start = spans[np.minimum(span_offsets[docs], len(spans) - 1), 0]
    return (has_span & (first_start == 0)).astype(np.int64)


def _dedup(scan: _Scan, dedup: bool) -> dict[str, np.ndarray]:
    """Drop repeated contents (the first occurrence stays; counted in `scan.dropped`)."""
    arrays = scan.arrays
    if dedup and len(arrays["content_hash"]):
        _, first = np.unique(arrays["content_hash"], return_index=True)  # stable: the first occurrence wins
        keep = np.zeros(len(arrays["content_hash"]), dtype=bool)
        keep[first] = True
        scan.dropped["duplicate"] = int((~keep).sum())
        arrays = {k: v[keep] for k, v in arrays.items()}
    return arrays


def _split(arrays: dict[str, np.ndarray], eval_fraction: float, split_salt: str) -> None:
    """Assign each document to train or eval by its content hash (adds the split arrays to `arrays`)."""
    arrays["split"] = split_of(arrays["content_hash"], eval_fraction, split_salt)
    arrays["train_ids"] = np.flatnonzero(arrays["split"] == TRAIN).astype(np.int64)
    arrays["eval_ids"] = np.flatnonzero(arrays["split"] == EVAL).astype(np.int64)


def _write_index(out_dir: Path, arrays: dict[str, np.ndarray], scan: _Scan, config: dict, pbin_paths) -> IndexInfo:
    """The arrays as `.npy` files and `index.json` (counts, drops, shards, array checksums), each written atomically."""
    array_meta = {name: _save_npy(out_dir / f"{name}.npy", arrays[name]) for name in ARRAY_NAMES}
    length = arrays["length"].astype(np.int64)
    loss_tokens = arrays["loss_tokens"].astype(np.int64)
    train, ev = arrays["train_ids"], arrays["eval_ids"]
    counts = {
        "num_docs_in": scan.num_docs_in,
        "num_docs": len(length),
        "num_train": len(train),
        "num_eval": len(ev),
        "num_train_tokens": int(length[train].sum()),
        "num_eval_tokens": int(length[ev].sum()),
        "num_train_loss_tokens": int(loss_tokens[train].sum()),
        "num_eval_loss_tokens": int(loss_tokens[ev].sum()),
    }
    meta = {
        "kind": "sftflow-dataset-index",
        "format_version": INDEX_FORMAT_VERSION,
        "config": config,
        "vocab_size": scan.vocab_size,
        "counts": counts,
        "dropped": scan.dropped,
        "sources": scan.sources,
        "tags": scan.tags,
        "shards": scan.shards_meta,
        "arrays": array_meta,
    }
    if scan.text_filters is not None:
        meta["text_filters"] = scan.text_filters
    index_path = out_dir / "index.json"
    text = (json.dumps(meta, indent=2) + "\n").encode("utf-8")
    with atomic_writer(index_path.with_name(INDEX_SHA256)) as f:
        f.write(f"{hashlib.sha256(text).hexdigest()}  index.json\n".encode())
    with atomic_writer(index_path) as f:
        f.write(text)
    return IndexInfo(
        path=str(index_path),
        sha256=sha256_file(index_path),
        shard_paths=[str(p) for p in pbin_paths],
        shard_sha256s=[m["sha256"] for m in scan.shards_meta],
        dropped=scan.dropped,
        filtered_by_source=(scan.text_filters or {}).get("by_source", {}),
        **{k: v for k, v in counts.items() if k != "num_docs"},
    )


_EMPTY_DTYPES = {
    "shard": np.int32,
    "doc": np.int64,
    "length": np.int32,
    "loss_tokens": np.int32,
    "targets": np.int32,
    "tag": np.int32,
    "content_hash": np.uint64,
}


def _save_npy(path: Path, arr: np.ndarray) -> dict[str, Any]:
    with atomic_writer(path) as f:
        np.save(f, arr, allow_pickle=False)
    return {"file": path.name, "dtype": arr.dtype.name, "shape": list(arr.shape), "sha256": sha256_file(path)}


# --------------------------------------------------------------------------------------------------- loading


def _verify_index_json(meta_path: Path) -> None:
    """index.json against its own sha256 (`INDEX_SHA256`), before anything it says is trusted. An index written
    before the file existed has none, and is checked by its arrays' hashes alone."""
    listing = meta_path.with_name(INDEX_SHA256)
    if not listing.is_file():
        return
    expected = listing.read_text(encoding="utf-8", errors="replace").split("  ", 1)[0].strip()
    if sha256_file(meta_path) != expected:
        raise ValueError(
            f"{meta_path}: changed since the index was written (sha256 mismatch with {listing}); rebuild the index "
            "(sftflow data, or sftflow run --force data)"
        )


def load_index(index_dir: str | Path, verify: bool = False, mmap_mode: str | None = None) -> IndexData:
    """Load an index folder. `verify=True` also checks every array's sha256 against `index.json`."""
    index_dir = Path(index_dir)
    meta_path = index_dir / "index.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: no dataset index here (index.json is missing)")
    if verify:
        _verify_index_json(meta_path)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{meta_path}: not readable as a dataset index ({err}); rebuild it (sftflow data)") from None
    if meta.get("kind") != "sftflow-dataset-index" or meta.get("format_version") != INDEX_FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: not a version-{INDEX_FORMAT_VERSION} sftflow dataset index "
            f"(kind={meta.get('kind')!r}, format_version={meta.get('format_version')!r})"
        )
    arrays = {}
    for name in ARRAY_NAMES:
        entry = meta["arrays"][name]
        path = index_dir / entry["file"]
        if verify and sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: index array '{name}' changed since index.json was written (sha256 mismatch)")
        arr = np.load(path, allow_pickle=False, mmap_mode=mmap_mode)
        if arr.dtype.name != entry["dtype"] or list(arr.shape) != entry["shape"]:
            raise ValueError(
                f"{path}: index array '{name}' is {arr.dtype}{arr.shape}, index.json says "
                f"{entry['dtype']}{tuple(entry['shape'])}"
            )
        arrays[name] = arr
    shard_paths = []
    for s in meta["shards"]:
        rel = (index_dir / s["relpath"]).resolve()
        shard_paths.append(str(rel) if rel.exists() else s["path"])
    return IndexData(dir=index_dir, meta=meta, shard_paths=shard_paths, **arrays)
