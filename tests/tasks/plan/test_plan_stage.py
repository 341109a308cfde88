"""The plan stage's per-document target counts match what the collator trains on."""

from __future__ import annotations

import numpy as np

from sftflow.tasks.data.index import build_index
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.reader import IndexedDataset
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.plan.plan_files import plan_from_index
from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.collate import collate, packed_collator, trainable_target_count


def _docs(rng, n):
    docs = []
    for i in range(n):
        length = int(rng.integers(2, 40))
        start = 0 if i % 3 == 0 else int(rng.integers(1, length))  # every third doc trains its first token
        spans = np.array([[start, int(rng.integers(start + 1, length + 1))]], dtype=np.int32)
        ids = rng.integers(0, 100, size=length)
        docs.append(TokenizedDoc(input_ids=ids, loss_spans_S2=spans, source=f"x.jsonl:{i + 1}"))
    return docs


def test_target_counts_and_plan_denominators_match_the_collator(tmp_path):
    rng = np.random.default_rng(0)
    write_pbin(tmp_path / "a.pbin", _docs(rng, 50), vocab_size=100, provenance={})
    write_pbin(tmp_path / "b.pbin", _docs(rng, 30), vocab_size=100, provenance={}, with_spans=False)
    build_index([tmp_path / "a.pbin", tmp_path / "b.pbin"], tmp_path / "index", dedup=False)
    dataset = IndexedDataset(tmp_path / "index")
    expected = [trainable_target_count(len(ids), spans) for ids, spans in (dataset[i] for i in range(len(dataset)))]
    assert dataset.trainable_target_counts().tolist() == expected

    arrays, _ = plan_from_index(tmp_path / "index", PlanConfig(num_ranks=2, tokens_per_rank=64), tmp_path / "plan")
    rows_per_step = arrays.num_ranks * arrays.micro_batches_per_step
    for step, denominator in enumerate(arrays.step_loss_tokens):
        collated = 0
        for row in range(step * rows_per_step, (step + 1) * rows_per_step):
            docs = [dataset[int(d)] for d in arrays.doc_ids[arrays.row_ptr[row] : arrays.row_ptr[row + 1]]]
            collated += collate(docs, packed_collator())["num_loss_tokens"]
        assert collated == denominator
