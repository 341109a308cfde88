"""The `sft-eval` flow: base vs tuned on the eval split, with a markdown report, a table and a loss-curve PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from sftflow.flows.config import SFTConfig, resolve_config
from sftflow.flows.data import DataResult, load_data_result
from sftflow.flows.results import work_dir_lock, write_stage_result
from sftflow.flows.train import load_train_result, trained_model
from sftflow.tasks.core.fingerprint import sha256_tree
from sftflow.tasks.core.manifests import EvalReport, ModelRef, TrainResult
from sftflow.tasks.eval.stage import eval_task


def base_model(cfg: SFTConfig) -> ModelRef:
    """The base model the tuned one is compared with: a folder with its hash, or a preset built with the training
    seed (so it is the run's step-0 weights)."""
    spec = cfg.train.model
    return ModelRef(
        spec=spec,
        sha256=sha256_tree(spec) if Path(spec).exists() else None,
        seed=cfg.train.seed,
        overrides=cfg.train.model_overrides,
    )


@flow(name="sft-eval", log_prints=True)
def sft_eval(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    data: DataResult | None = None,
    train: TrainResult | None = None,
) -> EvalReport:
    """Evaluate the tuned model (and the base, side by side). Inputs default to the work folder's latest results."""
    cfg = resolve_config(config_path, config, overrides)
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work):
        data = data or load_data_result(work)
        train = train or load_train_result(work)
        tuned = trained_model(train)
        base = base_model(cfg) if cfg.eval.compare_base else None
        task = eval_task.with_options(refresh_cache=True) if force else eval_task
        report = task(
            tuned,
            base,
            data.index,
            data.tokenizer,
            cfg.eval,
            train.metrics_path,
            train.steps,
            str(work),
        )
        write_stage_result(work, "eval", report)
        for name, m in report.metrics.items():
            exact = "n/a" if m.exact_match is None else f"{m.exact_match:.3f}"
            get_run_logger().info(
                "sft-eval %-5s loss %.4f  ppl %.2f  token acc %.3f  exact match %s",
                name,
                m.loss,
                m.perplexity,
                m.token_accuracy,
                exact,
            )
        return report
