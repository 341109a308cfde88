"""The `sft-plan` flow: dataset index → `plan.npz` for every step × micro-batch × rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from sftflow.flows.config import SFTConfig, plan_inputs, resolve_config, with_shorthands
from sftflow.flows.data import DataResult, load_data_result
from sftflow.flows.results import read_stage_result, work_dir_lock, write_stage_result
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.plan.row_length import read_row_length
from sftflow.tasks.plan.stage import plan_task


@flow(name="sft-plan", log_prints=True)
def sft_plan(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    epochs: int | None = None,
    force: bool = False,
    data: DataResult | None = None,
) -> PlanManifest:
    """Plan the train split. `overrides` sets config fields by dotted key (`{"plan.tokens_per_rank": 4096}`), as the
    CLI's `--set` does; `epochs` is a shorthand of `plan.epochs`. `data` defaults to the work folder's latest
    `sft-data` result."""
    cfg = resolve_config(config_path, config, with_shorthands(overrides, epochs=epochs))
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work):
        data = data or load_data_result(work)
        task = plan_task.with_options(refresh_cache=True) if force else plan_task
        vocab_size = max((shard.vocab_size for shard in data.index.shards), default=None)
        config, row_length = plan_inputs(cfg, vocab_size)
        manifest = task(data.index, config, str(work), row_length)
        write_stage_result(work, "plan", manifest)
        s = manifest.stats
        # The reason the plan recorded: a cached plan keeps the one it was first sized with.
        recorded = read_row_length(manifest.dir) or row_length
        get_run_logger().info("sft-plan: tokens_per_rank %s (%s)", f"{config.tokens_per_rank:,}", recorded.reason)
        get_run_logger().info(
            "sft-plan: %d steps, efficiency %.2f%%, token imbalance %.3f, cost imbalance %.3f",
            s.num_steps,
            100 * s.efficiency,
            s.token_imbalance,
            s.cost_imbalance,
        )
        for source in s.sources if len(s.sources) > 1 else ():
            get_run_logger().info(
                "sft-plan: source %s: %.1f%% of the trained tokens (asked %.1f%%), %d visits of %d documents",
                source.name,
                100 * source.planned_share,
                100 * source.requested_share,
                source.planned_docs,
                source.docs,
            )
        return manifest


def load_plan_result(work_dir: str | Path) -> PlanManifest:
    return read_stage_result(work_dir, "plan", PlanManifest)
