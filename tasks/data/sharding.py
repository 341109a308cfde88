"""Source shards: split one large input into ranges that never split a record, and read the records of one range.

JSONL is split by byte range. Each shard ends where a line ends::

    file         {"a": 1}\\n{"b": 2}\\n\\n{"c": 3}\\n{"d": 4}\\n
    target       0 ──────── shard_bytes ─┐                    (a target inside a line...)
    boundary     0 ────────────────────────┘                  (...moves forward to just past the next newline)

With `shard_bytes`, the next target is `shard_bytes` past the previous boundary, so every shard but the last holds at
least `shard_bytes`; a line longer than that is one shard. With `shard_records`, a shard is that many lines (blank lines
included). Each shard carries `first_line`, the 1-based line number of its first line in the whole file, so `source`
strings stay the true `file:line`. The newlines before each boundary are counted in the same single pass over the file
that hashes it for the cache key, so sharding reads the file once, as an unsharded run does.

Parquet is split by row range: runs of whole row groups (`shard_bytes`, by uncompressed size) or fixed row counts
(`shard_records`). A `datasets` folder is split by row range within each split. A `.json` array is one shard: a JSON
document cannot be split without parsing all of it. Records of these three are named `file:record N` (`folder[split]:
record N` for a split), N counting from 1 over the whole file or split, whichever shard reads them.

Shards are listed in file order and read in that order, so concatenating their records gives the unsharded record
sequence exactly; a single shard covering the whole source is reported as `None` (read the whole source).

`shard_bytes="auto"` (the data config's default) sizes shards from the source alone, never from the machine, so the
shards, and with them every output, are the same on any number of cores: a source under `AUTO_SPLIT_FROM` (16 MiB)
is one shard; a larger one is cut into shards of `AUTO_SHARD_BYTES` (8 MiB), or into `AUTO_MAX_SHARDS` (256) larger
ones when that would make more. Sizes are what `shard_bytes` counts for the kind: file bytes for JSONL, uncompressed
row-group bytes for Parquet, Arrow bytes for a `datasets` folder; a JSON array is one shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sftflow.tasks.core.fingerprint import sha256_tree
from sftflow.tasks.data.formats import RecordError
from sftflow.tasks.data.surrogates import lone_surrogate, may_hold_surrogate, surrogate_reason

_CHUNK = 1 << 20
_PARQUET_BATCH = 1024
AUTO_SPLIT_FROM = 16 * 2**20  # shard_bytes: auto leaves a source smaller than this whole
AUTO_SHARD_BYTES = 8 * 2**20  # ... and cuts a larger one into shards of this size
AUTO_MAX_SHARDS = 256  # ... or of size / 256, when that is larger: per-shard task overhead stays bounded


class SourceRange(BaseModel):
    """Half-open `[start, end)` of one source: bytes of a JSONL file, or rows of a Parquet file or dataset split."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit: Literal["bytes", "rows"]
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    first_line: int = Field(default=1, ge=1, description="bytes: 1-based line number of the line at `start`")
    split: str | None = Field(default=None, description="rows of a `datasets` DatasetDict: which split")

    @property
    def label(self) -> str:
        split = f"[{self.split}]" if self.split is not None else ""
        return f"{self.unit}{split} {self.start}-{self.end}"


# ------------------------------------------------------------------------------------------------------------ kinds


def source_kind(path: str | Path) -> Literal["datasets", "parquet", "json_array", "jsonl"]:
    path = Path(path)
    if path.is_dir():
        return "datasets"
    if path.suffix == ".parquet":
        return "parquet"
    if not path.is_file():
        raise ValueError(f"{path}: source does not exist (expected a JSONL/JSON/Parquet file or a datasets folder)")
    if path.suffix == ".json":
        with open(path, encoding="utf-8", errors="replace") as f:
            if f.read(4096).lstrip().startswith("["):
                return "json_array"
    return "jsonl"


# --------------------------------------------------------------------------------------------------------- planning


