"""The index stage's settings, apart from its code: the run config (`sftflow.flows.config`) embeds them, and the
CLI's `train` and `plan` commands read that config on machines that may lack Prefect, which the stage imports."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DecontamConfig(BaseModel):
    """Training documents that share long word n-grams with a benchmark's items (`sftflow.tasks.data.decontam`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    action: Literal["off", "drop", "flag"] = Field(
        "off", description="drop contaminated documents, flag them (kept, counted and listed) or do nothing"
    )
    benchmarks: list[str] = Field(
        default_factory=list, description="JSONL files of benchmark items: texts, or task records (question, answer)"
    )
    fields: list[str] = Field(
        default_factory=lambda: ["text", "question", "answer", "choices"],
        min_length=1,
        description="the benchmark records' fields whose text (a string or a list of strings) is checked",
    )
    ngram: int = Field(13, ge=1, description="words per n-gram (lower-cased, punctuation dropped)")
    min_matches: int = Field(1, ge=1, description="distinct benchmark n-grams a document must share to count")

    @model_validator(mode="after")
    def _benchmarks_when_on(self):
        if self.action != "off" and not self.benchmarks:
            raise ValueError(f"decontaminate.action is {self.action!r}: list the benchmark files in `benchmarks`")
        return self


class NearDedupConfig(BaseModel):
    """Near-duplicate documents by MinHash/LSH over word shingles (`sftflow.tasks.data.near_dup`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = Field(False, description="drop near-duplicate documents")
    threshold: float = Field(0.8, gt=0.0, le=1.0, description="estimated Jaccard similarity at which a doc is dropped")
    shingle: int = Field(5, ge=1, description="words per shingle")
    num_perm: int = Field(128, ge=8, le=1024, description="MinHash permutations (more: a closer Jaccard estimate)")
    seed: int = Field(0, ge=0, description="seed of the MinHash permutations")


class IndexConfig(BaseModel):
    """Which tokenized documents the dataset index keeps and how it splits them. The longest document is
    `data.spans.max_length`: tokenization drops or truncates what is longer, so the index never sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = {"max_length": "data.spans.max_length"}
    dedup: bool = Field(True, description="drop exact duplicates")
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0, description="held-out share, by content hash")
    split_salt: str = Field("sftflow", description="salt of the content hash that splits train and eval")
    decontaminate: DecontamConfig = Field(DecontamConfig(), description="drop or flag overlaps with benchmarks")
    near_dedup: NearDedupConfig = Field(NearDedupConfig(), description="MinHash near-duplicate removal")

    @property
    def reads_text(self) -> bool:
        """Whether the index reads the rendered text of its documents (the filters that work on words)."""
        return self.decontaminate.action != "off" or self.near_dedup.enabled
