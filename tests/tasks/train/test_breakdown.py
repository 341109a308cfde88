"""Records' tags travel render → spans → pbin → index, and training breaks its loss and token accuracy down by data
source and by tag (per step, in metrics.jsonl), adding up to the step's totals on 1 and 2 gloo ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sftflow.tasks.data.formats import RecordError
from sftflow.tasks.data.index import build_index, load_index
from sftflow.tasks.data.pbin import PbinFile, write_pbin
from sftflow.tasks.data.reader import UNTAGGED, IndexedDataset
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.data.render import RenderConfig, read_rendered_shard, render_record, render_source
from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
from sftflow.tasks.train.breakdown import breakdown_of, doc_of_target
from sftflow.tasks.train.collate import collate, packed_collator, padded_collator
from sftflow.tasks.train.config import TrainConfig
from tests.tasks.train_helpers import metrics, run

TEXT = RenderConfig(format="text_spans", template=None)


def test_a_records_tag_is_rendered_kept_and_checked(tmp_path):
    record = {"text": "hello world", "spans": [[6, 11]], "tag": "greeting"}
    assert render_record(record, None, TEXT).tag == "greeting"
    assert render_record({**record, "tag": 7}, None, TEXT).tag == "7"
    assert render_record({**record, "tag": ""}, None, TEXT).tag is None
    assert render_record({k: v for k, v in record.items() if k != "tag"}, None, TEXT).tag is None
    assert render_record({**record, "kind": "x"}, None, TEXT.model_copy(update={"tag_field": "kind"})).tag == "x"
    with pytest.raises(
        RecordError, match=r"data.jsonl:3: tag is list; a tag is a string \(render.tag_field: null reads no tags\)"
    ):
        render_record({**record, "tag": ["a"]}, None, TEXT, source="data.jsonl:3")

    src = tmp_path / "data.jsonl"
    rows = [record, {**record, "tag": None}, {**record, "tag": {"a": 1}}, {**record, "tag": "other"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = render_source(src, tmp_path / "out.jsonl", TEXT.model_copy(update={"on_bad_record": "reject"}), None)
    assert (stats.rendered, stats.rejected, stats.rejects_by_field) == (3, 1, {"tag": 1})
    assert [d.tag for d in read_rendered_shard(tmp_path / "out.jsonl")] == ["greeting", None, "other"]


def _doc(tag: str | None, n: int = 8, seed: int = 0) -> TokenizedDoc:
    ids = np.random.default_rng(seed).integers(5, 90, size=n)
    return TokenizedDoc(ids, np.array([[2, n]], dtype=np.int32), source=f"s:{seed}", tag=tag)


def test_pbin_and_index_keep_each_documents_tag(tmp_path):
    a = write_pbin(tmp_path / "a.pbin", [_doc("x", seed=1), _doc(None, seed=2), _doc("y", seed=3)], 100, {})
    b = write_pbin(tmp_path / "b.pbin", [_doc("y", seed=4), _doc("z", seed=5)], 100, {})
    plain = write_pbin(tmp_path / "c.pbin", [_doc(None, seed=6)], 100, {})
    with PbinFile(a.path, verify=True) as f:
        assert f.tag_names == ["x", "y"] and [f.tag(i) for i in range(3)] == ["x", None, "y"]
    with PbinFile(plain.path, verify=True) as f:
        assert not f.has_tags and "tag_names" not in f._sections and f.tag(0) is None

    build_index([a.path, b.path, plain.path], tmp_path / "index", dedup=False)
    index = load_index(tmp_path / "index", verify=True)
    assert index.tag_names == ["x", "y", "z"]  # first appearance, across shards
    dataset = IndexedDataset(index)
    assert [dataset.tag(i) for i in range(len(dataset))] == ["x", None, "y", "y", "z", None]
    assert dataset.tag_labels(np.array([1, 4])) == [UNTAGGED, "z"]


def test_beyond_max_tags_the_most_frequent_are_kept_and_the_rest_counted_as_other():
    from sftflow.tasks.data.index import OTHER_TAG, fold_rare_tags

    # tag 3 is the most frequent, then 0 and 5 (tie: first appearance wins over 1), the rest are rare
    tag = np.array([0, 3, 3, 1, 3, -1, 0, 2, 4, 5, 5, 6], dtype=np.int32)
    names = [f"t{i}" for i in range(7)]
    folded, kept = fold_rare_tags(tag, names, limit=4)
    assert kept == ["t0", "t3", "t5", OTHER_TAG]  # in order of first appearance
    assert [kept[i] if i >= 0 else None for i in folded] == [
        "t0", "t3", "t3", OTHER_TAG, "t3", None, "t0", OTHER_TAG, OTHER_TAG, "t5", "t5", OTHER_TAG
    ]  # fmt: skip
    same, unchanged = fold_rare_tags(tag, names, limit=7)
    assert unchanged == names and same is tag


def _tagged_index(folder, sources=("chat", "code"), n=48):
    """`n` documents over two shards (sources), tagged easy / hard / untagged in turn."""
    rng = np.random.default_rng(0)
    paths, per_shard = [], n // len(sources)
    for s, _ in enumerate(sources):
        docs = []
        for i in range(per_shard):
            length = int(rng.integers(6, 40))
            start = int(rng.integers(1, length - 1))
            ids = rng.integers(5, 200, size=length)
            tag = ["easy", "hard", None][(s * per_shard + i) % 3]
            docs.append(TokenizedDoc(ids, np.array([[start, length]], dtype=np.int32), f"{s}:{i}", tag))
        paths.append(write_pbin(folder / f"shard{s}.pbin", docs, 256, {}).path)
    build_index(paths, folder, dedup=False, shard_sources=list(sources))
    return IndexedDataset(folder)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_each_trained_target_gets_its_documents_source_and_tag_cell(tmp_path, mode):
    dataset = _tagged_index(tmp_path)
    breakdown = breakdown_of(dataset)
    assert breakdown.groupings == (("source", ("chat", "code")), ("tag", ("easy", "hard", UNTAGGED)))
    ids = np.array([3, 30, 7, 45])
    fns = packed_collator(0) if mode == "packed" else padded_collator(0)
    batch = collate([dataset[int(i)] for i in ids], fns)
    cells = breakdown.row_cells(ids, doc_of_target(batch)).numpy()
    expected = []  # each document's targets, in order: its trained positions but the first token
    for i in ids:
        targets = int(dataset.trainable_target_counts()[i])
        tag = dataset.tag(int(i))
        tag_cell = 2 + {"easy": 0, "hard": 1, None: 2}[tag]
        expected += [(int(dataset.source_ids[i]), tag_cell)] * targets
    assert [tuple(c) for c in cells.T] == expected
    one_source = IndexedDataset(build_index_one(tmp_path / "one"))
    assert breakdown_of(one_source) is None  # one source, no tags: nothing to break down


def build_index_one(folder):
    folder.mkdir()
    path = write_pbin(folder / "s.pbin", [_doc(None, seed=i) for i in range(4)], 100, {}).path
    build_index([path], folder, dedup=False)
    return folder


def _tagged_training(root, tokenizer_dir, num_ranks: int, tokens_per_rank: int, **train):
    """Tagged data from two sources, its plan, and a training config over them (`train` overrides)."""
    dataset = _tagged_index(root / "data", n=96)
    config = PlanConfig(num_ranks=num_ranks, tokens_per_rank=tokens_per_rank, seed=0)
    arrays, _ = plan(dataset.lengths, dataset.trainable_target_counts(), config)
    (root / "plan").mkdir()
    save_plan(arrays, root / "plan" / "plan.npz")
    base = TrainConfig(
        data=str(root / "data"),
        plan=str(root / "plan"),
        model="tiny-llama",
        tokenizer=str(tokenizer_dir),
        out=str(root / "unused"),
        seed=0,
        export=False,
        **train,
        optimizer=dict(lr=1e-2),
    )
    return dataset, arrays, base


@pytest.fixture(scope="module")
def tagged_runs(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("breakdown")
    dataset, arrays, base = _tagged_training(
        root, tiny_tokenizer_dir, num_ranks=2, tokens_per_rank=128, num_threads=1, device="cpu", max_steps=4
    )
    one = run(base, root / "one", nproc=1)
    two = run(base, root / "two", nproc=2)
    return dataset, arrays, metrics(one.run_dir), metrics(two.run_dir)


def test_training_breaks_loss_and_accuracy_down_by_source_and_tag(tagged_runs):
    dataset, arrays, rows, _ = tagged_runs
    check_breakdown(dataset, arrays, rows, rel=1e-5)


@pytest.mark.gpu
def test_the_breakdown_on_one_gpu_adds_up_as_on_cpu(tmp_path, tiny_tokenizer_dir):
    """The one-GPU path (bf16, compiled layers, the Triton fused loss with row stats) on the same tagged data."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dataset, arrays, base = _tagged_training(
        tmp_path, tiny_tokenizer_dir, num_ranks=1, tokens_per_rank=256, device="cuda", max_steps=6
    )
    result = run(base, tmp_path / "gpu", nproc=1)
    rows = metrics(result.run_dir)
    assert len(rows) == 6
    check_breakdown(dataset, arrays, rows, rel=1e-4)


