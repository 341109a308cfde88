"""The index stage's settings, apart from its code: the run config (`sftflow.flows.config`) embeds them, and the
CLI's `train` and `plan` commands read that config on machines that may lack Prefect, which the stage imports."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IndexConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_length: int | None = Field(default=None, ge=1)
    dedup: bool = True
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    split_salt: str = "sftflow"
