from __future__ import annotations

import hashlib
import json
import shutil
import struct

import numpy as np
import pytest

from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.data import index as index_mod
from sftflow.tasks.data.index import build_index, load_index, split_of
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.records import TokenizedDoc


def make_doc(ids, spans, source="data.jsonl:1") -> TokenizedDoc:
    return TokenizedDoc(np.asarray(ids, dtype=np.int64), np.asarray(spans, dtype=np.int32).reshape(-1, 2), source)


def random_docs(rng: np.random.Generator, n: int, vocab_size: int = 300, prefix: str = "d") -> list[TokenizedDoc]:
    docs = []
    for i in range(n):
        length = int(rng.integers(2, 40))
        start = int(rng.integers(0, length - 1))
        docs.append(make_doc(rng.integers(0, vocab_size, length), [[start, length]], f"{prefix}.jsonl:{i + 1}"))
    return docs


def reference_hash(ids, spans) -> int:
    """The documented content hash, written out plainly."""
    spans = np.asarray(spans, dtype="<i4").reshape(-1, 2)
    h = hashlib.blake2b(struct.pack("<qq", len(ids), len(spans)), digest_size=8)
    h.update(np.asarray(ids, dtype="<u4").tobytes())
    h.update(spans.tobytes())
    return int.from_bytes(h.digest(), "little")


def test_filters_dedup_and_counts(tmp_path):
    a = [
        make_doc([1, 2, 3], [[1, 3]], "a.jsonl:1"),  # kept
        make_doc(range(10), [[0, 10]], "a.jsonl:2"),  # too long
        make_doc([4, 5], [], "a.jsonl:3"),  # no loss tokens
        make_doc([1, 2, 3], [[1, 3]], "a.jsonl:4"),  # duplicate of a:1
        make_doc([1, 2, 3], [[0, 3]], "a.jsonl:5"),  # same ids, other spans: kept
        make_doc([], [], "a.jsonl:6"),  # empty: no loss tokens
    ]
    b = [
        make_doc([1, 2, 3], [[0, 1], [1, 3]], "b.jsonl:1"),  # duplicate of a:5 (touching spans are merged)
        make_doc([7, 8], [[0, 2]], "b.jsonl:2"),  # kept
    ]
    c = [make_doc([7, 8], [[0, 1]], "c.jsonl:1"), make_doc([9], [[0, 1]], "c.jsonl:2")]  # no spans: c:1 dups b:2
    paths = [tmp_path / "a.pbin", tmp_path / "b.pbin", tmp_path / "c.pbin"]
    write_pbin(paths[0], a, 300, {})
    write_pbin(paths[1], b, 300, {})
    write_pbin(paths[2], c, 300, {}, with_spans=False)

    info = build_index(paths, tmp_path / "idx", max_length=8, eval_fraction=0.0)
    assert info.dropped == {"too_long": 1, "no_loss_tokens": 2, "duplicate": 3}
    assert (info.num_docs_in, info.num_train, info.num_eval) == (10, 4, 0)
    assert info.num_train_tokens == 3 + 3 + 2 + 1
    assert info.num_train_loss_tokens == 2 + 3 + 2 + 1
    assert info.sha256 == sha256_file(info.path)
    assert info.shard_sha256s == [sha256_file(p) for p in paths]

    idx = load_index(tmp_path / "idx", verify=True)
    np.testing.assert_array_equal(idx.shard, [0, 0, 1, 2])
    np.testing.assert_array_equal(idx.doc, [0, 4, 1, 1])
    np.testing.assert_array_equal(idx.length, [3, 3, 2, 1])
    np.testing.assert_array_equal(idx.loss_tokens, [2, 3, 2, 1])
    # Targets leave out a trained token 0 (nothing predicts it): a:5 and b:2 start trained, c (no spans) is all trained.
    np.testing.assert_array_equal(idx.targets, [2, 2, 1, 0])
    np.testing.assert_array_equal(idx.train_ids, [0, 1, 2, 3])
    assert idx.eval_ids.dtype == np.int64 and len(idx.eval_ids) == 0
    assert idx.content_hash.dtype == np.uint64
    assert int(idx.content_hash[0]) == reference_hash([1, 2, 3], [[1, 3]])
    assert int(idx.content_hash[3]) == reference_hash([9], [[0, 1]])
    assert idx.shard_paths == [str(p.resolve()) for p in paths]

    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert meta["config"] == {"max_length": 8, "dedup": True, "eval_fraction": 0.0, "split_salt": "sftflow"}
    assert meta["counts"]["num_docs"] == 4
    for name, entry in meta["arrays"].items():
        assert sha256_file(tmp_path / "idx" / entry["file"]) == entry["sha256"], name

    no_dedup = build_index(paths, tmp_path / "idx2", max_length=8, dedup=False)
    assert no_dedup.dropped["duplicate"] == 0 and no_dedup.num_train == 7


