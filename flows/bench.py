"""The `sft-bench` flow: the tuned model, the base and the registry's champion side by side, on the benchmark tasks
of `bench` in the config (generative tasks scored by exact match of an extracted answer, multiple-choice tasks by
log-likelihood). The report is a Prefect markdown artifact and a table; `bench.json` in the work folder is what the
promotion gate reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from sftflow.flows.config import SFTConfig, bench_config, registry_root, resolve_config
from sftflow.flows.data import DataResult, load_data_result
from sftflow.flows.eval import base_model
from sftflow.flows.results import read_stage_result, work_dir_lock, write_stage_result
from sftflow.flows.train import load_train_result, trained_model
from sftflow.tasks.core.manifests import BenchReport, ModelRef, TrainResult
from sftflow.tasks.eval.bench_config import resolve_lm_eval, resolve_tasks
from sftflow.tasks.eval.bench_stage import bench_task


@flow(name="sft-bench", log_prints=True)
def sft_bench(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    data: DataResult | None = None,
    train: TrainResult | None = None,
) -> BenchReport:
    """Score the tuned model (and the base) on the benchmark tasks. Inputs default to the work folder's latest
    results; the prompts use the chat template the data was rendered with."""
    cfg = resolve_config(config_path, config, overrides)
    bench = bench_config(cfg)
    if not bench.enabled:
        raise ValueError("config: `bench` names no tasks; add bench.tasks (local JSONL files) to run sft-bench")
    tasks, lm_eval = resolve_tasks(bench), resolve_lm_eval(bench)  # a missing file is named before anything runs
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work):
        data = data or load_data_result(work)
        train = train or load_train_result(work)
        template = Path(data.chat_template).read_text(encoding="utf-8") if data.chat_template else None
        from sftflow.tasks.data.index import load_index

        vocab_size = load_index(data.index.dir).meta.get("vocab_size")
        task = bench_task.with_options(refresh_cache=True) if force else bench_task
        report = task(
            trained_model(train),
            base_model(cfg) if bench.compare_base else None,
            data.tokenizer,
            template,
            vocab_size,
            tasks,
            lm_eval,
            champion_model(cfg, trained_model(train)) if bench.compare_champion else None,
            str(work),
        )
        write_stage_result(work, "bench", report)
    for name, scores in report.tasks.items():
        shown = "  ".join(f"{model} {value:.1%}" for model, value in scores.scores.items())
        get_run_logger().info("sft-bench %-12s %s %s", name, scores.metric, shown)
    return report


def champion_model(cfg: SFTConfig, tuned: ModelRef) -> ModelRef | None:
    """The registry's champion, to score beside the tuned model: what the promotion gate compares with. None without
    one, or where the tuned model is the champion (after its promotion: a rerun stays Cached)."""
    from sftflow.tasks.eval.registry import Registry

    champion = Registry(registry_root(cfg)).champion()
    if champion is None or champion.sha256 == tuned.sha256:
        return None
    return ModelRef(spec=str(champion.model_dir), sha256=champion.sha256)


def load_bench_result(work_dir: str | Path) -> BenchReport:
    return read_stage_result(work_dir, "bench", BenchReport)
