"""How a plan's row length (`tokens_per_rank`) was chosen, recorded beside its `plan.npz`.

The choice is made before planning, by the resolved run's rules (`sftflow.tasks.train.resolved.resolve_rows`); the
flow hands it to the planner as data (`RowLength`), the planner writes it into the plan folder (`row_length.json`),
and the launch reads it back, so the run's `tokens per rank` line says why its rows have that length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from sftflow.tasks.core.atomic import write_atomic

ROW_LENGTH_FILE = "row_length.json"


class RowLength(BaseModel):
    """The plan's row length: its `value`, what was asked (`setting`: that number, or auto) and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: int = Field(ge=1)
    setting: Annotated[int, Field(ge=1)] | Literal["auto"]
    reason: str

    def cache_key(self) -> str | None:
        """What the plan stage's cache key holds of it: only that `auto` chose the rows (the number itself is in the
        plan's config). Never the reason, which names the free memory the rows were sized in: a GPU with a little
        less free that plans the same rows reuses the plan, and a set number keys as it did without a record."""
        return "auto" if self.setting == "auto" else None


def write_row_length(out_dir: Path, row_length: RowLength | None, tokens_per_rank: int) -> None:
    """Record `row_length` in `out_dir` beside the plan of rows of `tokens_per_rank` tokens; without one, remove a
    record an earlier plan left there."""
    path = Path(out_dir) / ROW_LENGTH_FILE
    if row_length is None:
        path.unlink(missing_ok=True)
        return
    if row_length.value != tokens_per_rank:
        raise ValueError(
            f"plan: rows of {tokens_per_rank:,} tokens, and the row length's choice says {row_length.value:,}"
        )
    write_atomic(path, row_length.model_dump_json(indent=2))


def read_row_length(plan_dir: str | Path) -> RowLength | None:
    """The row length's choice the plan in `plan_dir` recorded; None for a plan from before it was recorded."""
    path = Path(plan_dir) / ROW_LENGTH_FILE
    if not path.is_file():
        return None
    return RowLength.model_validate_json(path.read_text())
