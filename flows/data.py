"""The `sft-data` flow: render → spans → pbin mapped over source shards, then one dataset index."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, unmapped
from pydantic import BaseModel, ConfigDict, Field

from sftflow.tasks.data_stages import (
    IndexConfig,
    SourceFile,
    TokenizerRef,
    index_task,
    pbin_task,
    render_task,
    source_file,
    spans_task,
    template_sha256,
    tokenizer_ref,
)
from sftflow.tasks.manifests import DatasetIndex, PbinShard, RenderedShard, TokenizedShard
from sftflow.tasks.render import RenderConfig
from sftflow.tasks.spans import SpansConfig

DATA_RESULT = "data.json"


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[str] = Field(min_length=1, description="JSONL / Parquet files or local `datasets` folders")
    tokenizer: str = Field(description="tokenizer folder or hub id")
    render: RenderConfig = RenderConfig()
    spans: SpansConfig = SpansConfig()
    index: IndexConfig = IndexConfig()
    task_runner: Literal["threads", "processes", "dask"] = "threads"
    workers: int | None = Field(default=None, ge=1, description="task-runner workers (default: the runner's own)")
    dask_address: str | None = Field(default=None, description="scheduler address of an existing Dask cluster")


class DataResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    work_dir: str
    tokenizer: TokenizerRef
    rendered: list[RenderedShard]
    tokenized: list[TokenizedShard]
    pbin: list[PbinShard]
    index: DatasetIndex

    @property
    def index_dir(self) -> str:
        return str(Path(self.index.path).parent)

    def summary(self) -> dict:
        return {
            "records_rendered": sum(r.num_records for r in self.rendered),
            "records_rejected_render": sum(r.num_rejected for r in self.rendered),
            "records_rejected_spans": sum(t.num_rejected for t in self.tokenized),
            "docs_train": self.index.num_train,
            "docs_eval": self.index.num_eval,
            "tokens_train": self.index.num_train_tokens,
            "dropped": self.index.dropped,
            "index": self.index_dir,
        }


def make_task_runner(config: DataConfig):
    """The task runner for the per-shard tasks; the stages' code and outputs do not depend on the choice."""
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    if config.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=config.workers)
    if config.task_runner == "processes":
        return ProcessPoolTaskRunner(max_workers=config.workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as err:
        raise ValueError("task_runner: 'dask' needs `pip install sftflow[dask]` (prefect-dask)") from err
    if config.dask_address:
        return DaskTaskRunner(address=config.dask_address)
    cluster_kwargs = {"n_workers": config.workers or 2, "threads_per_worker": 1, "processes": True}
    return DaskTaskRunner(cluster_kwargs=cluster_kwargs)


@flow(name="sft-data", log_prints=True)
def sft_data(config: DataConfig, work_dir: str, force: bool = False) -> DataResult:
    """Render, tokenize and pack every source into pbin shards, then build the dataset index under `work_dir`."""
    logger = get_run_logger()
    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_ref(config.tokenizer, work)
    sources: list[SourceFile] = [source_file(s) for s in config.sources]
    template_sha = template_sha256(config.render, tokenizer)
    logger.info("sft-data: %d source(s), template %s, tokenizer %s", len(sources), template_sha[:12], tokenizer.path)

    options = {"refresh_cache": True} if force else {}
    render, spans, pbin, index = (t.with_options(**options) for t in (render_task, spans_task, pbin_task, index_task))
    wd = str(work)
    rendered = render.map(sources, unmapped(tokenizer), unmapped(template_sha), unmapped(config.render), unmapped(wd))
    tokenized = spans.map(rendered, unmapped(tokenizer), unmapped(config.spans), unmapped(wd))
    shards = pbin.map(tokenized, rendered, unmapped(tokenizer), unmapped(wd))
    rendered_m, tokenized_m, shards_m = rendered.result(), tokenized.result(), shards.result()
    dataset_index = index(shards_m, config.index, wd)
    result = DataResult(
        work_dir=wd,
        tokenizer=tokenizer,
        rendered=rendered_m,
        tokenized=tokenized_m,
        pbin=shards_m,
        index=dataset_index,
    )
    _write_result(work / DATA_RESULT, result)
    logger.info("sft-data: %s", json.dumps(result.summary()))
    return result


def _write_result(path: Path, result: DataResult) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(result.model_dump_json(indent=2))
    os.replace(tmp, path)


def load_data_result(data_dir: str | Path) -> DataResult:
    path = Path(data_dir) / DATA_RESULT
    if not path.is_file():
        raise ValueError(f"{data_dir}: no {DATA_RESULT}; run `sftflow data --out {data_dir}` first")
    return DataResult.model_validate_json(path.read_text())


def run_data(config: DataConfig, work_dir: str, force: bool = False) -> DataResult:
    """Run `sft-data` on the task runner its config names."""
    return sft_data.with_options(task_runner=make_task_runner(config))(config=config, work_dir=work_dir, force=force)
