from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.data.pbin import FORMAT_VERSION, MAGIC, PbinError, open_pbin, spans_to_mask, write_pbin
from sftflow.tasks.data.records import TokenizedDoc

PROVENANCE = {"source_sha256": "a" * 64, "template_sha256": "b" * 64, "tokenizer_sha256": "c" * 64}


def make_doc(ids, spans, source="data.jsonl:1") -> TokenizedDoc:
    return TokenizedDoc(np.asarray(ids, dtype=np.int64), np.asarray(spans, dtype=np.int32).reshape(-1, 2), source)


def mask_runs(mask: np.ndarray) -> np.ndarray:
    """Maximal runs of ones as half-open spans: the canonical form the writer stores."""
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return edges.reshape(-1, 2).astype(np.int32)


@st.composite
def docs_strategy(draw, vocab_size: int):
    n = draw(st.integers(0, 12))
    docs = []
    for _ in range(n):
        length = draw(st.integers(0, 40))
        ids = draw(st.lists(st.integers(0, vocab_size - 1), min_size=length, max_size=length))
        # Random sorted cut points -> disjoint spans, possibly touching or empty (the writer normalises those).
        cuts = sorted(draw(st.lists(st.integers(0, length), max_size=8)))
        cuts = cuts[: len(cuts) // 2 * 2]
        source = draw(
            st.one_of(
                st.builds(
                    lambda f, sep, n: f"{f}{sep}{n}",
                    st.sampled_from(["a.jsonl", "dir/b.parquet", "c:d.jsonl", "ds[train]"]),
                    st.sampled_from([":", ":record ", ":0", ":record 0", "record "]),
                    st.integers(0, 10**6),
                ),
                st.text(max_size=12),
            )
        )
        docs.append(make_doc(ids, np.array(cuts).reshape(-1, 2), source))
    return docs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    vocab_size=st.sampled_from([7, 300, 65536, 70_000, 2**31 - 1]),
    with_spans=st.booleans(),
)
def test_round_trip(tmp_path_factory, data, vocab_size, with_spans):
    docs = data.draw(docs_strategy(vocab_size))
    path = tmp_path_factory.mktemp("rt") / "shard.pbin"
    info = write_pbin(path, docs, vocab_size, PROVENANCE, with_spans=with_spans)

    assert info.sha256 == sha256_file(path)
    assert info.token_dtype == ("uint16" if vocab_size <= 65536 else "uint32")
    assert info.num_docs == len(docs)
    assert info.num_tokens == sum(len(d.input_ids) for d in docs)
    with open_pbin(path, verify=True) as f:
        assert len(f) == len(docs)
        assert f.provenance == PROVENANCE
        assert f.section("tokens").dtype == np.dtype(info.token_dtype)
        counts = []
        for i, d in enumerate(docs):
            np.testing.assert_array_equal(f.doc(i), d.input_ids)
            expected_mask = d.loss_mask() if with_spans else np.ones(len(d.input_ids), np.uint8)
            np.testing.assert_array_equal(f.loss_mask(i), expected_mask)
            np.testing.assert_array_equal(f.loss_spans(i), mask_runs(expected_mask))
            assert f.loss_spans(i).dtype == np.int32
            assert f.source(i) == d.source
            counts.append(int(expected_mask.sum()))
        np.testing.assert_array_equal(f.doc_lengths, [len(d.input_ids) for d in docs])
        np.testing.assert_array_equal(f.loss_token_counts, counts)
        assert info.num_loss_tokens == sum(counts) == f.header["num_loss_tokens"]


def test_numbered_sources_share_one_stored_prefix(tmp_path):
    """A line (`file:7`) or a record (`file:record 7`) stores its file once, however many documents it has."""
    path = tmp_path / "x.pbin"
    sources = ["d.jsonl:1", "d.jsonl:12", "d.parquet:record 1", "d.parquet:record 2", "ds[test]:record 3", "odd"]
    write_pbin(path, [make_doc([1], [[0, 1]], s) for s in sources], 10, PROVENANCE)
    with open_pbin(path) as f:
        assert [f.source(i) for i in range(len(sources))] == sources
        assert f._source_names == ["d.jsonl:", "d.parquet:record ", "ds[test]:record ", "odd"]
        assert f.section("source_lines").tolist() == [1, 12, 1, 2, 3, -1]


def test_doc_is_a_zero_copy_read_only_view(tmp_path):
    path = tmp_path / "x.pbin"
    write_pbin(path, [make_doc([1, 2, 3], [[1, 3]]), make_doc([4, 5], [])], 10, PROVENANCE)
    with open_pbin(path) as f:
        ids = f.doc(0)
        assert np.shares_memory(ids, f.section("tokens"))
        assert not ids.flags.writeable
        with pytest.raises(IndexError, match="out of range"):
            f.doc(2)
        np.testing.assert_array_equal(f.doc(-1), [4, 5])


def test_sections_are_64_byte_aligned_and_file_ends_at_last_section(tmp_path):
    path = tmp_path / "x.pbin"
    write_pbin(path, [make_doc(range(i + 1), [[0, 1]]) for i in range(5)], 70_000, PROVENANCE)
    raw = path.read_bytes()
    magic, version, header_nbytes, _, _ = struct.unpack_from("<8sIIII", raw)
    assert (magic, version) == (MAGIC, FORMAT_VERSION)
    header = json.loads(raw[24 : 24 + header_nbytes])
    assert all(s["offset"] % 64 == 0 for s in header["sections"])
    last = max(header["sections"], key=lambda s: s["offset"])
    assert last["offset"] + last["nbytes"] == len(raw)
    assert header["token_dtype"] == "uint32"


