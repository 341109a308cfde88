"""The `check` section of a run config: how much of the user's data `sftflow check` samples, where it runs, and the
bounds its comparisons are held to."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CheckConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    before_train: bool = Field(
        False, description="run the checks in the `sft` flow before its stages, and stop there when one fails"
    )
    docs: int = Field(8, ge=1, description="documents sampled from the start of the sources (spread over them)")
    max_tokens: int = Field(
        4096, ge=2, description="tokens in the packed row the loss check builds (documents past it are left out)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the loss check runs (auto: a GPU if any)")
    loss_rtol: float = Field(1e-5, gt=0, description="largest relative difference of the loss from Hugging Face's")
    steps: int = Field(
        3, ge=0, description="steps of the training checks (2 ranks = 1 rank, kill + resume), on the CPU; 0 skips them"
    )
    ranks_rtol: float = Field(1e-4, gt=0, description="largest relative difference of 2 ranks' losses and weights")
    grad_rtol: float = Field(
        1e-4, gt=0, description="largest relative difference (L2) of any parameter's gradient from Hugging Face's"
    )

    @field_validator("steps")
    @classmethod
    def _room_to_kill(cls, value: int) -> int:
        if value == 1:  # the kill lands after the first step's checkpoint, in a later step
            raise ValueError("check.steps=1: no step after the first checkpoint to kill the run in; use 2+ (0 skips)")
        return value
