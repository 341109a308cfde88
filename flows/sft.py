"""The `sft` flow: sft-data → sft-plan → sft-train → sft-eval, each also a flow of its own.

Every stage is cached on content: a rerun with the same inputs is Cached end to end; editing the chat template
reruns data and everything after it; changing only the learning rate reruns train and eval. `force` names stages to
recompute regardless. A failed train stage resumes from its last checkpoint on the next attempt.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from pydantic import BaseModel, ConfigDict

from sftflow.flows.config import SFTConfig, resolve_config
from sftflow.flows.data import DataResult, sft_data
from sftflow.flows.eval import sft_eval
from sftflow.flows.plan import sft_plan
from sftflow.flows.results import work_dir_lock
from sftflow.flows.train import sft_train
from sftflow.tasks.manifests import EvalReport
from sftflow.tasks.plan_stage import PlanManifest
from sftflow.tasks.train.launch import TrainResult

STAGES = ("data", "plan", "train", "eval")


class SFTResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: DataResult
    plan: PlanManifest
    train: TrainResult
    eval: EvalReport


@flow(name="sft", log_prints=True)
def sft(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    learning_rate: float | None = None,
    max_steps: int | None = None,
    epochs: int | None = None,
    force: list[str] | None = None,
    fault: str | None = None,
) -> SFTResult:
    """Conversations + base model → fine-tuned, evaluated checkpoint.

    `config_path` (YAML) or `config` (inline) is the whole configuration; `learning_rate`, `max_steps` and `epochs`
    override it (flat, so `prefect deployment run sft/full -p learning_rate=1e-5` works). `force` lists stages to
    recompute. `fault` is a test hook that makes the training worker fail (see `sftflow.tasks.train.worker`).
    """
    force = list(force or [])
    unknown = sorted(set(force) - set(STAGES))
    if unknown:
        raise ValueError(f"force: unknown stage(s) {unknown}; expected some of {list(STAGES)}")
    cfg = resolve_config(config_path, config, learning_rate, max_steps, epochs)
    with work_dir_lock(Path(cfg.work_dir).resolve()):
        data = sft_data(config=cfg, force="data" in force)
        plan = sft_plan(config=cfg, force="plan" in force, data=data)
        trained = sft_train(config=cfg, force="train" in force, fault=fault, data=data, plan=plan)
        report = sft_eval(config=cfg, force="eval" in force, data=data, train=trained)
    return SFTResult(data=data, plan=plan, train=trained, eval=report)
