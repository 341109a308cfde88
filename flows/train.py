"""The `sft-train` flow: train on the planned dataset. Reruns resume a partial run; an unchanged run is Cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal

from sftflow.flows.config import SFTConfig, resolve_config, with_shorthands
from sftflow.flows.data import DataResult, load_data_result
from sftflow.flows.plan import load_plan_result
from sftflow.flows.results import read_stage_result, work_dir_lock, write_stage_result
from sftflow.flows.run_page import record_cancelled_tasks
from sftflow.tasks.core.fingerprint import sha256_tree
from sftflow.tasks.core.manifests import ModelRef, TrainResult
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.track.live import live_tracker
from sftflow.tasks.train.stage import resolve_train, train_stage_task


@flow(name="sft-train", log_prints=True)
def sft_train(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    learning_rate: float | None = None,
    max_steps: int | None = None,
    force: bool = False,
    data: DataResult | None = None,
    plan: PlanManifest | None = None,
    end_tracking: bool = True,
) -> TrainResult:
    """Train with torchrun. `overrides` sets config fields by dotted key (`{"train.optimizer.lr": 1e-5}`), as the
    CLI's `--set` does; `learning_rate` and `max_steps` are shorthands of `train.optimizer.lr` and
    `train.max_steps`. `data` and `plan` default to the work folder's latest results of those stages.
    `end_tracking`: finish the live tracker runs when training ends, as no evaluation follows in this flow alone (a
    later `sft` run's evaluation still goes into them); the `sft` pipeline passes False, its evaluation ends them."""
    cfg = resolve_config(
        config_path, config, with_shorthands(overrides, learning_rate=learning_rate, max_steps=max_steps)
    )
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work, cfg.train.node_rank):
        data = data or load_data_result(work)
        plan = plan or load_plan_result(work)
        task = train_stage_task.with_options(retries=cfg.train_retries, refresh_cache=force)
        # Rank 0 writes the metrics, and one node sends them: the others would open runs of their own.
        live = live_tracker(cfg.track, work, end_runs=end_tracking) if cfg.train.node_rank == 0 else None
        try:
            # Every `auto` resolved once, here: its concrete values are part of the run's cache key.
            resolved = resolve_train(
                data.index, plan, data.tokenizer, cfg.train, data.chat_template, data.template_choice
            )
            result = task(
                data.index, plan, data.tokenizer, cfg.train, data.chat_template, str(work), resolved=resolved,
                live_track=live,
            )  # fmt: skip
        except TerminationSignal:
            record_cancelled_tasks()
            raise
        write_stage_result(work, "train", result)
        return result


def trained_model(train: TrainResult) -> ModelRef:
    """The run's Hugging Face export, with its hash, as the model to evaluate or promote."""
    if train.hf_dir is None:
        raise ValueError(f"{train.run_dir}: training wrote no Hugging Face export (train.export is false)")
    # A result written before the export's hash was recorded is hashed here.
    return ModelRef(spec=train.hf_dir, sha256=train.hf_sha256 or sha256_tree(train.hf_dir))


def load_train_result(work_dir: str | Path) -> TrainResult:
    return read_stage_result(work_dir, "train", TrainResult)
