"""Data mixtures: each source's planned trained tokens match its request, reproducibly, from whole documents."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftflow.tasks.data.index import build_index, load_index
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.reader import IndexedDataset
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.plan.config import SourceShare
from sftflow.tasks.plan.mixture import DocSources, resolve_mixture
from sftflow.tasks.plan.plan_files import plan_from_index
from sftflow.tasks.plan.planner import PlanConfig, plan

NAMES = ["chat", "code", "math"]


def _three_sources(seed: int = 0):
    """Documents of three sources of different sizes, lognormal lengths, every token but the first a target."""
    rng = np.random.default_rng(seed)
    sizes = [600, 250, 80]
    source = np.repeat(np.arange(3), sizes).astype(np.int32)
    lengths = np.clip(rng.lognormal(4.5, 0.6, size=len(source)).astype(np.int64), 4, 500)
    return lengths, lengths - 1, DocSources(names=NAMES, source_of_doc=source)


def _planned_by_source(arrays, targets, sources):
    ids = arrays.doc_ids
    return np.bincount(sources.source_of_doc[ids], weights=targets[ids], minlength=len(sources.names))


def _largest_doc(targets, sources):
    return np.array([targets[sources.source_of_doc == s].max() for s in range(len(sources.names))])


def test_weights_give_each_source_its_share_within_one_document():
    lengths, targets, sources = _three_sources()
    weights = [0.5, 0.3, 0.2]
    config = PlanConfig(
        num_ranks=2,
        tokens_per_rank=1024,
        mixture=tuple(SourceShare(name=n, weight=w) for n, w in zip(NAMES, weights, strict=True)),
    )
    arrays, stats = plan(lengths, targets, config, sources=sources)
    total = targets.sum()  # every source weighted: the mix is one pass over all of them
    requested = total * np.array(weights)
    planned = _planned_by_source(arrays, targets, sources)
    assert np.all(np.abs(planned - requested) <= _largest_doc(targets, sources))
    # "math" is small (80 docs) and asked for 20% of the mix: it is up-sampled with whole documents repeated
    math_ids = arrays.doc_ids[sources.source_of_doc[arrays.doc_ids] == 2]
    assert len(math_ids) > 80 and np.bincount(math_ids).max() >= 2
    # "chat" is down-sampled: some of its documents are left out
    chat_ids = arrays.doc_ids[sources.source_of_doc[arrays.doc_ids] == 0]
    assert len(np.unique(chat_ids)) < 600
    by_name = {s.name: s for s in stats.sources}
    for name, w, p in zip(NAMES, weights, planned, strict=True):
        assert by_name[name].requested_share == pytest.approx(w)
        assert by_name[name].planned_tokens == p
        assert abs(by_name[name].planned_share - w) < 0.02
    # and the plan's denominators still count exactly what the rows hold
    assert arrays.step_loss_tokens.sum() == planned.sum()


def test_fixed_amounts_and_weights_share_one_mix():
    lengths, targets, sources = _three_sources()
    available = np.bincount(sources.source_of_doc, weights=targets).astype(np.int64)
    shares = (
        SourceShare(name="chat", max_tokens=20_000),
        SourceShare(name="code", epochs=1.5),
        SourceShare(name="math", weight=0.25),
    )
    mixture = resolve_mixture(shares, sources, targets)
    fixed = min(20_000, available[0]) + 1.5 * available[1]
    total = fixed / (1 - 0.25)
    assert mixture.requested == pytest.approx([min(20_000, available[0]), 1.5 * available[1], 0.25 * total])
    arrays, _ = plan(lengths, targets, PlanConfig(num_ranks=1, tokens_per_rank=1024, mixture=shares), sources=sources)
    planned = _planned_by_source(arrays, targets, sources)
    assert np.all(np.abs(planned - mixture.requested) <= _largest_doc(targets, sources))


def test_a_cap_larger_than_the_source_takes_it_once():
    lengths, targets, sources = _three_sources()
    shares = (SourceShare(name="math", max_tokens=10**9),)
    arrays, _ = plan(lengths, targets, PlanConfig(num_ranks=1, tokens_per_rank=1024, mixture=shares), sources=sources)
    assert sorted(arrays.doc_ids.tolist()) == list(range(len(lengths)))


def test_mixture_plans_are_reproducible_and_epochs_draw_anew():
    lengths, targets, sources = _three_sources()
    shares = tuple(SourceShare(name=n, weight=w) for n, w in zip(NAMES, [0.2, 0.3, 0.5], strict=True))
    config = PlanConfig(num_ranks=2, tokens_per_rank=1024, epochs=2, mixture=shares)
    first, _ = plan(lengths, targets, config, sources=sources)
    again, _ = plan(lengths, targets, config, sources=sources)
    assert np.array_equal(first.doc_ids, again.doc_ids) and np.array_equal(first.row_ptr, again.row_ptr)
    other, _ = plan(lengths, targets, config.model_copy(update={"seed": 1}), sources=sources)
    assert not np.array_equal(first.doc_ids, other.doc_ids)
    epoch_docs = [set(first.doc_ids[first.epoch_of_step[_step_of_doc(first)] == e].tolist()) for e in (0, 1)]
    assert epoch_docs[0] != epoch_docs[1]  # "chat" is down-sampled, each epoch with a fresh draw


def _step_of_doc(arrays):
    rows_per_step = arrays.num_ranks * arrays.micro_batches_per_step
    row_of_doc = np.repeat(np.arange(len(arrays.row_ptr) - 1), np.diff(arrays.row_ptr))
    return row_of_doc // rows_per_step


def test_without_a_mixture_sources_change_nothing_but_the_stats():
    lengths, targets, sources = _three_sources()
    config = PlanConfig(num_ranks=2, tokens_per_rank=1024)
    plain, _ = plan(lengths, targets, config)
    with_sources, stats = plan(lengths, targets, config, sources=sources)
    assert np.array_equal(plain.doc_ids, with_sources.doc_ids)
    for s, row in enumerate(stats.sources):
        assert row.planned_tokens == row.available_tokens == targets[sources.source_of_doc == s].sum()


def test_a_source_without_data_or_share_does_not_change_the_weights():
    lengths, targets, _ = _three_sources()
    # "math" is in the index but has no train documents (all went to eval, say): two weighted sources share the mix.
    empty = DocSources(names=[*NAMES, "empty"], source_of_doc=_three_sources()[2].source_of_doc)
    shares = (SourceShare(name="chat", weight=0.5), SourceShare(name="code", weight=0.5))
    with pytest.raises(ValueError, match="weights sum to 1"):
        resolve_mixture(shares, _three_sources()[2], targets)  # "math" has data and no share: a fixed part
    shares += (SourceShare(name="math", weight=1.0),)
    mixture = resolve_mixture(shares, empty, targets)
    assert mixture.requested[3] == 0 and mixture.requested[:3].sum() == pytest.approx(targets.sum())
    with pytest.raises(ValueError, match="dropped as duplicates of an earlier source"):
        resolve_mixture((SourceShare(name="empty", weight=1.0),), empty, targets)


def test_a_zero_weight_leaves_a_source_out():
    lengths, targets, sources = _three_sources()
    available = np.bincount(sources.source_of_doc, weights=targets)
    shares = (
        SourceShare(name="chat", weight=1),
        SourceShare(name="code", weight=1),
        SourceShare(name="math", weight=0),
    )
    mixture = resolve_mixture(shares, sources, targets)
    assert mixture.requested[2] == 0
    assert mixture.requested[:2] == pytest.approx([available[:2].sum() / 2] * 2)
    arrays, stats = plan(
        lengths, targets, PlanConfig(num_ranks=1, tokens_per_rank=1024, mixture=shares), sources=sources
    )
    assert not np.isin(np.flatnonzero(sources.source_of_doc == 2), arrays.doc_ids).any()
    assert stats.sources[2].planned_tokens == 0
    out = resolve_mixture((SourceShare(name="code", epochs=0),), sources, targets)
    assert out.requested[1] == 0 and out.requested[0] == available[0]


def test_mixture_mistakes_are_named():
    lengths, targets, sources = _three_sources()
    with pytest.raises(ValueError, match=r"no source named \['chta'\].*'chat', 'code', 'math'"):
        resolve_mixture((SourceShare(name="chta", weight=1.0),), sources, targets)
    with pytest.raises(ValueError, match="weights sum to 1.2.*must sum below 1"):
        resolve_mixture((SourceShare(name="chat", weight=0.6), SourceShare(name="code", weight=0.6)), sources, targets)
    with pytest.raises(ValueError, match="one of weight, max_tokens and epochs"):
        SourceShare(name="chat", weight=0.5, epochs=2)
    with pytest.raises(ValueError, match="needs each document's source"):
        plan(lengths, targets, PlanConfig(num_ranks=1, tokens_per_rank=1024, mixture=(SourceShare(name="x"),)))


def test_the_index_keeps_each_documents_source_for_the_planner(tmp_path):
    rng = np.random.default_rng(0)
    counts = {"a": 40, "b": 25, "c": 10}
    paths, names = [], []
    for name, n in counts.items():
        docs = []
        for i in range(n):
            length = int(rng.integers(5, 60))
            ids = rng.integers(0, 100, size=length)
            spans = np.array([[1, length]], dtype=np.int32)
            docs.append(TokenizedDoc(input_ids=ids, loss_spans_S2=spans, source=f"{name}.jsonl:{i + 1}"))
        write_pbin(tmp_path / f"{name}.pbin", docs, vocab_size=100, provenance={})
        paths.append(tmp_path / f"{name}.pbin")
        names.append(name)
    build_index([paths[0], paths[1], paths[2]], tmp_path / "index", shard_sources=names, dedup=False)
    index = load_index(tmp_path / "index")
    assert index.source_names == ["a", "b", "c"]
    assert np.bincount(index.source).tolist() == [40, 25, 10]
    dataset = IndexedDataset(tmp_path / "index")
    assert [dataset.source_names[s] for s in dataset.source_ids[:1]] == ["a"]
    # the shards of one source (a big file split in byte ranges) share its name
    build_index(paths, tmp_path / "index-2", shard_sources=["a", "a", "c"], dedup=False)
    two = load_index(tmp_path / "index-2")
    assert two.source_names == ["a", "c"] and np.bincount(two.source).tolist() == [65, 10]

    shares = (SourceShare(name="a", weight=1), SourceShare(name="b", weight=1), SourceShare(name="c", weight=1))
    config = PlanConfig(num_ranks=1, tokens_per_rank=256, mixture=shares)
    plan_from_index(tmp_path / "index", config, tmp_path / "plan")
    stats = json.loads((tmp_path / "plan" / "stats.json").read_text())
    assert [s["name"] for s in stats["sources"]] == ["a", "b", "c"]
    assert all(abs(s["planned_share"] - 1 / 3) < 0.05 for s in stats["sources"])

    # What training logs per step: each source's trained targets, adding up to the step's and the plan's totals.
    from sftflow.tasks.plan.planner import load_plan
    from sftflow.tasks.train.data import trained_tokens_by_source

    arrays = load_plan(tmp_path / "plan" / "plan.npz")
    names, per_step = trained_tokens_by_source(arrays, IndexedDataset(tmp_path / "index"))
    assert names == ["a", "b", "c"] and per_step.shape == (arrays.num_steps, 3)
    assert per_step.sum(axis=1).tolist() == arrays.step_loss_tokens.tolist()
    assert per_step.sum(axis=0).tolist() == [s["planned_tokens"] for s in stats["sources"]]
