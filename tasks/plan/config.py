"""The planner's settings and the statistics of a plan: plain pydantic models, kept apart from the planner's code so
that the manifests (`sftflow.tasks.core.manifests`) can embed them without every stage keying on the planner."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sftflow.tasks.plan.cost import DocCost, check_points, load_points


class SourceAmount(BaseModel):
    """How much of one source a mixture takes per epoch, in trained tokens: a `weight` (a share of the mix), a
    `max_tokens` cap, or `epochs` (passes over the source; fractions draw part of a pass). At most one of them; none
    means one pass, and a weight or epochs of 0 leaves the source out."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    weight: float | None = Field(None, ge=0, description="share of the mix's trained tokens (0: leave it out)")
    max_tokens: int | None = Field(None, ge=1, description="at most this many trained tokens per epoch")
    epochs: float | None = Field(None, ge=0, description="passes over this source per epoch (0.5: half, 0: none)")

    @property
    def mixes(self) -> bool:
        return self.weight is not None or self.max_tokens is not None or self.epochs is not None

    @model_validator(mode="after")
    def _one_amount(self):
        given = [k for k in ("weight", "max_tokens", "epochs") if getattr(self, k) is not None]
        if len(given) > 1:
            label = getattr(self, "name", None) or getattr(self, "path", None) or getattr(self, "hub", None)
            raise ValueError(f"source {label!r}: give one of weight, max_tokens and epochs, not {' and '.join(given)}")
        return self


class SourceShare(SourceAmount):
    """A `SourceAmount` of the source named `name` in the dataset index: what the planner's mixture holds."""

    name: str


class PlanConfig(BaseModel):
    """The `plan` section of a run config, and the planner's settings. Cost of a document of `L` tokens is
    `cost_per_token·L + cost_per_token_pair·L²`; `cost_per_token_pair=None` means `1/tokens_per_rank`, i.e. a
    full-length document costs twice its tokens (see `cost_coefficients_from_model` for values from a model shape).
    `cost_table`, measured on the GPU (`benchmarks/cost_table.py`; a file of them or the points themselves), replaces
    both: see `sftflow.tasks.plan.cost`. A file is read here, so the plan's cache key holds the points, not the path.
    Give `micro_batches_per_step` or `target_tokens_per_step` (trainable tokens per optimizer step); neither means 1.
    `mixture`, when given, resolves each epoch's documents per source (see `sftflow.tasks.plan.mixture`); without it
    every document is planned once per epoch.

    The flow fills in what a run config leaves to it (`sftflow.flows.config.plan_config`): `num_ranks`, a
    `tokens_per_rank` of `auto`, and `mixture` (from `data.sources`); the planner takes only a config so resolved.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_ranks: int | None = Field(None, ge=1, description="data-parallel ranks (default: train.nproc × train.nnodes)")
    tokens_per_rank: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        2048,
        description="tokens in one packed row on one rank, or auto: the longest row the training GPUs' memory fits "
        "beside the model's weights and optimizer state, with train.memory.activation_checkpointing (auto plans for "
        "rows that fit without it)",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        description="free GiB on one training GPU, for tokens_per_rank: auto (default: this machine's first GPU)",
    )
    micro_batches_per_step: int | None = Field(None, ge=1, description="gradient accumulation: micro-batches a step")
    target_tokens_per_step: int | None = Field(
        None, ge=1, description="or gradient accumulation sized by trained tokens per step"
    )
    epochs: int = Field(1, ge=1, description="passes over the training data")
    seed: int = Field(0, ge=0, description="seed of each epoch's shuffle (and a mixture's draw)")
    mode: Literal["packed", "padded", "iterative"] = Field(
        "packed",
        description="packed: documents share rows (varlen attention); padded: for models without varlen attention; "
        "iterative: one document a row",
    )
    shuffle: bool = Field(True, description="visit documents in a seeded random order (false: index order)")
    drop_last: bool = Field(False, description="drop the last partial step instead of spreading it over the ranks")
    max_steps: int | None = Field(
        None, ge=1, description="plan at most this many optimizer steps (a run config: train.max_steps)"
    )
    cost_per_token: float = Field(1.0, ge=0, description="a in the a·L + b·L² cost of a document of L tokens")
    cost_per_token_pair: float | None = Field(None, ge=0, description="b in that cost (default: 1/tokens_per_rank)")
    cost_table: tuple[tuple[int, float], ...] = Field(
        (),
        description="measured step time per token by document length (a file from benchmarks/cost_table.py, or "
        "[[length, time], ...]): the planner balances ranks by it instead of the a·L + b·L² estimate",
    )
    mixture: tuple[SourceShare, ...] = Field(
        (), description="each source's share (a run config: data.sources' weight, max_tokens or epochs)"
    )
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

    def require_resolved(self) -> None:
        """Raise unless the flow has filled in `num_ranks` and a number for `tokens_per_rank`."""
        if self.num_ranks is None or not isinstance(self.tokens_per_rank, int):
            raise ValueError(
                f"plan: the planner needs num_ranks and tokens_per_rank as numbers, got num_ranks={self.num_ranks}, "
                f"tokens_per_rank={self.tokens_per_rank!r} (sftflow.flows.config.plan_config fills them in)"
            )

    @property
    def cost_coefficients(self) -> tuple[float, float]:
        self.require_resolved()
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
