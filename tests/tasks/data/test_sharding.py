"""Source shards: boundaries never split a record, every record is read exactly once with its true line or record."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftflow.tasks.core.fingerprint import sha256_file, sha256_tree
from sftflow.tasks.data import sharding
from sftflow.tasks.data.formats import RecordError
from sftflow.tasks.data.sharding import SourceRange, iter_range_records, plan_shards


def _read_all(path, ranges) -> list[tuple[str, object]]:
    out = []
    for r in ranges:
        for source, record in iter_range_records(path, r):
            out.append((source, str(record) if isinstance(record, RecordError) else record))
    return out


def _expected_jsonl(path: Path, content: bytes) -> list[tuple[str, object]]:
    """The reference reading: split on b"\\n", number lines from 1, skip blank ones."""
    out = []
    for lineno, raw in enumerate(content.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            out.append((f"{path}:{lineno}", json.loads(raw)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            out.append((f"{path}:{lineno}", "bad"))
    return out


def _errors_as_bad(records):
    return [(s, "bad" if isinstance(r, str) and r.startswith(s) else r) for s, r in records]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
lines = st.one_of(
    json_values.map(lambda v: json.dumps({"v": v}, ensure_ascii=False).encode()),
    st.sampled_from([b"", b"   ", b"not json", b"\xff\xfe", b'{"a": 1}\r']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(lines, max_size=25),
    trailing_newline=st.booleans(),
    shard=st.one_of(st.tuples(st.just("bytes"), st.integers(1, 400)), st.tuples(st.just("records"), st.integers(1, 9))),
    chunk=st.sampled_from([3, 16, 1 << 20]),
)
def test_jsonl_shards_cover_every_record_once_with_its_line(rows, trailing_newline, shard, chunk):
    content = b"\n".join(rows) + (b"\n" if trailing_newline and rows else b"")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_bytes(content)
        kind, size = shard
        old_chunk, sharding._CHUNK = sharding._CHUNK, chunk  # exercise boundaries that straddle read chunks
        try:
            sha256, ranges = plan_shards(path, **{f"shard_{kind}": size})
        finally:
            sharding._CHUNK = old_chunk
        assert sha256 == sha256_file(path)
        expected = _expected_jsonl(path, content)
        assert _errors_as_bad(_read_all(path, ranges)) == expected
        assert _errors_as_bad(_read_all(path, [None])) == expected
        if ranges == [None]:
            return
        assert ranges[0].start == 0 and ranges[-1].end == len(content)
        for prev, cur in zip(ranges, ranges[1:], strict=False):
            assert prev.end == cur.start
        for r in ranges:
            assert r.start < r.end
            assert r.start == 0 or content[r.start - 1 : r.start] == b"\n"  # never inside a line
            assert r.first_line == content[: r.start].count(b"\n") + 1
            if r is ranges[-1]:
                continue
            if kind == "records":
                assert content[r.start : r.end].count(b"\n") == size
            else:  # the first line end at or past start + shard_bytes
                assert r.end == content.index(b"\n", r.start + size - 1) + 1


def test_jsonl_byte_shards_are_deterministic_and_one_shard_is_the_whole_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * i}) + "\n" for i in range(50)))
    assert plan_shards(path, shard_bytes=100) == plan_shards(path, shard_bytes=100)
    assert plan_shards(path, shard_bytes=10**9)[1] == [None]
    assert plan_shards(path)[1] == [None]
    _, ranges = plan_shards(path, shard_bytes=100)
    assert len(ranges) > 5
    assert [s for s, _ in _read_all(path, ranges)] == [f"{path}:{i}" for i in range(1, 51)]


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(0, 40),
    row_group_size=st.integers(1, 12),
    shard=st.one_of(
        st.tuples(st.just("bytes"), st.integers(1, 3000)), st.tuples(st.just("records"), st.integers(1, 9))
    ),
)
def test_parquet_row_shards_cover_every_row_once(num_rows, row_group_size, shard):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "i": i} for i in range(num_rows)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.parquet"
        schema = pa.schema(
            [("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))), ("i", pa.int64())]
        )
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
        kind, size = shard
        sha256, ranges = plan_shards(path, **{f"shard_{kind}": size})
        assert sha256 == sha256_file(path)
        got = _read_all(path, ranges)
        assert got == [(f"{path}:record {i + 1}", row) for i, row in enumerate(rows)]
        assert got == _read_all(path, [None])
        if ranges != [None] and kind == "records":
            assert all(r.end - r.start == size for r in ranges[:-1])


def test_datasets_folder_shards_by_row_range_per_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(7)]),
            "test": datasets.Dataset.from_list([{"prompt": f"t{i}", "completion": f"u{i}"} for i in range(3)]),
        }
    )
    dd.save_to_disk(str(tmp_path / "ds"))
    path = tmp_path / "ds"
    sha256, ranges = plan_shards(path, shard_records=3)
    assert sha256 == sha256_tree(path)
    assert [(r.split, r.start, r.end) for r in ranges] == [
        ("train", 0, 3),
        ("train", 3, 6),
        ("train", 6, 7),
        ("test", 0, 3),
    ]
    whole = _read_all(path, [None])
    assert _read_all(path, ranges) == whole
    assert [s for s, _ in whole][6:8] == [f"{path}[train]:record 7", f"{path}[test]:record 1"]
    # By bytes: about shard_bytes of Arrow data per shard, still every row once.
    _, by_bytes = plan_shards(path, shard_bytes=20)
    assert len(by_bytes) > 2
    assert _read_all(path, by_bytes) == whole


def test_json_array_is_one_shard_and_bad_sizes_are_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a", "completion": "b"}] * 5))
    assert plan_shards(path, shard_bytes=10)[1] == [None]
    with pytest.raises(ValueError, match="cannot be read by range"):
        list(iter_range_records(path, SourceRange(unit="rows", start=0, end=2)))
    with pytest.raises(ValueError, match="at most one"):
        plan_shards(path, shard_bytes=10, shard_records=2)
    with pytest.raises(ValueError, match="shard_bytes must be >= 1"):
        plan_shards(path, shard_bytes=0)


def test_invalid_utf8_line_is_a_located_record_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff{"a": 2}\n')
    [(_, first), (source, second)] = list(iter_range_records(path))
    assert first == {"a": 1}
    assert isinstance(second, RecordError) and source == f"{path}:2" and "UTF-8" in str(second)


def test_auto_shard_size_depends_on_the_source_size_alone():
    mib = 2**20
    assert sharding.auto_shard_bytes(0) is None
    assert sharding.auto_shard_bytes(16 * mib - 1) is None  # under 16 MiB: one shard
    assert sharding.auto_shard_bytes(16 * mib) == 8 * mib
    assert sharding.auto_shard_bytes(2048 * mib) == 8 * mib  # 256 shards of 8 MiB
    assert sharding.auto_shard_bytes(10 * 1024 * mib) == 40 * mib  # beyond that, 256 larger shards


def test_auto_splits_a_big_jsonl_at_line_ends_with_true_line_numbers(tmp_path):
    """A 17 MiB file of ~10 kB lines (a blank line and a bad one among them): the auto shards are the 8 MiB ones,
    each starts just past a newline, and reading them gives every record once with its 1-based line."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x" * 10_000})
    lines = [json.dumps({"text": f"{i} " + "x" * 10_000}) for i in range(17 * 2**20 // len(line) + 1)]
    lines[1200:1200] = ["", "{not json"]  # past the first 8 MiB
    content = ("\n".join(lines) + "\n").encode()
    path.write_bytes(content)
    assert len(content) > 17 * 2**20

    sha256, ranges = plan_shards(path, shard_bytes="auto")
    assert (sha256, ranges) == plan_shards(path, shard_bytes=8 * 2**20)
    assert sha256 == sha256_file(path) and len(ranges) == 3
    assert ranges[0].start == 0 and ranges[-1].end == len(content)
    for before, after in zip(ranges, ranges[1:], strict=False):
        assert after.start == before.end and content[after.start - 1 : after.start] == b"\n"
        assert after.first_line == content[: after.start].count(b"\n") + 1
    records = _read_all(path, ranges)
    assert _errors_as_bad(records) == _expected_jsonl(path, content)
    assert [s for s, r in records if isinstance(r, str)] == [f"{path}:1202"]

    small = tmp_path / "small.jsonl"
    small.write_bytes(content[: ranges[0].end])
    assert plan_shards(small, shard_bytes="auto") == (sha256_file(small), [None])
    assert plan_shards(path, shard_bytes="auto", shard_records=2000)[1] == plan_shards(path, shard_records=2000)[1]
