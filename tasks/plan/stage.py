"""The `plan` Prefect task: dataset index (train split) → `plan.npz` plus a manifest carrying the plan's stats."""

from __future__ import annotations

from pathlib import Path

from sftflow.tasks.core.caching import StageCache, retry_on_io_error
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.manifests import DatasetIndex
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.plan.plan_files import plan_from_index
from sftflow.tasks.plan.planner import PLAN_FORMAT_VERSION, PlanConfig
from sftflow.tasks.plan.row_length import RowLength

PLAN_CACHE = StageCache(stage="plan", version=str(PLAN_FORMAT_VERSION), entries=(__name__,))


@stage_task(PLAN_CACHE, name="plan", retries=2, retry_delay_seconds=1, retry_condition_fn=retry_on_io_error)
def plan_task(
    out_dir: Path, index: DatasetIndex, config: PlanConfig, work_dir: str, row_length: RowLength | None = None
) -> PlanManifest:
    """Plan `index` with `config`; `row_length` (how its `tokens_per_rank` was chosen) is recorded beside the plan,
    and keyed only as `RowLength.cache_key` says."""
    _, stats = plan_from_index(index.dir, config, out_dir, row_length=row_length)
    # Planning time varies run to run; keep it out of the manifest so the manifest is a pure function of its inputs.
    stats = stats.model_copy(update={"planning_seconds": 0.0})
    path = out_dir / "plan.npz"
    return PlanManifest(path=str(path), sha256=sha256_file(path), index_sha256=index.sha256, config=config, stats=stats)
