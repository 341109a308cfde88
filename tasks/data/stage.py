"""Prefect tasks for the data stages: render → spans → pbin per shard, then index.

Each task is a few lines over the plain function that does the work (`render_source`, `tokenize_rendered_shard`,
`write_pbin`, `build_index`), made a cached task by `sftflow.tasks.core.stage.stage_task`: it writes into a folder
named by its content-derived key and returns a small manifest. Bad input raises `ValueError` and is not retried;
transient I/O errors (`OSError`) are.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from prefect import task
from pydantic import BaseModel, ConfigDict

from sftflow.tasks.core.atomic import temporary_name, write_atomic
from sftflow.tasks.core.caching import StageCache, read_manifest, retry_on_io_error
from sftflow.tasks.core.fingerprint import sha256_file, sha256_json, sha256_text, sha256_tree
from sftflow.tasks.core.leftovers import remove, remove_stale_temporaries
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.core.manifests import (
    DatasetIndex,
    PbinShard,
    RenderedShard,
    TemplateChoice,
    TextScan,
    TokenizedShard,
    TokenizerRef,
)
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.data.decontam import Decontaminator, benchmark_ngrams
from sftflow.tasks.data.index import INDEX_FORMAT_VERSION, build_index
from sftflow.tasks.data.index_config import DecontamConfig, IndexConfig, NearDedupConfig
from sftflow.tasks.data.pbin import FORMAT_VERSION, write_pbin
from sftflow.tasks.data.render import RenderConfig, render_source, resolve_template
from sftflow.tasks.data.sharding import (
    AUTO_SPLIT_FROM,
    SourceRange,
    auto_shard_bytes,
    detect_source_format,
    plan_shards,
    source_bytes,
)
from sftflow.tasks.data.spans import SpansConfig, load_tokenized_shard, tokenize_rendered_shard
from sftflow.tasks.data.text_filters import TextFilters
from sftflow.tasks.data.text_scan import SCAN_FORMAT_VERSION, scan_shard

RETRY = dict(retries=2, retry_delay_seconds=1, retry_condition_fn=retry_on_io_error)


class SourceFile(BaseModel):
    """One input file (or `datasets` folder), or one shard of it, and the whole source's content hash.

    `range` is None for the whole source; a shard's range is part of its cache key, and so of its output folder.
    """

    model_config = ConfigDict(frozen=True)
    path: str
    sha256: str
    range: SourceRange | None = None

    @property
    def name(self) -> str:
        return self.path if self.range is None else f"{self.path}@{self.range.label}"


def source_file(path: str | Path) -> SourceFile:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: source does not exist")
    return SourceFile(path=str(p.resolve()), sha256=sha256_tree(p))


def source_files(
    path: str | Path, shard_bytes: int | Literal["auto"] | None = None, shard_records: int | None = None
) -> list[SourceFile]:
    """The shards of one source in file order (one whole-source `SourceFile` when it is not split).

    `shard_bytes="auto"` is decided here, from the source's size alone (see `sftflow.tasks.data.sharding`), and the
    decision is logged with its reason.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: source does not exist")
    p = p.resolve()
    auto_size = None
    if shard_bytes == "auto" and shard_records is None:
        auto_size = source_bytes(p)
        shard_bytes = auto_shard_bytes(auto_size)
    sha256, ranges = plan_shards(p, shard_bytes=shard_bytes, shard_records=shard_records)
    if auto_size is not None:
        split = f"{len(ranges)} shards of ~{shard_bytes / 2**20:.1f} MiB" if len(ranges) > 1 else "one shard"
        stage_logger("sftflow.data").info(
            "%s: %s (shard_bytes: auto; %.1f MiB, split from %d MiB)",
            p.name,
            split,
            auto_size / 2**20,
            AUTO_SPLIT_FROM // 2**20,
        )
    return [SourceFile(path=str(p), sha256=sha256, range=r) for r in ranges]


def tokenizer_ref(path_or_id: str, work_dir: str | Path) -> TokenizerRef:
    """A local tokenizer folder as is, or a hub id saved once into `work_dir/tokenizers/` so it can be hashed."""
    p = Path(path_or_id)
    if p.is_dir():
        return TokenizerRef(path=str(p.resolve()), sha256=sha256_tree(p))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    out = Path(work_dir) / "tokenizers" / sha256_text(path_or_id)[:16]
    tokenizer.save_pretrained(out)
    return TokenizerRef(path=str(out.resolve()), sha256=sha256_tree(out))


