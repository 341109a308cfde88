"""The cached `train` Prefect task used by the `sft` pipeline.

The run folder is named by a content key over the dataset index, the plan, the tokenizer, the training options and
the training code, so changing only the learning rate starts a new run while an unchanged rerun is Cached. A run that
stopped part-way (crash, kill) is not valid output yet; the next attempt, whether a Prefect retry or a
fresh flow run, resumes it from its `latest` checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from sftflow.tasks.core.caching import StageCache, retry_unless_bad_input
from sftflow.tasks.core.manifests import DatasetIndex, TokenizerRef, TrainResult
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.train.checkpoint import latest_checkpoint
from sftflow.tasks.train.config import TrainConfig, TrainOptions
from sftflow.tasks.train.launch import LiveMetrics, train

# The worker runs by name (`torchrun -m`), so it is an entry of its own beside this module.
TRAIN_CACHE = StageCache(stage="train", version="1", entries=(__name__, "sftflow.tasks.train.worker"))


# Only the export and the metrics are checked before a cached run is trusted: hashing every checkpoint of a large
# model on each lookup would cost minutes, and checkpoints are not what later stages read.
@stage_task(
    TRAIN_CACHE,
    checked=("hf", "metrics.jsonl"),
    name="train",
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_unless_bad_input,
)
def train_stage_task(
    out_dir: Path,
    index: DatasetIndex,
    plan: PlanManifest,
    tokenizer: TokenizerRef,
    options: TrainOptions,
    chat_template: str | None,
    work_dir: str,
    live_track: LiveMetrics | None = None,
) -> TrainResult:
    """`live_track` sends the metrics to the trackers while the run trains; it is no part of the cache key (another
    tracker trains no new model)."""
    # Every node of a multi-node run gets the same key (`options.node_rank` is not part of it), hence one run folder.
    config = TrainConfig(
        **dict(options),
        data=str(index.dir),
        plan=str(plan.dir),
        tokenizer=tokenizer.path,
        chat_template=chat_template,
        out=str(out_dir),
    )
    # A run that stopped part-way resumes from its latest checkpoint, whether this is a retry or a new flow run.
    return train(config, resume=latest_checkpoint(out_dir / "checkpoints") is not None, live=live_track)


@task(name="train", retries=2, retry_delay_seconds=10)
def train_task(config: TrainConfig) -> TrainResult:
    """`train` as a plain (uncached) Prefect task, for flows of your own: a retry of this task run continues the run
    its failed attempt started."""
    from prefect.runtime import task_run

    return train(config, resume=config.checkpoint.resume or task_run.run_count > 1)
