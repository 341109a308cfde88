"""Typed manifests: the small JSON contracts passed between Prefect tasks.

A manifest names a file on disk, its sha256 and counts, plus the config that made it. A task reads only the manifests
it is given, so any stage can be rerun alone. `verify()` checks that the file is still there and unchanged before a
consumer trusts a cached manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sftflow.tasks.core.fingerprint import sha256_file


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    sha256: str

    def is_valid(self) -> bool:
        p = Path(self.path)
        return p.is_file() and sha256_file(p) == self.sha256

    def verify(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise FileNotFoundError(f"{self.path}: file named by the {type(self).__name__} manifest is missing")
        if sha256_file(p) != self.sha256:
            raise ValueError(f"{self.path}: content changed since the {type(self).__name__} manifest was written")


class TokenizerRef(BaseModel):
    """A tokenizer folder and the sha256 of its files: what every stage that tokenizes or decodes is given."""

    model_config = ConfigDict(frozen=True)
    path: str
    sha256: str


class RenderedShard(Manifest):
    """JSONL of `{"text", "train_char_spans", "source"}` records, one per rendered conversation."""

    source_path: str
    source_sha256: str  # of the whole source, also for a shard of it
    source_range: str | None = None  # the shard's range (`SourceRange.label`), None for the whole source
    template_sha256: str
    num_records: int
    num_rejected: int
    rejects_path: str | None = None
    config_sha256: str


class TemplateChoice(BaseModel):
    """How the data stage chose its chat template, as the train stage prints it: `name`, and `how` it was chosen
    (`auto`; `named`: a built-in one named in `data.render.template`; `file`: a .jinja file given there; `tokenizer`:
    the tokenizer's own). For `auto` that picked a built-in template, `probes` conversations were rendered with it
    and with the tokenizer's own template and `equal` of them gave the same text; `note` says what else to know."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    how: Literal["auto", "named", "file", "tokenizer"]
    probes: int | None = None
    equal: int | None = None
    note: str | None = None

    def reason(self) -> str:
        """Why this template, in a few words: `auto, equal to the tokenizer's own on 5/5 probes`."""
        if self.how == "auto" and self.probes is not None:
            why = f"auto, equal to the tokenizer's own on {self.equal}/{self.probes} probes"
        else:
            why = {
                "auto": "auto",
                "named": "named in data.render.template",
                "file": "given in data.render.template",
                "tokenizer": "the tokenizer's own",
            }[self.how]
        return f"{why}; {self.note}" if self.note else why


class TokenizedShard(Manifest):
    """`.npz` of CSR arrays: `input_ids`, `doc_ptr`, `loss_spans` (int32 S×2), `span_ptr`, plus sources JSON."""

    rendered_sha256: str
    tokenizer_sha256: str
    num_docs: int
    num_tokens: int
    num_loss_tokens: int
    num_rejected: int
    rejected_reasons: dict[str, int] = {}
    config_sha256: str
    tokenizer_backend: str | None = None  # "hf" or "tiktoken"; None in manifests written before it was recorded
    rejects_path: str | None = None  # JSONL of the rejected documents' sources and reasons, when there are any
    num_repeated: int = 0  # documents repeating an earlier one's text and spans in the shard: tokenized once


class PbinShard(Manifest):
    """A `.pbin` file (see `sftflow.tasks.data.pbin`)."""

    format_version: int
    num_docs: int
    num_tokens: int
    num_loss_tokens: int
    vocab_size: int
    token_dtype: str


class TextScan(Manifest):
    """`scan.npz` (see `sftflow.tasks.data.text_scan`): per document of one pbin shard, its benchmark matches and
    MinHash signature, for the index's word filters."""

    pbin_sha256: str
    num_docs: int
    num_contaminated: int


class DatasetIndex(Manifest):
    """`index.json` beside `.npy` arrays: shard, doc, length, loss-token count, content hash, split."""

    shards: list[PbinShard]
    num_train: int
    num_eval: int
    num_train_tokens: int
    num_eval_tokens: int
    dropped: dict[str, int]
    # per source, the documents decontamination (dropped or flagged) and near-duplicate removal named; {} when off
    filtered_by_source: dict[str, dict[str, int]] = {}

    @property
    def dir(self) -> Path:
        """The index folder: `index.json` and its arrays."""
        return Path(self.path).parent


class TrainResult(BaseModel):
    """A training run: its folder, progress, and the exported Hugging Face model with the sha256 of its files
    (`hf_sha256`, over every file of `hf_dir`), which is what evaluation and promotion key on."""

    run_dir: str
    steps: int
    final_loss: float | None
    trained_tokens: int
    metrics_path: str
    checkpoint: str | None
    hf_dir: str | None
    hf_sha256: str | None = None


class EvalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_docs: int | None = Field(default=512, ge=1, description="eval documents for loss/accuracy (None: all)")
    max_generations: int = Field(default=64, ge=0, description="documents to greedy-generate answers for")
    num_examples: int = Field(default=4, ge=0, description="examples shown in the report")
    compare_base: bool = Field(True, description="evaluate the base model too, side by side")


class ModelRef(BaseModel):
    """A model to evaluate: a Hugging Face folder (with its content hash) or a preset built from `seed`."""

    model_config = ConfigDict(frozen=True)
    spec: str
    sha256: str | None = None
    seed: int = 0
    overrides: dict[str, int | float | str | bool] = {}


class SourceMetrics(BaseModel):
    """One model's masked metrics on the eval documents of one data source (or of one tag)."""

    model_config = ConfigDict(frozen=True)
    loss: float
    token_accuracy: float
    loss_tokens: int
    docs: int


class EvalMetrics(BaseModel):
    """One model's metrics on the eval split. `exact_match` and `overlap` are None when no answer was generated.
    `by_source` breaks the masked metrics down by data source, and `by_tag` by the records' tag (untagged documents
    under "(none)" when some are tagged); the `loss_tokens` of each add up to the total."""

    model_config = ConfigDict(frozen=True)
    loss: float  # masked mean cross-entropy over the trained tokens
    perplexity: float
    token_accuracy: float
    loss_tokens: int
    exact_match: float | None = None
    overlap: float | None = None
    generations: int = 0
    by_source: dict[str, SourceMetrics] = {}
    by_tag: dict[str, SourceMetrics] = {}


class EvalReport(Manifest):
    metrics: dict[str, EvalMetrics]  # "base" and "tuned"
    plot_path: str | None
    markdown_path: str
    eval_docs: int


class BenchTaskScores(BaseModel):
    """One benchmark task's score for each model evaluated (`base`, `tuned`), in [0, 1]."""

    model_config = ConfigDict(frozen=True)
    metric: str  # "exact_match" (generate) or "accuracy" (choice); an lm-eval task's own metric name
    items: int
    scores: dict[str, float]


class BenchReport(Manifest):
    """The `sft-bench` stage's result: `path` is its report.json."""

    tasks: dict[str, BenchTaskScores]
    models: dict[str, str | None]  # each model evaluated -> the sha256 of its files (None: a preset)
    markdown_path: str
    samples_path: str
    plot_path: str | None = None  # bench.png: each task's score per model

    def mean(self, model: str) -> float:
        return sum(t.scores[model] for t in self.tasks.values()) / len(self.tasks)


class HubTarget(BaseModel):
    """A Hugging Face Hub model repository the champion is pushed to after each gate (`promote.hub`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    repo: str = Field(description="owner/name of the model repository (created if missing)")
    private: bool = Field(True, description="create the repository private")
    revision: str = Field("main", description="branch the champion is committed to (created from main if missing)")
    token_env: str = Field(
        "HF_TOKEN", description="environment variable holding the write token (unset: the `hf auth login` token)"
    )
    endpoint: str | None = Field(None, description="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")

    @field_validator("repo")
    @classmethod
    def _owner_and_name(cls, value: str) -> str:
        if value.count("/") != 1 or not all(value.split("/")):
            raise ValueError(f"promote.hub.repo must be owner/name, got {value!r}")
        return value


class HubPush(BaseModel):
    """Where the champion stands on the Hub after a gate: pushed (now or by an earlier gate), or why not."""

    model_config = ConfigDict(frozen=True)
    ok: bool
    repo: str
    revision: str
    version: str | None = None  # the registry version the repository holds (or was to receive)
    commit: str | None = None
    url: str | None = None
    error: str | None = None
    tag: str | None = None  # the tag naming `commit`; None when that name already tagged another commit


class PromoteConfig(BaseModel):
    """When a newly trained model replaces the champion: both are evaluated on the current eval split, and the new
    one is promoted if its masked loss is lower by at least `min_improvement` (relative) and neither its token
    accuracy nor its exact match (where measured) is lower by more than `max_regression` (absolute), and, with
    `max_source_regression`, its loss on no data source is higher than the champion's by more than that fraction."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    registry: str | None = Field(None, description="registry folder (default: <work_dir>/registry)")
    min_improvement: float = Field(0.0, ge=0, lt=1, description="relative loss improvement the new model needs")
    max_regression: float = Field(0.01, ge=0, le=1, description="largest drop allowed in token accuracy and exact")
    max_source_regression: float | None = Field(
        None, ge=0, description="largest relative loss increase allowed on any one data source (0.01: 1%)"
    )
    bench_max_regression: float | None = Field(
        None,
        ge=0,
        le=1,
        description="with bench: no task's score may fall below the champion's (without one: the base's) by more "
        "(0.01: 1 point)",
    )
    bench_min_mean_gain: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="with bench: the mean score over the tasks must beat the champion's (or base's) by this much",
    )
    hub: HubTarget | None = Field(None, description="also push the champion to this Hub model repository")

    @property
    def bench_rules(self) -> bool:
        return self.bench_max_regression is not None or self.bench_min_mean_gain is not None


class PromoteResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    decision: str  # "promoted", "kept" (the champion stays) or "unchanged" (the candidate already is the champion)
    reasons: list[str]
    champion: str | None  # the version in service after the decision
    candidate_sha256: str
    metrics: dict[str, EvalMetrics]  # "candidate" and "champion" (when there is one) on the same eval documents
    report_path: str
    hub: HubPush | None = None  # with `promote.hub`: the Hub repository after this gate