def with_template_tokens(config: RenderConfig, tokenizer: TokenizerRef, work_dir: Path) -> TokenizerRef:
    """The tokenizer, or a copy with the special tokens the template writes and the tokenizer lacks (ChatML on a Llama
    base) added, saved once in `work_dir/tokenizers/`. Training then grows the model's embeddings to match
    (`sftflow.tasks.train.model`), and the export ships this tokenizer."""
    template = resolve_template(config, tokenizer.path)
    wanted = template.writes_tokens if template is not None else ()
    if not wanted:
        return tokenizer
    from sftflow.tasks.data.tokenizer_files import load_tokenizer_files

    vocab = load_tokenizer_files(tokenizer.path).get_vocab()
    missing = [t for t in wanted if t not in vocab]
    if not missing:
        return tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer.path)
    tok.add_tokens(missing, special_tokens=True)
    out = Path(work_dir) / "tokenizers" / f"{tokenizer.sha256[:16]}-{sha256_text(' '.join(missing))[:8]}"
    if not out.is_dir():  # saved aside, then renamed: a folder that exists is complete
        remove_stale_temporaries(out.parent)
        aside = temporary_name(out)
        tok.save_pretrained(aside)
        try:
            os.rename(aside, out)
        except OSError:  # another run saved the same tokenizer first
            remove(aside)
    stage_logger("sftflow.data").info(
        "tokenizer %s lacks %s, which template %s writes: added them (%d tokens now)",
        tokenizer.path,
        missing,
        template.name,
        len(tok),
    )
    return TokenizerRef(path=str(out.resolve()), sha256=sha256_tree(out))


def template_sha256(config: RenderConfig, tokenizer: TokenizerRef) -> str:
    return training_template(config, tokenizer, None)[0]


def training_template(
    config: RenderConfig, tokenizer: TokenizerRef, work_dir: Path | None
) -> tuple[str, str | None, str | None, TemplateChoice | None]:
    """The sha256 of the chat template the data is rendered with, given `work_dir` a copy of its text in
    `work_dir/templates/<sha>.jinja` (None for text without a template): what the export ships as the model's
    chat template, so that inference renders conversations as training did; the template's name (which one
    `template: auto` chose, and why); and how it was chosen, which the train stage prints."""
    template = resolve_template(config, tokenizer.path)
    text = template.text if template is not None else ""
    sha = sha256_text(text)
    name, choice = (template.name, template.choice) if template is not None else (None, None)
    if work_dir is None or template is None:
        return sha, None, name, choice
    path = Path(work_dir) / "templates" / f"{sha[:16]}.jinja"
    if not path.is_file():
        write_atomic(path, text)
    return sha, str(path), name, choice


# The four data stages share this module (their tasks), so each key covers all of data preparation's code.
_ENTRIES = (__name__,)
RENDER_CACHE = StageCache(stage="render", version="1", entries=_ENTRIES)
SPANS_CACHE = StageCache(stage="spans", version="1", entries=_ENTRIES)
PBIN_CACHE = StageCache(stage="pbin", version=str(FORMAT_VERSION), entries=_ENTRIES)
INDEX_CACHE = StageCache(stage="index", version=str(INDEX_FORMAT_VERSION), entries=_ENTRIES)
TEXT_SCAN_CACHE = StageCache(stage="textscan", version=str(SCAN_FORMAT_VERSION), entries=_ENTRIES)


@stage_task(RENDER_CACHE, name="render", task_run_name="render-{source.name}", **RETRY)
def render_task(
    out_dir: Path, source: SourceFile, tokenizer: TokenizerRef, template_sha: str, config: RenderConfig, work_dir: str
) -> RenderedShard:
    template = resolve_template(config, tokenizer.path)
    record_config = config
    if source.range is not None and config.format == "auto":
        # Autodetect from the whole source's first record, as an unsharded run does, not from this shard's.
        record_config = config.model_copy(update={"format": detect_source_format(source.path) or "auto"})
    stats = render_source(
        source.path,
        out_dir / "rendered.jsonl",
        record_config,
        template,
        out_dir / "rejects.jsonl",
        source_range=source.range,
    )
    if stats.records == 0 and source.range is None:
        stage_logger("sftflow.data").warning(
            "%s: no records (an empty file?); it adds nothing to the dataset", source.path
        )
    return RenderedShard(
        path=stats.out_path,
        sha256=sha256_file(stats.out_path),
        source_path=source.path,
        source_sha256=source.sha256,
        source_range=source.range.label if source.range is not None else None,
        template_sha256=template_sha,
        num_records=stats.rendered,
        num_rejected=stats.rejected,
        rejects_path=stats.rejects_path,
        config_sha256=sha256_json(config.model_dump(mode="json")),
    )


@stage_task(SPANS_CACHE, name="spans", **RETRY)
def spans_task(
    out_dir: Path, rendered: RenderedShard, tokenizer: TokenizerRef, config: SpansConfig, work_dir: str
) -> TokenizedShard:
    stats = tokenize_rendered_shard(rendered.path, tokenizer.path, config, out_dir / "tokenized.npz")
    return TokenizedShard(
        path=stats.out_path,
        sha256=sha256_file(stats.out_path),
        rendered_sha256=rendered.sha256,
        tokenizer_sha256=tokenizer.sha256,
        num_docs=stats.docs,
        num_tokens=stats.tokens,
        num_loss_tokens=stats.loss_tokens,
        num_rejected=sum(stats.rejected.values()),
        rejected_reasons=dict(stats.rejected),
        config_sha256=sha256_json(config.model_dump(mode="json")),
        tokenizer_backend=stats.tokenizer_backend,
        rejects_path=stats.rejects_path,
        num_repeated=stats.repeated_docs,
    )


