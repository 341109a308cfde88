"""The `sft-promote` flow: the promotion gate after `sft`. The newly trained model and the registry's champion are
evaluated on the same (current) eval documents; the new one is published as the next version and made champion only
if it wins by `promote` in the config (`sftflow.tasks.eval.promotion`). The report is a Prefect markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from sftflow.flows.config import SFTConfig, registry_root, resolve_config
from sftflow.flows.data import DataResult, load_data_result
from sftflow.flows.results import work_dir_lock, write_stage_result
from sftflow.flows.train import load_train_result, trained_model
from sftflow.tasks.core.manifests import (
    BenchReport,
    DatasetIndex,
    EvalConfig,
    ModelRef,
    PromoteConfig,
    PromoteResult,
    TokenizerRef,
    TrainResult,
)


# Not cached: the decision depends on the registry's champion, which other runs change.
@task(name="promote")
def promote_task(
    candidate: ModelRef,
    index: DatasetIndex,
    tokenizer: TokenizerRef,
    eval_config: EvalConfig,
    config: PromoteConfig,
    registry: str,
    out_dir: str,
    source: dict,
    bench: BenchReport | None = None,
) -> PromoteResult:
    from prefect.artifacts import create_markdown_artifact

    from sftflow.tasks.eval.promotion import promote

    result = promote(candidate, index, tokenizer, eval_config, config, registry, out_dir, source, bench)
    create_markdown_artifact(
        Path(result.report_path).read_text(), key="sft-promote-report", description="new model vs the champion"
    )
    return result


@flow(name="sft-promote", log_prints=True)
def sft_promote(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    data: DataResult | None = None,
    train: TrainResult | None = None,
    bench: BenchReport | None = None,
) -> PromoteResult:
    """Promote the latest trained model if it beats the champion. Inputs default to the work folder's latest results
    (`bench`: read where the config has benchmark rules); the registry is `promote.registry` (default
    `<work_dir>/registry`)."""
    cfg = resolve_config(config_path, config, overrides)
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work):
        data = data or load_data_result(work)
        train = train or load_train_result(work)
        if bench is None and cfg.promote.bench_rules:
            from sftflow.flows.bench import load_bench_result

            bench = load_bench_result(work)
        result = promote_task(
            trained_model(train),
            data.index,
            data.tokenizer,
            cfg.eval,
            cfg.promote,
            str(registry_root(cfg)),
            str(work / "promote"),
            {"run_dir": train.run_dir, "steps": train.steps},
            bench,
        )
        write_stage_result(work, "promote", result)
    logger = get_run_logger()
    logger.info("sft-promote: %s; champion %s", result.decision, result.champion)
    for reason in result.reasons:
        logger.info("sft-promote: %s", reason)
    if result.hub is not None and result.hub.ok:
        logger.info("sft-promote: %s holds %s (%s)", result.hub.repo, result.hub.version, result.hub.url)
    return result
