"""The `sft-plan` flow: dataset index → `plan.npz` for every step × micro-batch × rank."""

from __future__ import annotations

import shutil
from pathlib import Path

from prefect import flow, get_run_logger

from sftflow.flows.data import load_data_result
from sftflow.tasks.manifests import DatasetIndex
from sftflow.tasks.plan import PlanConfig
from sftflow.tasks.plan_stage import PlanManifest, plan_task


@flow(name="sft-plan", log_prints=True)
def sft_plan(index: DatasetIndex, config: PlanConfig, work_dir: str, force: bool = False) -> PlanManifest:
    task = plan_task.with_options(refresh_cache=True) if force else plan_task
    manifest = task(index, config, work_dir)
    s = manifest.stats
    get_run_logger().info(
        "sft-plan: %d steps, efficiency %.2f%%, token imbalance %.3f, cost imbalance %.3f",
        s.num_steps,
        100 * s.efficiency,
        s.token_imbalance,
        s.cost_imbalance,
    )
    return manifest


def run_plan(data_dir: str, config: PlanConfig, work_dir: str, force: bool = False) -> PlanManifest:
    """Plan the train split of `sftflow data`'s output; `work_dir/plan.npz` is a copy of the cached plan."""
    data = load_data_result(data_dir)
    manifest = sft_plan(index=data.index, config=config, work_dir=work_dir, force=force)
    out = Path(work_dir)
    if Path(manifest.path).resolve() != (out / "plan.npz").resolve():
        shutil.copyfile(manifest.path, out / "plan.npz")
    return manifest
