"""The `sft-data` flow: render → spans → pbin mapped over source shards on the configured task runner, then one
dataset index. Outputs land under `work_dir/{render,spans,pbin,index}/<key>/` and `work_dir/data.json`."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefect import flow, get_run_logger, unmapped
from pydantic import BaseModel, ConfigDict

from sftflow.flows.config import DataConfig, SFTConfig, SourceSpec, data_config, resolve_config
from sftflow.flows.results import read_stage_result, work_dir_lock, write_stage_result
from sftflow.tasks.core.manifests import DatasetIndex, PbinShard, RenderedShard, TemplateChoice, TokenizedShard
from sftflow.tasks.data.hub import materialize, resolve_revision
from sftflow.tasks.data.stage import (
    SourceFile,
    TokenizerRef,
    benchmark_files,
    benchmark_task,
    index_task,
    pbin_task,
    render_task,
    source_files,
    spans_task,
    text_scan_task,
    tokenizer_ref,
    training_template,
    with_template_tokens,
)
from sftflow.tasks.data.template_limits import renders_stopped_on_error


class DataResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    work_dir: str
    tokenizer: TokenizerRef
    rendered: list[RenderedShard]
    tokenized: list[TokenizedShard]
    pbin: list[PbinShard]
    index: DatasetIndex
    # The chat template the data was rendered with (a file in the work folder), for the export.
    chat_template: str | None = None
    # How that template was chosen (None in results written before it was recorded), for the train stage's log.
    template_choice: TemplateChoice | None = None

    @property
    def index_dir(self) -> str:
        return str(self.index.dir)

    def spans_rejects(self) -> list[str]:
        return [t.rejects_path for t in self.tokenized if t.rejects_path]

    def summary(self) -> dict:
        return {
            "records_rendered": sum(r.num_records for r in self.rendered),
            "records_rejected_render": sum(r.num_rejected for r in self.rendered),
            "records_rejected_spans": sum(t.num_rejected for t in self.tokenized),
            "rejects": [p for p in (*(r.rejects_path for r in self.rendered), *self.spans_rejects()) if p],
            "docs_train": self.index.num_train,
            "docs_eval": self.index.num_eval,
            "tokens_train": self.index.num_train_tokens,
            "dropped": self.index.dropped,
            **({"filtered_by_source": self.index.filtered_by_source} if self.index.filtered_by_source else {}),
            "index": self.index_dir,
        }


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity outside Linux
        return os.cpu_count() or 1


def task_workers(config: DataConfig) -> int:
    """The per-shard task runner's workers: `workers`, else one per usable core. The shards, and so every output,
    do not depend on it (`shard_bytes: auto` sizes them from the sources alone)."""
    return config.workers or usable_cores()


def make_task_runner(config: DataConfig):
    """The task runner for the per-shard tasks; the stages' code and outputs do not depend on the choice."""
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    workers = task_workers(config)
    if config.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if config.task_runner == "processes":
        return ProcessPoolTaskRunner(max_workers=workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as err:
        raise ValueError("task_runner: 'dask' needs `pip install sftflow[dask]` (prefect-dask)") from err
    if config.dask_address:
        return DaskTaskRunner(address=config.dask_address)
    # One single-threaded worker process per core asked for; the dashboard on a free port, so that runs side by side
    # do not fight over 8787.
    cluster_kwargs = {"n_workers": workers, "threads_per_worker": 1, "processes": True}
    return DaskTaskRunner(cluster_kwargs={**cluster_kwargs, "dashboard_address": ":0"})


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextmanager
def api_for_workers(config: DataConfig):
    """Point task runs in other processes (process pool, Dask workers) at this flow's Prefect API.

    Task runners ship the flow's settings with every task run. The sftflow commands always set `PREFECT_API_URL` (the
    user's server, or the local server they start or reuse, `sftflow.flows.local_api`), and nothing here changes. A
    flow called from Python with no `PREFECT_API_URL` runs on Prefect's own temporary API server in a subprocess of
    the flow; without its address, each worker process would start another temporary server of its own (slow, and
    several servers on one SQLite database). Workers of a remote Dask cluster cannot reach that server at all: run a
    Prefect server and set `PREFECT_API_URL` for them.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if config.task_runner == "threads" or PREFECT_API_URL.value():
        yield
        return
    address = config.dask_address
    if address and urlsplit(address if "://" in address else f"tcp://{address}").hostname not in _LOOPBACK:
        raise ValueError(
            f"dask_address {config.dask_address}: workers on other hosts cannot reach this flow's Prefect API "
            "(Prefect's temporary server on this machine, as no PREFECT_API_URL is set); start a Prefect server "
            "(`prefect server start`) and set PREFECT_API_URL for the flow and workers"
        )
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url)
    with temporary_settings({PREFECT_API_URL: api_url}):
        yield


@flow(name="sft-data", log_prints=True)
def sft_data(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
) -> DataResult:
    """Render, tokenize and pack every source into pbin shards, then build the dataset index.

    A rerun with unchanged sources, template, tokenizer and options is Cached task by task, which makes this flow a
    cheap no-op on a schedule when nothing changed.
    """
    logger = get_run_logger()
    cfg = resolve_config(config_path, config, overrides)
    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    with work_dir_lock(work):
        dcfg = data_config(cfg)
        tokenizer = with_template_tokens(dcfg.render, tokenizer_ref(dcfg.tokenizer, work), work)
        # Shards in source order, each source's in file order: merged in that order, the index does not depend on them.
        named = [
            (spec.name, shard)
            for spec in dcfg.source_specs
            for shard in source_files(local_path(spec, work, logger), dcfg.shard_bytes, dcfg.shard_records)
        ]
        sources: list[SourceFile] = [shard for _, shard in named]
        template_sha, template_file, template_name, choice = training_template(dcfg.render, tokenizer, work)
        logger.info(
            "sft-data: %d source(s) in %d shard(s), template %s (sha256 %s), tokenizer %s, task runner %s%s",
            len(dcfg.sources),
            len(sources),
            template_name or "none (text records)",
            template_sha[:12],
            tokenizer.path,
            dcfg.task_runner,
            "" if dcfg.dask_address else f" with {task_workers(dcfg)} workers",
        )

        options = {"refresh_cache": True} if force else {}
        render, spans, pbin, index = (
            t.with_options(**options) for t in (render_task, spans_task, pbin_task, index_task)
        )
        wd = str(work)
        # Per-shard stages run on the configured runner (threads, processes or Dask); each stage is a barrier, which
        # keeps futures from crossing runners and costs nothing when shards are of similar size.
        with api_for_workers(dcfg), renders_stopped_on_error(make_task_runner(dcfg)) as runner:
            rendered = runner.map(
                render,
                dict(
                    source=sources,
                    tokenizer=unmapped(tokenizer),
                    template_sha=unmapped(template_sha),
                    config=unmapped(dcfg.render),
                    work_dir=unmapped(wd),
                ),
            ).result()
            tokenized = runner.map(
                spans,
                dict(
                    rendered=rendered, tokenizer=unmapped(tokenizer), config=unmapped(dcfg.spans), work_dir=unmapped(wd)
                ),
            ).result()
            check_untrained(tokenized, dcfg.render.on_bad_record)
            shards = runner.map(
                pbin, dict(tokenized=tokenized, rendered=rendered, tokenizer=unmapped(tokenizer), work_dir=unmapped(wd))
            ).result()
            text = text_scans(runner, dcfg, shards, rendered, wd, options) if dcfg.index.reads_text else {}
        dataset_index = index(shards, dcfg.index, wd, sources=[name for name, _ in named], **text)
        result = DataResult(
            work_dir=wd,
            tokenizer=tokenizer,
            rendered=rendered,
            tokenized=tokenized,
            pbin=shards,
            index=dataset_index,
            chat_template=template_file,
            template_choice=choice,
        )
        write_stage_result(work, "data", result)
        logger.info("sft-data: %s", json.dumps(result.summary()))
        return result


def text_scans(runner, dcfg: DataConfig, shards: list[PbinShard], rendered: list[RenderedShard], wd: str, options):
    """The index's word filters: each shard's text scanned on the runner, against the benchmark n-grams (built
    once first, cached by the benchmark files' contents). Returns the index task's `scans` and `benchmarks`."""
    decontaminate, benchmarks = dcfg.index.decontaminate, None
    if decontaminate.action != "off":
        benchmarks = benchmark_files(decontaminate.benchmarks)
        benchmark_task(decontaminate, benchmarks, wd)
    scans = runner.map(
        text_scan_task.with_options(**options),
        dict(
            pbin=shards,
            rendered=rendered,
            decontaminate=unmapped(decontaminate),
            near_dedup=unmapped(dcfg.index.near_dedup),
            benchmarks=unmapped(benchmarks),
            work_dir=unmapped(wd),
        ),
    ).result()
    return {"scans": scans, "benchmarks": benchmarks}


def check_untrained(tokenized: list[TokenizedShard], on_bad_record: str) -> None:
    """Under `on_bad_record: error`, a record with no trained token after tokenizing (nothing of it would be
    learned) is a bad record like any other: one line naming it. Under `reject` it is counted and listed in the
    spans stage's rejects file."""
    if on_bad_record != "error":
        return
    for shard in tokenized:
        if shard.rejected_reasons.get("no_trained_tokens") and shard.rejects_path:
            with open(shard.rejects_path, encoding="utf-8") as f:
                first = next(r for r in map(json.loads, f) if r["reason"] == "no_trained_tokens")
            raise ValueError(
                f"{first['source']}: no token of this record is trained (its trained text tokenizes to nothing, or "
                "it has no trained turn); fix the record, or set data.render.on_bad_record: reject to count it and "
                f"go on (rejected records are listed in {shard.rejects_path})"
            )


def local_path(spec: SourceSpec, work: Path, logger) -> str:
    """The source's file or folder: its `path`, or the saved copy of its hub dataset at its revision."""
    if spec.hub is None:
        return spec.path
    revision = resolve_revision(spec.hub, spec.revision, work, logger)
    return str(materialize(spec.hub, revision, spec.subset, spec.split or "train", work, logger))


def load_data_result(work_dir: str | Path) -> DataResult:
    return read_stage_result(work_dir, "data", DataResult)


def run_data(config: DataConfig, work_dir: str, force: bool = False) -> DataResult:
    """`sft-data` on a data config alone, into `work_dir`."""
    return sft_data(config=SFTConfig(work_dir=str(Path(work_dir).resolve()), data=config), force=force)
