"""The planner's settings and the statistics of a plan: plain pydantic models, kept apart from the planner's code so
that the manifests (`sftflow.tasks.core.manifests`) can embed them without every stage keying on the planner."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sftflow.tasks.plan.cost import DocCost, check_points, load_points


class SourceShare(BaseModel):
    """How much of one source (named as in the dataset index) a mixture takes per epoch, in trained tokens: a
    `weight` (a share of the mix), a `max_tokens` cap, or `epochs` (passes over the source; fractions draw part of a
    pass). At most one of them; none means one pass, and a weight or epochs of 0 leaves the source out."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    weight: float | None = Field(None, ge=0)  # 0 (or epochs 0) leaves the source out
    max_tokens: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_amount(self) -> SourceShare:
        given = [k for k in ("weight", "max_tokens", "epochs") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"source {self.name!r}: give one of weight, max_tokens and epochs, not {' and '.join(given)}"
            )
        return self


class PlanConfig(BaseModel):
    """Planner settings. Cost of a document of `L` tokens is `cost_per_token·L + cost_per_token_pair·L²`;
    `cost_per_token_pair=None` means `1/tokens_per_rank`, i.e. a full-length document costs twice its
    tokens (see `cost_coefficients_from_model` for values from a model shape). `cost_table`, measured on the GPU
    (`benchmarks/cost_table.py`; a file of them or the points themselves), replaces both: see
    `sftflow.tasks.plan.cost`. A file is read here, so the plan's cache key holds the points, not the path.
    Give `micro_batches_per_step` or `target_tokens_per_step` (trainable tokens per optimizer step); neither means 1.
    `mixture`, when given, resolves each epoch's documents per source (see `sftflow.tasks.plan.mixture`); without it
    every document is planned once per epoch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int = Field(ge=1)
    tokens_per_rank: int = Field(ge=1)
    micro_batches_per_step: int | None = Field(None, ge=1)
    target_tokens_per_step: int | None = Field(None, ge=1)
    epochs: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)
    mode: Literal["packed", "padded", "iterative"] = "packed"
    shuffle: bool = True
    drop_last: bool = False
    max_steps: int | None = Field(None, ge=1)
    cost_per_token: float = Field(1.0, ge=0)
    cost_per_token_pair: float | None = Field(None, ge=0)
    cost_table: tuple[tuple[int, float], ...] = ()
    mixture: tuple[SourceShare, ...] = ()
    too_long: Literal["drop", "error"] = Field(
        "drop",
        description="a document longer than a row (tokens_per_rank): drop it, counted in the plan's stats with a "
        "warning naming the longest, or stop with an error naming it",
    )

    @field_validator("cost_table", mode="before")
    @classmethod
    def _read_cost_table(cls, value):
        if value is None:
            return ()
        if isinstance(value, str | Path):
            return load_points(value)
        return check_points(value) if value else ()

    @model_validator(mode="after")
    def _one_batch_size(self) -> PlanConfig:
        if self.micro_batches_per_step is not None and self.target_tokens_per_step is not None:
            raise ValueError("give micro_batches_per_step or target_tokens_per_step, not both")
        names = [s.name for s in self.mixture]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture: each source once, got {names}")
        return self

    @property
    def cost_coefficients(self) -> tuple[float, float]:
        b = self.cost_per_token_pair if self.cost_per_token_pair is not None else 1.0 / self.tokens_per_rank
        return self.cost_per_token, b

    @property
    def doc_cost(self) -> DocCost:
        a, b = self.cost_coefficients
        return DocCost(a=a, b=b, table=self.cost_table)


class SourceStats(BaseModel):
    """One source in a plan, over all its epochs: trained tokens (prediction targets) asked for and planned."""

    model_config = ConfigDict(frozen=True)
    name: str
    docs: int  # documents of the source in the train split
    available_tokens: int  # their trained tokens, one pass
    requested_tokens: float  # what the mixture asks for, all epochs
    planned_tokens: int  # what the plan trains
    planned_docs: int  # document visits, repeats counted
    requested_share: float
    planned_share: float


class PlanStats(BaseModel):
    """Plan quality; imbalance is max/mean over the ranks of one micro-batch (mean and p99 over micro-batches)."""

    model_config = ConfigDict(frozen=True)

    efficiency: float  # real tokens / (rows × tokens_per_rank), empty rows included
    token_imbalance: float
    token_imbalance_p99: float
    cost_imbalance: float
    cost_imbalance_p99: float
    num_steps: int
    steps_per_epoch: list[int]
    num_rows: int
    num_empty_rows: int
    micro_batches_per_step: int
    total_tokens: int
    total_loss_tokens: int
    avg_doc_length: float
    planning_seconds: float
    dropped_docs: int
    too_long_docs: int = 0  # documents longer than a row, left out of every epoch (`too_long: drop`)
    sources: list[SourceStats] = []