def _vocab_size(tokenizer: TokenizerRef) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tokenizer.path))


@stage_task(PBIN_CACHE, name="pbin", **RETRY)
def pbin_task(
    out_dir: Path, tokenized: TokenizedShard, rendered: RenderedShard, tokenizer: TokenizerRef, work_dir: str
) -> PbinShard:
    provenance = {
        "source_sha256": rendered.source_sha256,
        "template_sha256": rendered.template_sha256,
        "tokenizer_sha256": tokenizer.sha256,
    }
    if rendered.source_range is not None:
        provenance["source_range"] = rendered.source_range
    docs = load_tokenized_shard(tokenized.path)
    info = write_pbin(out_dir / "shard.pbin", docs, vocab_size=_vocab_size(tokenizer), provenance=provenance)
    return PbinShard(**asdict(info))


def benchmark_files(paths: list[str]) -> list[SourceFile]:
    """The benchmark files with their content hashes (what keys the scans and the index)."""
    for p in paths:
        if not Path(p).is_file():
            raise ValueError(f"{p}: benchmark file not found (data.index.decontaminate.benchmarks)")
    return [source_file(p) for p in paths]


def _benchmark(decontaminate: DecontamConfig, benchmarks: list[SourceFile] | None, work_dir: str):
    """The benchmark n-gram set, cached in `work_dir/benchmarks/` by the files' contents (not by this task's key)."""
    return benchmark_ngrams([b.path for b in benchmarks or []], decontaminate, Path(work_dir) / "benchmarks")


@task(name="benchmark-ngrams", **RETRY)
def benchmark_task(decontaminate: DecontamConfig, benchmarks: list[SourceFile], work_dir: str) -> dict[str, int]:
    """Build (or read back) the benchmark n-gram set once, before the shards' scans read it in parallel."""
    benchmark = _benchmark(decontaminate, benchmarks, work_dir)
    stage_logger("sftflow.data").info(
        "benchmark n-grams %s: %d n-grams of %d items, in %s",
        "reused" if benchmark.reused else "built",
        benchmark.counts["ngrams"],
        benchmark.counts["items"],
        benchmark.dir,
    )
    return dict(benchmark.counts)


@stage_task(TEXT_SCAN_CACHE, name="textscan", **RETRY)
def text_scan_task(
    out_dir: Path,
    pbin: PbinShard,
    rendered: RenderedShard,
    decontaminate: DecontamConfig,
    near_dedup: NearDedupConfig,
    benchmarks: list[SourceFile] | None,
    work_dir: str,
) -> TextScan:
    """One shard's benchmark matches and MinHash signatures, from its rendered text (what the index's word filters
    read), keyed by the shard and the benchmarks' contents, so a refresh scans only new shards."""
    decontaminator = None
    if decontaminate.action != "off":
        decontaminator = Decontaminator(_benchmark(decontaminate, benchmarks, work_dir), decontaminate)
    info = scan_shard(rendered.path, pbin.path, out_dir / "scan.npz", decontaminator, near_dedup)
    return TextScan(
        path=info.path,
        sha256=sha256_file(info.path),
        pbin_sha256=pbin.sha256,
        num_docs=info.num_docs,
        num_contaminated=info.num_contaminated,
    )


@stage_task(INDEX_CACHE, name="index", **RETRY)
def index_task(
    out_dir: Path,
    shards: list[PbinShard],
    config: IndexConfig,
    work_dir: str,
    sources: list[str] | None = None,
    scans: list[TextScan] | None = None,
    benchmarks: list[SourceFile] | None = None,
) -> DatasetIndex:
    """`sources` names each shard's data source (what mixtures and per-source metrics refer to). The filters over
    words (`config.reads_text`) read `scans`, one per shard (`text_scan_task`); decontamination names the matched
    items of the `benchmarks` files."""
    text_filters = None
    if config.reads_text:
        if scans is None:
            raise ValueError("index: decontamination and near-duplicate removal need the shards' text scans")
        decontam = config.decontaminate if config.decontaminate.action != "off" else None
        text_filters = TextFilters(
            scan_paths=[scan.path for scan in scans],
            decontaminate=decontam,
            benchmark=_benchmark(decontam, benchmarks, work_dir) if decontam is not None else None,
            near_dedup=config.near_dedup if config.near_dedup.enabled else None,
        )
    info = build_index(
        [s.path for s in shards],
        out_dir,
        dedup=config.dedup,
        eval_fraction=config.eval_fraction,
        split_salt=config.split_salt,
        shard_sha256s=[s.sha256 for s in shards],
        shard_sources=sources,
        text_filters=text_filters,
    )
    return DatasetIndex(
        path=str(info.path),
        sha256=info.sha256,
        shards=shards,
        num_train=info.num_train,
        num_eval=info.num_eval,
        num_train_tokens=info.num_train_tokens,
        num_eval_tokens=info.num_eval_tokens,
        dropped=dict(info.dropped),
        filtered_by_source=info.filtered_by_source,
    )


def load_index_manifest(index_dir: str | Path) -> DatasetIndex:
    return read_manifest(Path(index_dir), DatasetIndex)