def auto_shard_bytes(size: int) -> int | None:
    """What `shard_bytes: auto` means for a source of `size` bytes: None (one shard) or the shard size."""
    if size < AUTO_SPLIT_FROM:
        return None
    return max(AUTO_SHARD_BYTES, -(-size // AUTO_MAX_SHARDS))


def source_bytes(path: str | Path) -> int:
    """A source's size as `shard_bytes` counts it (see the module docstring); 0 for a JSON array (never split)."""
    path = Path(path)
    kind = source_kind(path)
    if kind == "jsonl":
        return path.stat().st_size
    if kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if kind == "datasets":
        import datasets

        loaded = datasets.load_from_disk(str(path))
        splits = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
        return sum(d.data.nbytes for d in splits)
    return 0


def resolve_shard_bytes(path: str | Path, shard_bytes: int | Literal["auto"] | None) -> int | None:
    """`shard_bytes` as a number of bytes (None: not split by bytes); "auto" is decided here, from the source alone."""
    if shard_bytes != "auto":
        return shard_bytes
    return auto_shard_bytes(source_bytes(path))


def plan_shards(
    path: str | Path, shard_bytes: int | Literal["auto"] | None = None, shard_records: int | None = None
) -> tuple[str, list[SourceRange | None]]:
    """The source's content hash and its shards in file order; `[None]` when it is not split (one whole shard).

    Deterministic: the shards depend only on the file's content and the two sizes. `shard_records` overrides
    `shard_bytes="auto"`.
    """
    if shard_records is not None and shard_bytes == "auto":
        shard_bytes = None
    if shard_bytes is not None and shard_records is not None:
        raise ValueError("give at most one of shard_bytes and shard_records")
    shard_bytes = resolve_shard_bytes(path, shard_bytes)
    for name, value in (("shard_bytes", shard_bytes), ("shard_records", shard_records)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    kind = source_kind(path)
    if shard_bytes is None and shard_records is None or kind == "json_array":
        return sha256_tree(path), [None]
    if kind == "jsonl":
        sha256, ranges = _plan_jsonl(Path(path), shard_bytes, shard_records)
    elif kind == "parquet":
        sha256, ranges = sha256_tree(path), _plan_parquet(Path(path), shard_bytes, shard_records)
    else:
        sha256, ranges = sha256_tree(path), _plan_datasets(Path(path), shard_bytes, shard_records)
    if len(ranges) == 1 and ranges[0].split is None:
        return sha256, [None]
    return sha256, list(ranges)


def next_line_start(f, pos: int, size: int) -> int:
    """The first line start at or after byte `pos` of binary file `f` (`size` when no line starts there)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    offset = pos - 1
    while chunk := f.read(_CHUNK):
        at = chunk.find(b"\n")
        if at >= 0:
            return offset + at + 1
        offset += len(chunk)
    return size


def _plan_jsonl(path: Path, shard_bytes: int | None, lines_per_shard: int | None) -> tuple[str, list[SourceRange]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        bounds = [0]
        if shard_bytes is not None:
            while (b := next_line_start(f, bounds[-1] + shard_bytes, size)) < size:
                bounds.append(b)
        f.seek(0)
        sha256, bounds, newlines_before = _scan(f, bounds[1:], lines_per_shard)
    bounds = [0, *bounds, size]
    first_lines = [1, *(n + 1 for n in newlines_before)]
    return sha256, [
        SourceRange(unit="bytes", start=s, end=e, first_line=line)
        for s, e, line in zip(bounds[:-1], bounds[1:], first_lines, strict=True)
    ]


def _scan(f, byte_bounds: list[int], lines_per_shard: int | None) -> tuple[str, list[int], list[int]]:
    """One pass over `f`: its sha256, the interior shard boundaries, and the newlines before each boundary.

    Boundaries are `byte_bounds` as given, or (with `lines_per_shard`) found here just past every
    `lines_per_shard`-th newline. A boundary at the end of the file is dropped: no empty last shard.
    """
    digest = hashlib.sha256()
    bounds: list[int] = []
    newlines_before: list[int] = []
    pending = iter(byte_bounds)
    next_bound = next(pending, None)
    newlines = pos = 0
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
        end = pos + len(chunk)
        if lines_per_shard is None:
            offset = 0
            while next_bound is not None and next_bound <= end:
                newlines += chunk.count(b"\n", offset, next_bound - pos)
                offset = next_bound - pos
                bounds.append(next_bound)
                newlines_before.append(newlines)
                next_bound = next(pending, None)
            newlines += chunk.count(b"\n", offset)
        else:
            in_chunk = chunk.count(b"\n")
            offset = 0
            # Every newline that completes a shard of `lines_per_shard` lines is a boundary just past it.
            while newlines + in_chunk >= (len(bounds) + 1) * lines_per_shard:
                wanted = (len(bounds) + 1) * lines_per_shard - newlines
                for _ in range(wanted):
                    offset = chunk.index(b"\n", offset) + 1
                newlines += wanted
                in_chunk -= wanted
                bounds.append(pos + offset)
                newlines_before.append(newlines)
            newlines += in_chunk
        pos = end
    while bounds and bounds[-1] >= pos:
        bounds.pop()
        newlines_before.pop()
    return digest.hexdigest(), bounds, newlines_before


def _row_ranges(num_rows: int, rows_per_shard: int, split: str | None = None) -> list[SourceRange]:
    starts = range(0, max(num_rows, 1), rows_per_shard)
    return [SourceRange(unit="rows", start=s, end=min(s + rows_per_shard, num_rows), split=split) for s in starts]


def _plan_parquet(path: Path, shard_bytes: int | None, shard_records: int | None) -> list[SourceRange]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    if shard_records is not None:
        return _row_ranges(meta.num_rows, shard_records)
    ranges, start, rows, nbytes = [], 0, 0, 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        rows += group.num_rows
        nbytes += group.total_byte_size
        if nbytes >= shard_bytes or i == meta.num_row_groups - 1:
            ranges.append(SourceRange(unit="rows", start=start, end=start + rows))
            start, rows, nbytes = start + rows, 0, 0
    return ranges or [SourceRange(unit="rows", start=0, end=0)]


def _plan_datasets(path: Path, shard_bytes: int | None, shard_records: int | None) -> list[SourceRange]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    ranges = []
    for split, dataset in splits:
        rows_per_shard = shard_records
        if rows_per_shard is None:  # rows of about shard_bytes of Arrow data
            rows_per_shard = max(1, shard_bytes * dataset.num_rows // max(dataset.data.nbytes, 1))
        ranges += _row_ranges(dataset.num_rows, rows_per_shard, split)
    return ranges


# ---------------------------------------------------------------------------------------------------------- reading


def iter_jsonl(
    path: str | Path, start: int = 0, end: int | None = None, first_line: int = 1, max_line_bytes: int | None = None
):
    """`(f"{path}:{line}", record)` for the non-blank lines in bytes `[start, end)`; `start` must be a line start.

    Lines split on b"\\n" only; a line that is not UTF-8 or not JSON, or longer than `max_line_bytes` (skipped
    without being held in memory), yields a `RecordError` as its record.
    """
    lineno = first_line - 1
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while end is None or pos < end:
            raw = f.readline(-1 if max_line_bytes is None else max_line_bytes + 1)
            if not raw:
                break
            pos += len(raw)
            lineno += 1
            source = f"{path}:{lineno}"
            if max_line_bytes is not None and len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                size = len(raw) + _skip_line(f)
                pos += size - len(raw)
                reason = f"is {size} bytes, over render.max_record_bytes={max_line_bytes}"
                yield source, RecordError(source, "line", reason)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield source, RecordError(source, "line", f"is not valid UTF-8 (byte {err.start}: {err.reason})")
                continue
            if not line.strip():
                continue
            try:
                # Without its newline: an error at the line's end is then at its last column, not "column 1" of the
                # next line, and every column counts characters of this line as an editor does.
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                yield source, RecordError(source, "line", f"is not valid JSON ({err.msg} at column {err.colno})")
                continue
            except RecursionError:
                yield source, RecordError(source, "line", "is JSON nested too deeply to parse")
                continue
            except ValueError as err:  # a number of more than 4300 digits, which Python refuses to parse
                yield source, RecordError(source, "line", f"is JSON that Python cannot read: {err}")
                continue
            if may_hold_surrogate(line) and (found := lone_surrogate(record)):
                yield source, RecordError(source, found[0], surrogate_reason(*found[1:]))
                continue
            yield source, record


def _skip_line(f) -> int:
    """Read past the rest of the current line in bounded chunks; the bytes skipped, newline included."""
    skipped = 0
    while chunk := f.readline(1 << 20):
        skipped += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return skipped


def record_source(name: str | Path, row: int) -> str:
    """`"name:record N"` of 0-based row `row`: record numbers count from 1, as JSONL line numbers do, and say
    "record" because a JSON array's or a table's record is not a line an editor can jump to."""
    return f"{name}:record {row + 1}"


def iter_json_array(path: str | Path) -> Iterator[tuple[str, Any]]:
    """`(f"{path}:record {n}", record)` for each element of a JSON array (n from 1)."""
    with open(path, encoding="utf-8") as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
        except ValueError as err:  # a number of more than 4300 digits, which Python refuses to parse
            raise ValueError(f"{path}: JSON that Python cannot read: {err}") from None
    for row, record in enumerate(records):
        source = record_source(path, row)
        found = lone_surrogate(record)
        yield source, record if found is None else RecordError(source, found[0], surrogate_reason(*found[1:]))


def iter_parquet(path: str | Path, start: int = 0, end: int | None = None) -> Iterator[tuple[str, Any]]:
    """`(f"{path}:record {n}", record)` for rows `[start, end)` (0-based rows of the whole file; n = row + 1), a
    batch at a time."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    end = parquet.metadata.num_rows if end is None else end
    groups, first_row, row = [], None, 0
    for i in range(parquet.metadata.num_row_groups):
        n = parquet.metadata.row_group(i).num_rows
        if row < end and row + n > start:
            groups.append(i)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:
        return
    row = first_row
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH, row_groups=groups):
        lo, hi = max(start - row, 0), min(end - row, batch.num_rows)
        if lo < hi:
            for k, record in enumerate(batch.slice(lo, hi - lo).to_pylist()):
                yield record_source(path, row + lo + k), record
        row += batch.num_rows
        if row >= end:
            return


def iter_datasets(
    path: str | Path, split: str | None = None, start: int = 0, end: int | None = None
) -> Iterator[tuple[str, Any]]:
    """`(f"{path}[{split}]:record {n}", record)` for a `datasets` folder: every split, or rows `[start, end)` of one
    (n = row + 1)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is not None and split not in loaded:
            raise ValueError(f"{path}: no split {split!r} (has {sorted(loaded)})")
        splits = [(split, loaded[split])] if split is not None else list(loaded.items())
    else:
        splits = [(None, loaded)]
    for name, dataset in splits:
        prefix = f"{path}[{name}]" if name is not None else str(path)
        hi = dataset.num_rows if end is None else min(end, dataset.num_rows)
        rows = dataset.select(range(start, hi)) if (start, hi) != (0, dataset.num_rows) else dataset
        for k, record in enumerate(rows):
            yield record_source(prefix, start + k), record


def iter_range_records(
    path: str | Path, source_range: SourceRange | None = None, max_record_bytes: int | None = None
) -> Iterator[tuple[str, Any]]:
    """`(source, record)` for every record of a source, or of one of its shards; see `iter_source_records`.
    `max_record_bytes` bounds JSONL lines (Parquet and `datasets` rows are bounded by their schema)."""
    kind = source_kind(path)
    r = source_range
    if kind == "datasets":
        return iter_datasets(path, *((r.split, r.start, r.end) if r else ()))
    if kind == "parquet":
        return iter_parquet(path, *((r.start, r.end) if r else ()))
    if kind == "json_array":
        if r is not None:
            raise ValueError(f"{path}: a JSON array cannot be read by range; convert it to JSONL to shard it")
        return iter_json_array(path)
    if r is not None and r.unit != "bytes":
        raise ValueError(f"{path}: JSONL shards are byte ranges, got a {r.unit} range")
    if r is None:
        return iter_jsonl(path, max_line_bytes=max_record_bytes)
    return iter_jsonl(path, r.start, r.end, r.first_line, max_line_bytes=max_record_bytes)


def detect_source_format(path: str | Path) -> str | None:
    """The record format of a source's first valid record: what an unsharded render autodetects for the whole file."""
    from sftflow.tasks.data.formats import detect_format

    for _, record in iter_range_records(path):
        if not isinstance(record, RecordError):
            return detect_format(record)
    return None
