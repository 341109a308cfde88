"""The `sft` flow: sft-data → sft-plan → sft-train → sft-eval, each also a flow of its own.

Every stage is cached on content: a rerun with the same inputs is Cached end to end; editing the chat template
reruns data and everything after it; changing only the learning rate reruns train and eval. `force` names stages to
recompute regardless. A failed train stage resumes from its last checkpoint on the next attempt.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from sftflow.flows.config import SFTConfig
from sftflow.flows.data import DataConfig, DataResult, make_task_runner, sft_data
from sftflow.flows.plan import sft_plan
from sftflow.tasks.eval_stage import EvalConfig, EvalReport, ModelRef, eval_task
from sftflow.tasks.fingerprint import sha256_tree
from sftflow.tasks.manifests import DatasetIndex
from sftflow.tasks.plan import PlanConfig
from sftflow.tasks.plan_stage import PlanManifest
from sftflow.tasks.train.launch import TrainResult
from sftflow.tasks.train.stage import train_stage_task

STAGES = ("data", "plan", "train", "eval")


class SFTResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: DataResult
    plan: PlanManifest
    train: TrainResult
    eval: EvalReport


def _check_force(force: list[str]) -> None:
    unknown = sorted(set(force) - set(STAGES))
    if unknown:
        raise ValueError(f"force: unknown stage(s) {unknown}; expected some of {list(STAGES)}")


def resolve_config(
    config_path: str | None,
    config: SFTConfig | None,
    learning_rate: float | None = None,
    max_steps: int | None = None,
    epochs: int | None = None,
) -> SFTConfig:
    """One config from a YAML path or an inline object, with flat overrides (deployment `-p` friendly)."""
    if (config_path is None) == (config is None):
        raise ValueError("give exactly one of config_path (a YAML file) or config (inline)")
    cfg = SFTConfig.from_yaml(config_path) if config_path else config
    train = dict(cfg.train.model_dump())
    if learning_rate is not None:
        train["lr"] = learning_rate
    if max_steps is not None:
        train["max_steps"] = max_steps
    plan = dict(cfg.plan.model_dump())
    if epochs is not None:
        plan["epochs"] = epochs
    cfg = SFTConfig.model_validate({**cfg.model_dump(), "train": train, "plan": plan})
    if cfg.demo is None and cfg.data is None:
        raise ValueError("config: set `data` (sources and tokenizer) or `demo`")
    return cfg


def data_config(cfg: SFTConfig) -> DataConfig:
    """The data section; with `demo`, the generated conversations and tokenizer (written once, reused after)."""
    if cfg.demo is None:
        return cfg.data
    from sftflow.tasks.demo import write_demo

    paths = write_demo(Path(cfg.work_dir) / "demo", n=cfg.demo.records, seed=cfg.demo.seed)
    base = cfg.data.model_dump() if cfg.data else {"render": {"template": "chatml"}, "index": {"eval_fraction": 0.1}}
    base.update(sources=[str(paths["data"])], tokenizer=str(paths["tokenizer"]))
    return DataConfig.model_validate(base)


def plan_config(cfg: SFTConfig) -> PlanConfig:
    num_ranks = cfg.train.nproc * cfg.train.nnodes
    return PlanConfig(num_ranks=num_ranks, **cfg.plan.model_dump())


@flow(name="sft-train", log_prints=True)
def sft_train(
    index: DatasetIndex,
    plan: PlanManifest,
    tokenizer_path: str,
    tokenizer_sha256: str,
    options: dict,
    work_dir: str,
    force: bool = False,
    fault: str | None = None,
) -> TrainResult:
    """Train on a planned dataset; reruns resume a partial run, and an unchanged finished run is Cached."""
    task = train_stage_task.with_options(refresh_cache=True) if force else train_stage_task
    return task(index, plan, tokenizer_path, tokenizer_sha256, options, work_dir, fault=fault)


@flow(name="sft-eval", log_prints=True)
def sft_eval(
    tuned: ModelRef,
    base: ModelRef | None,
    index: DatasetIndex,
    tokenizer_path: str,
    tokenizer_sha256: str,
    config: EvalConfig,
    metrics_path: str | None,
    final_step: int,
    work_dir: str,
    force: bool = False,
) -> EvalReport:
    task = eval_task.with_options(refresh_cache=True) if force else eval_task
    report = task(tuned, base, index, tokenizer_path, tokenizer_sha256, config, metrics_path, final_step, work_dir)
    for name, m in report.metrics.items():
        get_run_logger().info(
            "sft-eval %-5s loss %.4f  ppl %.2f  token acc %.3f  exact match %s",
            name,
            m["loss"],
            m["perplexity"],
            m["token_accuracy"],
            "n/a" if m["exact_match"] is None else f"{m['exact_match']:.3f}",
        )
    return report


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
    _check_force(force)
    cfg = resolve_config(config_path, config, learning_rate, max_steps, epochs)
    work = Path(cfg.work_dir).resolve()
    dcfg = data_config(cfg)

    data = sft_data.with_options(task_runner=make_task_runner(dcfg))(
        config=dcfg, work_dir=str(work / "data"), force="data" in force
    )
    plan = sft_plan(index=data.index, config=plan_config(cfg), work_dir=str(work / "plan"), force="plan" in force)
    options = cfg.train.model_dump(mode="json")
    trained = sft_train(
        index=data.index,
        plan=plan,
        tokenizer_path=data.tokenizer.path,
        tokenizer_sha256=data.tokenizer.sha256,
        options=options,
        work_dir=str(work / "train"),
        force="train" in force,
        fault=fault,
    )
    if trained.hf_dir is None:
        raise ValueError("training finished without a Hugging Face export (train.export is false); cannot evaluate")
    tuned = ModelRef(spec=trained.hf_dir, sha256=sha256_tree(trained.hf_dir))
    base = None
    if cfg.eval.compare_base:
        base_spec = cfg.train.model
        base_sha = sha256_tree(base_spec) if Path(base_spec).exists() else None
        base = ModelRef(spec=base_spec, sha256=base_sha, seed=cfg.train.seed, overrides=cfg.train.model_overrides)
    report = sft_eval(
        tuned=tuned,
        base=base,
        index=data.index,
        tokenizer_path=data.tokenizer.path,
        tokenizer_sha256=data.tokenizer.sha256,
        config=cfg.eval,
        metrics_path=trained.metrics_path,
        final_step=trained.steps,
        work_dir=str(work / "eval"),
        force="eval" in force,
    )
    return SFTResult(data=data, plan=plan, train=trained, eval=report)