def test_targets_are_the_trained_tokens_after_position_zero(tmp_path):
    """The stored counts equal a plain count over each document's loss mask, so planning needs no shard reads."""
    rng = np.random.default_rng(3)
    docs = random_docs(rng, 200)
    for i in range(0, 200, 7):  # some documents trained from token 0, some with several spans
        n = len(docs[i].input_ids)
        docs[i] = make_doc(docs[i].input_ids, [[0, 1], [n // 2, n]] if n > 3 else [[0, n]], docs[i].source)
    write_pbin(tmp_path / "a.pbin", docs, 300, {})
    build_index([tmp_path / "a.pbin"], tmp_path / "idx", eval_fraction=0.0, dedup=False)
    idx = load_index(tmp_path / "idx", verify=True)
    expected = []
    for d in docs:
        mask = np.zeros(len(d.input_ids), dtype=bool)
        for start, end in d.loss_spans_S2:
            mask[start:end] = True
        expected.append(int(mask[1:].sum()))
    np.testing.assert_array_equal(idx.targets, np.asarray(expected)[idx.doc])


def test_hash_chunking_matches_reference(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    docs = random_docs(rng, 50, vocab_size=300)
    write_pbin(tmp_path / "a.pbin", docs, 300, {})
    monkeypatch.setattr(index_mod, "_HASH_CHUNK_TOKENS", 7)  # many chunks, docs longer than a chunk
    build_index([tmp_path / "a.pbin"], tmp_path / "idx", max_length=30)
    idx = load_index(tmp_path / "idx")
    for row, d in enumerate(idx.doc):
        expected = reference_hash(docs[d].input_ids, docs[d].loss_spans_S2)
        assert int(idx.content_hash[row]) == expected


def test_content_hash_does_not_depend_on_token_dtype(tmp_path):
    docs = random_docs(np.random.default_rng(4), 20)
    hashes = []
    for vocab_size in (300, 70_000):  # uint16 and uint32 token sections
        write_pbin(tmp_path / f"{vocab_size}.pbin", docs, vocab_size, {})
        build_index([tmp_path / f"{vocab_size}.pbin"], tmp_path / f"idx{vocab_size}")
        hashes.append(load_index(tmp_path / f"idx{vocab_size}").content_hash)
    np.testing.assert_array_equal(hashes[0], hashes[1])


def test_split_is_stable_when_records_are_added(tmp_path):
    rng = np.random.default_rng(0)
    old = random_docs(rng, 400, prefix="old")
    write_pbin(tmp_path / "v1.pbin", old, 300, {})
    build_index([tmp_path / "v1.pbin"], tmp_path / "idx1", eval_fraction=0.3, split_salt="s")
    before = load_index(tmp_path / "idx1")
    assert 0.2 < len(before.eval_ids) / len(before) < 0.4

    # Refresh: records appended to the old file, a new shard *before* it, and the old shard's docs reshuffled.
    new = random_docs(rng, 300, prefix="new")
    order = rng.permutation(len(old))
    write_pbin(tmp_path / "v1.pbin", [old[i] for i in order] + new[:100], 300, {})
    write_pbin(tmp_path / "v2.pbin", new[100:], 300, {})
    build_index([tmp_path / "v2.pbin", tmp_path / "v1.pbin"], tmp_path / "idx2", eval_fraction=0.3, split_salt="s")
    after = load_index(tmp_path / "idx2")

    assert len(after) == len(before) + len(new)
    split_after = dict(zip(after.content_hash.tolist(), after.split.tolist(), strict=True))
    for h, s in zip(before.content_hash.tolist(), before.split.tolist(), strict=True):
        assert split_after[h] == s
    # The split is a function of the hash alone; a different salt gives a different split.
    np.testing.assert_array_equal(split_of(after.content_hash, 0.3, "s"), after.split)
    assert (split_of(after.content_hash, 0.3, "other") != after.split).any()


def test_eval_fraction_extremes(tmp_path):
    write_pbin(tmp_path / "a.pbin", random_docs(np.random.default_rng(2), 30), 300, {})
    assert build_index([tmp_path / "a.pbin"], tmp_path / "i0", eval_fraction=0.0).num_eval == 0
    assert build_index([tmp_path / "a.pbin"], tmp_path / "i1", eval_fraction=1.0).num_train == 0
    with pytest.raises(ValueError, match="eval_fraction"):
        build_index([tmp_path / "a.pbin"], tmp_path / "i2", eval_fraction=1.5)


def test_everything_dropped_gives_empty_arrays(tmp_path):
    write_pbin(tmp_path / "a.pbin", [make_doc([1, 2], [])], 300, {})
    info = build_index([tmp_path / "a.pbin"], tmp_path / "idx")
    assert info.num_train == 0 and info.dropped["no_loss_tokens"] == 1
    idx = load_index(tmp_path / "idx")
    assert len(idx) == 0 and idx.shard.dtype == np.int32 and idx.content_hash.dtype == np.uint64


def test_vocab_mismatch_is_an_error(tmp_path):
    write_pbin(tmp_path / "a.pbin", [make_doc([1], [[0, 1]])], 300, {})
    write_pbin(tmp_path / "b.pbin", [make_doc([1], [[0, 1]])], 400, {})
    with pytest.raises(ValueError, match=r"b\.pbin: vocab_size 400 differs"):
        build_index([tmp_path / "a.pbin", tmp_path / "b.pbin"], tmp_path / "idx")


def test_load_index_verifies_and_resolves_moved_folder(tmp_path):
    data = tmp_path / "data"
    write_pbin(data / "shards" / "a.pbin", random_docs(np.random.default_rng(3), 10), 300, {})
    build_index([data / "shards" / "a.pbin"], data / "index")
    moved = tmp_path / "moved"
    shutil.move(data, moved)
    idx = load_index(moved / "index", verify=True)
    assert idx.shard_paths == [str((moved / "shards" / "a.pbin").resolve())]

    np.save(moved / "index" / "length.npy", np.zeros(len(idx), np.int32))
    with pytest.raises(ValueError, match="index array 'length' changed"):
        load_index(moved / "index", verify=True)
    with pytest.raises(FileNotFoundError, match="index.json is missing"):
        load_index(tmp_path)


def test_a_flipped_byte_in_index_json_is_reported_as_index_json_not_as_the_array_it_hit(tmp_path):
    """Most of index.json is the arrays' sha256s: a flipped byte there used to be reported as that array's change
    (`doc.npy`), sending the user after the wrong file. index.json has its own sha256, checked first."""
    write_pbin(tmp_path / "a.pbin", random_docs(np.random.default_rng(4), 10), 300, {})
    build_index([tmp_path / "a.pbin"], tmp_path / "index")
    meta_path = tmp_path / "index" / "index.json"
    text = meta_path.read_text()
    digest = json.loads(text)["arrays"]["doc"]["sha256"]
    flipped = digest[:10] + ("0" if digest[10] != "0" else "1") + digest[11:]
    meta_path.write_text(text.replace(digest, flipped))
    with pytest.raises(ValueError, match=rf"^{meta_path}: changed since the index was written") as err:
        load_index(tmp_path / "index", verify=True)
    assert "doc.npy" not in str(err.value)

    meta_path.write_bytes(b"\xff" + text.encode()[1:])  # a flip that leaves no JSON: the same one line
    with pytest.raises(ValueError, match=rf"^{meta_path}: changed since the index was written"):
        load_index(tmp_path / "index", verify=True)