def check_breakdown(dataset, arrays, rows, rel: float) -> None:
    targets = dataset.trainable_target_counts()
    rows_per_step = arrays.num_ranks * arrays.micro_batches_per_step
    for step, row in enumerate(rows):
        first, last = arrays.row_ptr[step * rows_per_step], arrays.row_ptr[(step + 1) * rows_per_step]
        docs = arrays.doc_ids[first:last]
        for kind, names in (("source", ("chat", "code")), ("tag", ("easy", "hard", UNTAGGED))):
            cells = row["breakdown"][kind]
            assert list(cells) == list(names)
            # the kernel's per-token counts equal the plan's, document by document
            if kind == "source":
                of_doc = [names[s] for s in dataset.source_ids[docs]]
            else:
                of_doc = dataset.tag_labels(docs)
            for name in names:
                want = int(sum(targets[d] for d, n in zip(docs, of_doc, strict=True) if n == name))
                assert cells[name]["trained_tokens"] == want, (step, kind, name)
            assert sum(c["trained_tokens"] for c in cells.values()) == row["trained_tokens"]
            weighted = sum(c["loss"] * c["trained_tokens"] for c in cells.values() if c["trained_tokens"])
            assert weighted / row["trained_tokens"] == pytest.approx(row["loss"], rel=rel)
            for c in cells.values():
                if c["trained_tokens"]:  # a whole number of hits out of the cell's targets
                    hits = c["token_accuracy"] * c["trained_tokens"]
                    assert 0 <= hits <= c["trained_tokens"] and hits == pytest.approx(round(hits), abs=1e-6)
        by_plan = row["trained_tokens_by_source"]
        assert by_plan == {k: v["trained_tokens"] for k, v in row["breakdown"]["source"].items()}


def test_two_ranks_break_the_loss_down_as_one_rank_does(tagged_runs):
    _, _, one, two = tagged_runs
    for a, b in zip(one, two, strict=True):
        for kind in ("source", "tag"):
            for name, cell in a["breakdown"][kind].items():
                other = b["breakdown"][kind][name]
                assert other["trained_tokens"] == cell["trained_tokens"]
                if cell["trained_tokens"]:
                    assert other["loss"] == pytest.approx(cell["loss"], rel=1e-4)
                    assert other["token_accuracy"] == pytest.approx(cell["token_accuracy"], abs=1e-9)


def test_trackers_get_the_breakdown_as_flat_step_metrics(tagged_runs):
    from sftflow.tasks.track.record import step_rows

    _, _, rows, _ = tagged_runs
    flat = step_rows(rows)
    assert len(flat) == len(rows)
    for row, out in zip(rows, flat, strict=True):
        for kind, cells in row["breakdown"].items():
            for name, cell in cells.items():
                key = f"train/{kind}/{name.replace('(', '_').replace(')', '_')}/loss"
                assert (key in out) == (cell["loss"] is not None)
                if cell["loss"] is not None:
                    assert out[key] == cell["loss"]
        assert "breakdown" not in out
