from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest

from sftflow.tasks.data.index import build_index
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.reader import DocumentReader, IndexedDataset
from sftflow.tasks.data.records import TokenizedDoc


def random_docs(seed: int, n: int, max_len: int = 60, prefix: str = "d") -> list[TokenizedDoc]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(rng.integers(2, max_len))
        cut = int(rng.integers(0, length - 1))
        spans = np.array([[0, 1], [cut + 1, length]] if cut else [[1, length]], dtype=np.int32)
        docs.append(TokenizedDoc(rng.integers(0, 1000, length), spans, f"{prefix}.jsonl:{i + 1}"))
    return docs


def expected(doc: TokenizedDoc, with_spans: bool = True) -> tuple[list[int], list[list[int]]]:
    spans = doc.loss_spans_S2 if with_spans else np.array([[0, len(doc.input_ids)]])
    return doc.input_ids.tolist(), spans.tolist()


@pytest.fixture
def two_shards(tmp_path):
    a, b = random_docs(0, 40, prefix="a"), random_docs(1, 30, prefix="b")
    write_pbin(tmp_path / "a.pbin", a, 1000, {})
    write_pbin(tmp_path / "b.pbin", b, 1000, {}, with_spans=False)
    return [tmp_path / "a.pbin", tmp_path / "b.pbin"], a, b


def test_reader_random_access(two_shards):
    paths, a, b = two_shards
    reader = DocumentReader(paths)
    assert len(reader) == 70 and reader.num_shards == 2
    assert reader.locate(39) == (0, 39) and reader.locate(40) == (1, 0)
    for g in np.random.default_rng(0).permutation(70):
        ids, spans = reader.get(int(g))
        doc, with_spans = (a[g], True) if g < 40 else (b[g - 40], False)
        assert (ids.tolist(), spans.tolist()) == expected(doc, with_spans)
        assert ids.dtype == np.int64 and spans.dtype == np.int32 and spans.shape[1] == 2
        assert ids.flags.writeable and ids.flags.owndata  # a copy: holds no reference to the mapping
    np.testing.assert_array_equal(reader.lengths, [len(d.input_ids) for d in a + b])
    np.testing.assert_array_equal(
        reader.loss_token_counts, [d.loss_token_count for d in a] + [len(d.input_ids) for d in b]
    )
    assert reader.source(1, 2) == "b.jsonl:3"
    with pytest.raises(IndexError):
        reader.get(70)
    reader.close()


@pytest.fixture
def dataset_dir(two_shards, tmp_path):
    paths, a, b = two_shards
    build_index(paths, tmp_path / "idx", max_length=50, eval_fraction=0.25)
    return tmp_path / "idx", {tuple(d.input_ids.tolist()): (d, i < 40) for i, d in enumerate(a + b)}


def test_indexed_dataset_splits(dataset_dir):
    index_dir, by_ids = dataset_dir
    train, ev = IndexedDataset(index_dir, "train"), IndexedDataset(index_dir, "eval")
    assert len(train) > 0 and len(ev) > 0
    assert train.vocab_size == 1000
    seen = set()
    for ds in (train, ev):
        assert ds.lengths.dtype == np.int32 and ds.loss_token_counts.dtype == np.int32
        for i in range(len(ds)):
            ids, spans = ds[i]
            doc, with_spans = by_ids[tuple(ids.tolist())]
            assert (ids.tolist(), spans.tolist()) == expected(doc, with_spans)
            assert ds.lengths[i] == len(ids) <= 50
            assert ds.loss_token_counts[i] == int((spans[:, 1] - spans[:, 0]).sum())
            assert ds.source(i) == doc.source
            seen.add(tuple(ids.tolist()))
    assert len(seen) == len(train) + len(ev) == sum(len(d.input_ids) <= 50 for d, _ in by_ids.values())


def test_indexed_dataset_rejects_a_changed_shard(dataset_dir, two_shards):
    index_dir, _ = dataset_dir
    paths, a, _ = two_shards
    write_pbin(paths[0], a[1:] + a[:1], 1000, {})
    with pytest.raises(ValueError, match=r"a\.pbin: shard no longer matches the dataset index"):
        IndexedDataset(index_dir)


def _read_in_child(args):
    ds, items = args
    out = [(ds[i][0].tolist(), ds[i][1].tolist()) for i in items]
    return out, ds.reader._pid == os.getpid()


def test_works_after_fork_and_pickles_small(dataset_dir):
    index_dir, _ = dataset_dir
    ds = IndexedDataset(index_dir, "train")
    parent = [(ds[i][0].tolist(), ds[i][1].tolist()) for i in range(len(ds))]  # mapped in the parent first
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        chunks = [list(range(len(ds)))[k::2] for k in range(2)]
        results = pool.map(_read_in_child, [(ds, c) for c in chunks], chunksize=1)
    for chunk, (got, reopened) in zip(chunks, results, strict=True):
        assert reopened
        assert got == [parent[i] for i in chunk]

    # Spawned workers receive a pickle: paths and small arrays, never the mapped shards.
    blob = pickle.dumps(ds)
    clone = pickle.loads(blob)
    assert [(clone[i][0].tolist(), clone[i][1].tolist()) for i in range(len(ds))] == parent
    assert b"SFTPBIN" not in blob


def test_torch_dataloader_workers(dataset_dir):
    torch = pytest.importorskip("torch")
    index_dir, _ = dataset_dir
    ds = IndexedDataset(index_dir, "train")
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, shuffle=False, num_workers=2, multiprocessing_context="fork"
    )
    got = [ids.tolist() for ids, _ in loader]
    assert got == [ds[i][0].tolist() for i in range(len(ds))]


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_repeated_access_does_not_grow_memory(tmp_path):
    docs = random_docs(2, 2000, max_len=1000)
    num_tokens = sum(len(d.input_ids) for d in docs)
    write_pbin(tmp_path / "big.pbin", docs, 1000, {})
    reader = DocumentReader([tmp_path / "big.pbin"])
    for g in range(len(reader)):  # warm up allocator pools and the mapping
        reader.get(g)
    before = _rss_anon_kib()
    order = np.random.default_rng(0).permutation(len(reader)).tolist()
    for _ in range(3):
        for g in order:
            ids, spans = reader.get(g)
    growth_kib = _rss_anon_kib() - before
    # Keeping the documents (int64 copies) would cost num_tokens * 8 bytes; allow a small fraction of that.
    assert growth_kib * 1024 < 0.1 * num_tokens * 8, (growth_kib, num_tokens)
