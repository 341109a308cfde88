"""The index with decontamination and near-duplicate removal: exactly the planted documents go, counted per source
and listed by `file:line`; data without them indexes to the same arrays; the kept document is the first."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from sftflow.tasks.data.decontam import Decontaminator, benchmark_ngrams
from sftflow.tasks.data.index import ARRAY_NAMES, INDEX_SHA256, build_index, load_index
from sftflow.tasks.data.index_config import DecontamConfig, NearDedupConfig
from sftflow.tasks.data.pbin import PbinFile
from sftflow.tasks.data.text_filters import TextFilters
from sftflow.tasks.data.text_scan import scan_shard
from tests.tasks.text_filter_data import change_words, chat, sentence, write_benchmark, write_shard


@pytest.fixture
def planted(tmp_path):
    """Two sources of clean conversations, with benchmark items and near-variants planted at known lines."""
    rng = np.random.default_rng(0)
    items = [{"question": sentence(rng, 25), "answer": sentence(rng, 20)} for _ in range(4)]
    bench = write_benchmark(tmp_path / "bench.jsonl", items)
    clean_a = [chat(sentence(rng, 30), sentence(rng, 60)) for _ in range(8)]
    clean_b = [chat(sentence(rng, 30), sentence(rng, 60)) for _ in range(6)]
    a = list(clean_a)
    a[2] = chat("Please solve: " + items[0]["question"].upper() + "?", "Sure.")  # a.jsonl:3, contaminated
    a[5] = chat(sentence(rng, 10), "The answer: " + items[1]["answer"])  # a.jsonl:6, contaminated (the answer)
    b = list(clean_b)
    b[1] = clean_a[0].replace("\n", " \n\n")  # b.jsonl:2, the words of a.jsonl:1, spaced out: near-duplicate
    b[3] = change_words(clean_a[4], [40])  # b.jsonl:4, one word changed: near-duplicate of a.jsonl:5
    b[4] = chat(items[3]["question"][: len(items[3]["question"]) // 2], "no")  # half a question: too few words
    return {"bench": bench, "a": a, "b": b, "clean": (clean_a, clean_b), "root": tmp_path}


def _scans(root, shards, filters: TextFilters) -> list[str]:
    """Each shard's text scan, as the `textscan` stage makes it."""
    decontaminator = None
    if filters.decontaminate is not None:
        decontaminator = Decontaminator(filters.benchmark, filters.decontaminate)
    (root / "scans").mkdir(exist_ok=True)
    paths = []
    for rendered, pbin in shards:
        out = root / "scans" / f"{pbin.stem}-{len(list((root / 'scans').iterdir()))}.npz"
        paths.append(scan_shard(rendered, pbin, out, decontaminator, filters.near_dedup).path)
    return paths


def _index(root, sources: dict[str, list[str]], out: str, filters: TextFilters | None, skipped=()):
    shards = [write_shard(root / "shards", name, texts, skipped) for name, texts in sources.items()]
    if filters is not None:
        filters = dataclasses.replace(filters, scan_paths=_scans(root, shards, filters))
    return build_index(
        [p for _, p in shards], root / out, eval_fraction=0.3, shard_sources=list(sources), text_filters=filters
    )


def _filters(bench, action="drop", near=True, cache=None) -> TextFilters:
    config = DecontamConfig(action=action, benchmarks=[str(bench)])
    return TextFilters(
        scan_paths=[],
        decontaminate=config,
        benchmark=benchmark_ngrams([bench], config, cache or bench.parent / "cache"),
        near_dedup=NearDedupConfig(enabled=near),
    )


def _kept_sources(index_dir) -> list[str]:
    index = load_index(index_dir)
    out = []
    for s, d in zip(index.shard.tolist(), index.doc.tolist(), strict=True):
        with PbinFile(index.shard_paths[s]) as f:
            out.append(f.source(d).replace(".jsonl", ""))
    return out


