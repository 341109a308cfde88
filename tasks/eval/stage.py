"""The `evaluate` Prefect task: base vs tuned on the eval split, with a report, artifacts and a loss-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.caching import StageCache, retry_on_io_error
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.core.manifests import DatasetIndex, EvalConfig, EvalReport, ModelRef, TokenizerRef
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.data.index import load_index
from sftflow.tasks.data.reader import IndexedDataset
from sftflow.tasks.eval.evaluate import EvalResult, evaluate_models
from sftflow.tasks.eval.report import markdown_summary, metrics_table, plot_loss_curve, plot_source_losses, source_table


def load_model(ref: ModelRef, vocab_size: int | None) -> torch.nn.Module:
    """A Hugging Face folder, preset or config; a PEFT adapter folder (a LoRA run exported without `merge`) is loaded
    onto the base it names and merged."""
    from sftflow.tasks.train.export import verify_export
    from sftflow.tasks.train.model import build_model

    verify_export(ref.spec)  # an sftflow export carries CHECKSUMS: a damaged or half-written one is refused
    adapter = Path(ref.spec) / "adapter_config.json"
    if adapter.is_file():
        from peft import PeftModel

        base = json.loads(adapter.read_text())["base_model_name_or_path"]
        torch.manual_seed(ref.seed)
        model = build_model(base, vocab_size=vocab_size, packed=False, overrides=ref.overrides)
        return PeftModel.from_pretrained(model, ref.spec).merge_and_unload()
    # The same seed and builder as the training worker, so a preset's "base" is the run's step-0 weights.
    torch.manual_seed(ref.seed)
    return build_model(ref.spec, vocab_size=vocab_size, packed=False, overrides=ref.overrides)


def eval_items(dataset: IndexedDataset, max_docs: int | None) -> np.ndarray:
    """The eval split's items to evaluate: all, or `max_docs` of them. With one source, the first in index order.
    With several (or with tags), the index lists them source by source, so the first `max_docs` could leave later
    sources or tags out: the sample is taken by content hash instead (the split already treats it as uniform), in
    index order."""
    n = len(dataset)
    count = n if max_docs is None else min(n, max_docs)
    if count == n or (len(dataset.source_names) < 2 and not dataset.tag_names):
        return np.arange(count)
    hashes = np.asarray(dataset.index.content_hash)[dataset.ids]
    return np.sort(np.argsort(hashes, kind="stable")[:count])


def eval_documents(dataset: IndexedDataset, max_docs: int | None) -> tuple[list, list[str], list[str] | None]:
    """The documents `eval_items` picks, each one's source name and tag (None without tags); a warning names sources
    the sample lacks."""
    items = eval_items(dataset, max_docs)
    sources = [dataset.source_names[s] for s in dataset.source_ids[items]]
    present = set(sources)
    missing = [name for name in dataset.source_names if name not in present]
    if len(dataset.source_names) > 1 and missing:
        stage_logger("sftflow.eval").warning(
            "eval: no eval documents of source(s) %s, so no per-source metrics for them; raise index.eval_fraction "
            "(or eval.max_docs)",
            missing,
        )
    return [dataset[int(i)] for i in items], sources, dataset.tag_labels(items)


def evaluate_run(
    tuned: ModelRef,
    base: ModelRef | None,
    index_dir: str | Path,
    tokenizer_path: str,
    config: EvalConfig,
    out_dir: Path,
    metrics_path: Path | None = None,
    final_step: int = 0,
) -> tuple[EvalResult, Path]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    dataset = IndexedDataset(load_index(index_dir, verify=True), split="eval")  # arrays checked against index.json
    if len(dataset) == 0:
        raise ValueError(f"{index_dir}: the eval split is empty; set index.eval_fraction > 0")
    docs, sources, tags = eval_documents(dataset, config.max_docs)
    models = {}
    if base is not None:
        models["base"] = load_model(base, dataset.vocab_size)
    models["tuned"] = load_model(tuned, dataset.vocab_size)
    result = evaluate_models(
        models, tokenizer, docs, config.max_generations, config.num_examples, sources=sources, tags=tags
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = None
    if metrics_path is not None:
        plot = plot_loss_curve(metrics_path, result, final_step, out_dir / "loss_curve.png")
    plot_source_losses(result, out_dir / "source_loss.png")
    plot_source_losses(result, out_dir / "tag_loss.png", by="tag")
    write_atomic(out_dir / "report.json", json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    write_atomic(out_dir / "report.md", markdown_summary(result, plot))
    return result, out_dir / "report.json"


EVAL_CACHE = StageCache(stage="eval", version="1", entries=(__name__,))


@stage_task(EVAL_CACHE, name="evaluate", retries=1, retry_delay_seconds=1, retry_condition_fn=retry_on_io_error)
def eval_task(
    out_dir: Path,
    tuned: ModelRef,
    base: ModelRef | None,
    index: DatasetIndex,
    tokenizer: TokenizerRef,
    config: EvalConfig,
    metrics_path: str | None,
    final_step: int,
    work_dir: str,
) -> EvalReport:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    result, report = evaluate_run(
        tuned,
        base,
        index.dir,
        tokenizer.path,
        config,
        out_dir,
        Path(metrics_path) if metrics_path else None,
        final_step,
    )
    plot = out_dir / "loss_curve.png"
    markdown = (out_dir / "report.md").read_text()
    create_markdown_artifact(markdown, key="sft-eval-report", description="base vs tuned on the eval split")
    create_table_artifact(metrics_table(result), key="sft-eval-metrics", description="eval metrics")
    per_source = source_table(result.metrics)
    if len({row["source"] for row in per_source}) > 1:
        create_table_artifact(per_source, key="sft-eval-sources", description="eval metrics by data source")
    per_tag = source_table(result.metrics, by="tag")
    if per_tag:
        create_table_artifact(per_tag, key="sft-eval-tags", description="eval metrics by the records' tag")
    return EvalReport(
        path=str(report),
        sha256=sha256_file(report),
        metrics=result.metrics,
        plot_path=str(plot) if plot.is_file() else None,
        markdown_path=str(out_dir / "report.md"),
        eval_docs=min(index.num_eval, config.max_docs or index.num_eval),
    )
