"""Planning a dataset index into `plan.npz`, `stats.json` and `row_length.json`, without Prefect: the `plan` stage
task calls this, and so does `sftflow plan --data INDEX` on a machine that may have no Prefect (a bare GPU image)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.data.index import load_index
from sftflow.tasks.data.reader import IndexedDataset
from sftflow.tasks.plan.mixture import DocSources
from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
from sftflow.tasks.plan.row_length import RowLength, write_row_length


def plan_from_index(
    index_dir: str | Path, config: PlanConfig, out_dir: Path, split: str = "train", row_length: RowLength | None = None
):
    """Plan from the index alone: its lengths and trainable-target counts (the shards are not read). `row_length`:
    how `config.tokens_per_rank` was chosen, recorded beside the plan (`sftflow.tasks.plan.row_length`)."""
    # The index's arrays are checked against index.json (a byte flipped in them would change the plan silently).
    dataset = IndexedDataset(load_index(index_dir, verify=True), split=split)
    if len(dataset) == 0:
        dropped = dataset.index.meta.get("dropped", {})
        came_in = dataset.index.meta.get("num_docs_in", 0)
        raise ValueError(
            f"nothing to plan: the dataset index {index_dir} has no {split} documents ({came_in} documents came in, "
            f"dropped {dropped}); check that the sources hold records (an empty file yields none) and the rejects "
            "files of the render and spans stages"
        )
    sources = DocSources(names=dataset.source_names, source_of_doc=dataset.source_ids)
    targets = dataset.trainable_target_counts()
    return plan_into(out_dir, np.asarray(dataset.lengths), targets, config, dataset.source, sources, row_length)


def plan_into(
    out_dir: Path,
    doc_lengths: np.ndarray,
    target_counts: np.ndarray,
    config: PlanConfig,
    describe,
    sources: DocSources | None = None,
    row_length: RowLength | None = None,
):
    """`out_dir/plan.npz` and `out_dir/stats.json` for documents of these lengths and trained-target counts;
    `describe(doc)` names a document in errors; `sources` gives each document's source (for mixtures); `row_length`
    (how `config.tokens_per_rank` was chosen) goes into `out_dir/row_length.json`."""
    arrays, stats = plan(doc_lengths, target_counts, config, describe, sources)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(arrays, out_dir / "plan.npz")
    write_atomic(out_dir / "stats.json", stats.model_dump_json(indent=2))
    write_row_length(out_dir, row_length, arrays.tokens_per_rank)
    return arrays, stats