def test_planted_copies_and_near_variants_are_dropped_exactly_and_counted_per_source(planted):
    info = _index(planted["root"], {"a": planted["a"], "b": planted["b"]}, "idx", _filters(planted["bench"]))
    kept = _kept_sources(planted["root"] / "idx")
    gone = {"a:3", "a:6", "b:2", "b:4"}
    assert set(kept) == ({f"a:{i}" for i in range(1, 9)} | {f"b:{i}" for i in range(1, 7)}) - gone
    assert info.dropped == {"too_long": 0, "no_loss_tokens": 0, "duplicate": 0, "contaminated": 2, "near_duplicate": 2}
    assert info.filtered_by_source == {
        "a": {"contaminated": 2, "near_duplicate": 0},
        "b": {"contaminated": 0, "near_duplicate": 2},
    }
    meta = json.loads((planted["root"] / "idx" / "index.json").read_text())
    assert meta["counts"]["num_docs"] == 10 and meta["text_filters"]["contaminated"]["count"] == 2
    rejects = [json.loads(line) for line in (planted["root"] / "idx" / "rejects.jsonl").read_text().splitlines()]
    bench = str(planted["bench"])
    assert [(r["source"], r["reason"]) for r in rejects] == [
        ("a.jsonl:3", "contaminated"),
        ("a.jsonl:6", "contaminated"),
        ("b.jsonl:2", "near_duplicate"),
        ("b.jsonl:4", "near_duplicate"),
    ]
    assert rejects[0]["benchmark"] == f"{bench}:1" and rejects[0]["matches"] == 25 - 13 + 1
    assert rejects[1]["benchmark"] == f"{bench}:2" and rejects[1]["action"] == "drop"
    assert rejects[2]["kept"] == "a.jsonl:1" and rejects[2]["jaccard"] == 1.0
    assert rejects[3]["kept"] == "a.jsonl:5" and 0.8 <= rejects[3]["jaccard"] < 1.0


def test_flag_keeps_contaminated_documents_and_lists_them(planted):
    info = _index(planted["root"], {"a": planted["a"]}, "idx", _filters(planted["bench"], "flag", near=False))
    assert len(_kept_sources(planted["root"] / "idx")) == 8
    assert "contaminated" not in info.dropped and info.filtered_by_source == {"a": {"contaminated": 2}}
    rejects = (planted["root"] / "idx" / "rejects.jsonl").read_text().splitlines()
    assert [json.loads(r)["action"] for r in rejects] == ["flag", "flag"]


def test_clean_data_indexes_to_the_same_arrays_with_the_filters_on_or_off(planted):
    clean_a, clean_b = planted["clean"]
    sources = {"a": clean_a, "b": clean_b}
    root = planted["root"]
    _index(root, sources, "off", None)
    on = _index(root, sources, "on", _filters(planted["bench"]))
    for name in ARRAY_NAMES:
        assert (root / "off" / f"{name}.npy").read_bytes() == (root / "on" / f"{name}.npy").read_bytes(), name
    assert on.filtered_by_source == {s: {"contaminated": 0, "near_duplicate": 0} for s in sources}
    # Off, nothing of the filters shows in the index folder.
    assert sorted(p.name for p in (root / "off").iterdir()) == sorted(
        [f"{n}.npy" for n in ARRAY_NAMES] + ["index.json", INDEX_SHA256]
    )
    meta = json.loads((root / "off" / "index.json").read_text())
    assert "text_filters" not in meta and set(meta["config"]) == {"max_length", "dedup", "eval_fraction", "split_salt"}


def test_the_kept_document_is_the_first_by_source_order_then_line(planted):
    rng = np.random.default_rng(5)
    text = chat(sentence(rng, 30), sentence(rng, 60))
    variant = change_words(text, [50])
    others = [chat(sentence(rng, 30), sentence(rng, 60)) for _ in range(3)]
    root, filters = planted["root"], _filters(planted["bench"], near=True)
    _index(root, {"x": [others[0], variant, text], "y": [text, others[1]]}, "xy", filters)
    assert _kept_sources(root / "xy") == ["x:1", "x:2", "y:2"]
    _index(root, {"y": [text, others[1]], "x": [others[0], variant, text]}, "yx", filters)
    assert _kept_sources(root / "yx") == ["y:1", "y:2", "x:1"]


def test_documents_the_spans_stage_dropped_are_skipped_in_the_rendered_text(planted):
    """The pbin shard lacks a.jsonl:2 (as after a spans reject): texts still pair with their documents."""
    info = _index(planted["root"], {"a": planted["a"]}, "idx", _filters(planted["bench"], near=False), skipped=(1,))
    assert info.dropped["contaminated"] == 2
    assert _kept_sources(planted["root"] / "idx") == [f"a:{i}" for i in (1, 4, 5, 7, 8)]


def test_a_rendered_shard_or_a_scan_of_another_source_is_refused(planted):
    root, filters = planted["root"], _filters(planted["bench"])
    a = write_shard(root / "shards", "a", planted["a"])
    b = write_shard(root / "shards", "b", planted["b"])
    with pytest.raises(ValueError, match=r"b\.rendered\.jsonl: no rendered record for document 0 \(a\.jsonl:1\)"):
        _scans(root, [(b[0], a[1])], filters)
    (scan_b,) = _scans(root, [b], filters)
    with pytest.raises(ValueError, match=r"a text scan of 6 documents for .*a\.pbin of 8; rerun the data stages"):
        build_index([a[1]], root / "idx", text_filters=dataclasses.replace(filters, scan_paths=[scan_b]))
