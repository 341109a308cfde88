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
from sftflow.tasks.core.manifests import DatasetIndex, TemplateChoice, TokenizerRef, TrainResult
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.train import config as train_config
from sftflow.tasks.train.checkpoint import latest_checkpoint
from sftflow.tasks.train.config import TrainConfig, TrainOptions
from sftflow.tasks.train.launch import LiveMetrics, train
from sftflow.tasks.train.resolved import ResolvedRun

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
    resolved: ResolvedRun | None = None,
    live_track: LiveMetrics | None = None,
) -> TrainResult:
    """`resolved` (`resolve_train`): the run's choices, made before the key, whose concrete values are part of it
    (None: resolved at launch, and no part of it). `live_track` sends the metrics to the trackers while the run
    trains; it is no part of the cache key (another tracker trains no new model)."""
    # Every node of a multi-node run gets the same key (`options.node_rank` is not part of it), hence one run folder.
    config = run_config(index, plan, tokenizer, options, chat_template, out_dir)
    # A run that stopped part-way resumes from its latest checkpoint, whether this is a retry or a new flow run.
    resume = latest_checkpoint(out_dir / "checkpoints") is not None
    return train(config, resume=resume, live=live_track, resolved=resolved)


def run_config(
    index: DatasetIndex,
    plan: PlanManifest,
    tokenizer: TokenizerRef,
    options: TrainOptions,
    chat_template: str | None,
    out_dir: Path | str | None,
    template_choice: TemplateChoice | None = None,
) -> TrainConfig:
    """One run's `TrainConfig`: the options, and the data, plan, tokenizer and template the earlier stages made
    (`out_dir` None: not written anywhere yet, for `resolve_train`)."""
    return train_config.run_config(
        options, data=str(index.dir), plan=str(plan.dir), tokenizer=tokenizer.path, chat_template=chat_template,
        out=str(out_dir) if out_dir is not None else "", template_choice=template_choice,
    )  # fmt: skip


def resolve_train(
    index: DatasetIndex,
    plan: PlanManifest,
    tokenizer: TokenizerRef,
    options: TrainOptions,
    chat_template: str | None,
    template_choice: TemplateChoice | None = None,
) -> ResolvedRun:
    """Every `auto` of the run `train_stage_task` would launch, made concrete on this host's hardware
    (`sftflow.tasks.train.resolved.resolve_run`), for the task's `resolved` and so its cache key. `template_choice`:
    how the data stage chose `chat_template`, for the run's template line."""
    from sftflow.tasks.train.resolved import resolve_run

    return resolve_run(run_config(index, plan, tokenizer, options, chat_template, None, template_choice))


@task(name="train", retries=2, retry_delay_seconds=10)
def train_task(config: TrainConfig) -> TrainResult:
    """`train` as a plain (uncached) Prefect task, for flows of your own: a retry of this task run continues the run
    its failed attempt started."""
    from prefect.runtime import task_run

    return train(config, resume=config.checkpoint.resume or task_run.run_count > 1)