def test_no_span_file_trains_every_token(tmp_path):
    path = tmp_path / "x.pbin"
    info = write_pbin(path, [make_doc([1, 2, 3], [[0, 1]]), make_doc([], [])], 10, PROVENANCE, with_spans=False)
    assert info.num_loss_tokens == 3
    with open_pbin(path, verify=True) as f:
        assert not f.has_spans
        assert "spans" not in {s["name"] for s in f.header["sections"]}
        np.testing.assert_array_equal(f.loss_spans(0), [[0, 3]])
        assert f.loss_spans(1).shape == (0, 2)
        np.testing.assert_array_equal(f.loss_mask(0), [1, 1, 1])


def test_empty_file(tmp_path):
    path = tmp_path / "x.pbin"
    write_pbin(path, [], 10, {})
    with open_pbin(path, verify=True) as f:
        assert len(f) == 0
        assert f.loss_token_counts.shape == (0,)


# --------------------------------------------------------------------------------------------------- bad input


def test_token_outside_vocab_names_source(tmp_path):
    docs = [make_doc([1, 2], [[0, 2]], "a.jsonl:1"), make_doc([3, 10], [[0, 2]], "a.jsonl:7")]
    with pytest.raises(ValueError, match=r"a\.jsonl:7: input_ids\[1\] = 10 .*vocab_size=10"):
        write_pbin(tmp_path / "x.pbin", docs, 10, PROVENANCE)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp file left behind


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([[0, 5]], "out of range"),
        ([[2, 1]], "out of range"),
        ([[0, 2], [1, 3]], "sorted and non-overlapping"),
        ([[2, 3], [0, 1]], "sorted and non-overlapping"),
    ],
)
def test_bad_spans_name_source(tmp_path, spans, message):
    with pytest.raises(ValueError, match=f"b.jsonl:3: .*{message}"):
        write_pbin(tmp_path / "x.pbin", [make_doc([1, 2, 3], spans, "b.jsonl:3")], 10, PROVENANCE)


def test_touching_and_empty_spans_are_normalised(tmp_path):
    path = tmp_path / "x.pbin"
    write_pbin(path, [make_doc(range(6), [[0, 1], [1, 2], [3, 3], [4, 6]])], 10, PROVENANCE)
    with open_pbin(path) as f:
        np.testing.assert_array_equal(f.loss_spans(0), [[0, 2], [4, 6]])


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "x.pbin"
    write_pbin(path, [make_doc([1], [[0, 1]])], 10, PROVENANCE)
    old = open_pbin(path)  # an open reader keeps its mapping of the old file
    write_pbin(path, [make_doc([2, 3], [[0, 2]])], 10, PROVENANCE)
    np.testing.assert_array_equal(old.doc(0), [1])
    with open_pbin(path) as f:
        np.testing.assert_array_equal(f.doc(0), [2, 3])
    assert [p.name for p in tmp_path.iterdir()] == ["x.pbin"]


# --------------------------------------------------------------------------------------------------- damaged files


@pytest.fixture
def shard(tmp_path) -> Path:
    path = tmp_path / "shard.pbin"
    docs = [make_doc(np.arange(i, i + 20) % 300, [[1, 5], [9, 12]], f"s.jsonl:{i}") for i in range(30)]
    write_pbin(path, docs, 300, PROVENANCE)
    return path


def test_wrong_magic(shard):
    raw = bytearray(shard.read_bytes())
    raw[:8] = b"NOTPBIN\0"
    shard.write_bytes(raw)
    with pytest.raises(PbinError, match=f"{shard}: not a pbin file"):
        open_pbin(shard)


def test_wrong_version(shard):
    raw = bytearray(shard.read_bytes())
    struct.pack_into("<I", raw, 8, FORMAT_VERSION + 1)
    shard.write_bytes(raw)
    with pytest.raises(PbinError, match=f"{shard}: pbin format version {FORMAT_VERSION + 1} is not supported"):
        open_pbin(shard)


def test_truncated_on_open(shard):
    raw = shard.read_bytes()
    for cut in [0, 5, 23, 100, len(raw) // 2, len(raw) - 1]:
        shard.write_bytes(raw[:cut])
        with pytest.raises(PbinError, match=f"{shard}: truncated pbin file"):
            open_pbin(shard)


def test_corrupt_header_on_open(shard):
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0x01
    shard.write_bytes(raw)
    with pytest.raises(PbinError, match=f"{shard}: corrupt pbin header"):
        open_pbin(shard)


def test_corrupt_section_on_verify(shard):
    with open_pbin(shard) as f:
        sections = [(s["name"], s["offset"], s["nbytes"]) for s in f.header["sections"]]
    raw = shard.read_bytes()
    for name, offset, nbytes in sections:
        damaged = bytearray(raw)
        damaged[offset + nbytes - 1] ^= 0x40  # the last byte: never doc_offsets[0]
        shard.write_bytes(damaged)
        try:
            f = open_pbin(shard)
        except PbinError as e:  # doc_offsets[-1] is checked on open
            assert name == "doc_offsets" and "corrupt section 'doc_offsets'" in str(e)
            continue
        with pytest.raises(PbinError, match=f"{shard}: corrupt section '{name}'"):
            f.verify()
        f.close()


def test_spans_to_mask():
    np.testing.assert_array_equal(spans_to_mask(np.array([[1, 3], [4, 5]]), 6), [0, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(spans_to_mask(np.zeros((0, 2), np.int32), 2), [0, 0])
