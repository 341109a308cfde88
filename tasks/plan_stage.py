"""The `plan` Prefect task: dataset index (train split) → `plan.npz` plus a manifest carrying the plan's stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prefect import task

from sftflow.tasks.caching import StageCache, retry_on_io_error, write_checksums, write_manifest
from sftflow.tasks.fingerprint import sha256_file
from sftflow.tasks.manifests import DatasetIndex, Manifest
from sftflow.tasks.pbin import open_pbin
from sftflow.tasks.plan import PLAN_FORMAT_VERSION, PlanConfig, PlanStats, plan, save_plan
from sftflow.tasks.reader import IndexedDataset


class PlanManifest(Manifest):
    index_sha256: str
    config: PlanConfig
    stats: PlanStats


def trainable_target_counts(dataset: IndexedDataset) -> np.ndarray:
    """Per item: loss tokens that are real targets, i.e. excluding a document's first token (nothing predicts it).

    This is what the collator counts, so the plan's per-step denominators equal the tokens the loss sums over.
    """
    counts = np.asarray(dataset.loss_token_counts, dtype=np.int64).copy()
    first_trained = np.zeros(len(counts), dtype=bool)
    for s, path in enumerate(dataset.index.shard_paths):
        rows = np.flatnonzero(dataset._shard == s)
        if len(rows) == 0:
            continue
        with open_pbin(path) as f:
            docs = dataset._doc[rows]
            if not f.has_spans:  # every token trained, token 0 included
                first_trained[rows] = True
                continue
            span_offsets, spans = f.section("span_offsets"), f.section("spans")
            has_span = span_offsets[docs + 1] > span_offsets[docs]
            first_start = np.where(has_span, spans.reshape(-1, 2)[np.minimum(span_offsets[docs], len(spans) - 1), 0], 1)
            first_trained[rows] = has_span & (first_start == 0)
    return counts - first_trained


def plan_from_index(index_dir: str | Path, config: PlanConfig, out_dir: Path, split: str = "train"):
    dataset = IndexedDataset(index_dir, split=split)
    arrays, stats = plan(np.asarray(dataset.lengths), trainable_target_counts(dataset), config)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(arrays, out_dir / "plan.npz")
    (out_dir / "stats.json").write_text(stats.model_dump_json(indent=2))
    return arrays, stats


PLAN_CACHE = StageCache(
    stage="plan",
    version=str(PLAN_FORMAT_VERSION),
    modules=("sftflow.tasks.plan_stage", "sftflow.tasks.plan", "sftflow.tasks.packing", "sftflow.tasks.caching"),
)


@task(
    name="plan",
    cache_policy=PLAN_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_on_io_error,
    persist_result=True,
    result_serializer="json",
)
def plan_task(index: DatasetIndex, config: PlanConfig, work_dir: str) -> PlanManifest:
    index.verify()
    out_dir = PLAN_CACHE.output_dir(dict(index=index, config=config, work_dir=work_dir))
    _, stats = plan_from_index(Path(index.path).parent, config, out_dir)
    # Planning time varies run to run; keep it out of the manifest so the manifest is a pure function of its inputs.
    stats = stats.model_copy(update={"planning_seconds": 0.0})
    path = out_dir / "plan.npz"
    manifest = PlanManifest(
        path=str(path), sha256=sha256_file(path), index_sha256=index.sha256, config=config, stats=stats
    )
    write_manifest(out_dir, manifest)
    write_checksums(out_dir)
    return manifest
