"""The row length's choice travels with the plan: recorded beside `plan.npz`, and keyed only as far as it decides the
plan (the number is in the plan's config; the reason, which names the free memory, is not keyed)."""

from __future__ import annotations

import pytest

from sftflow.tasks.plan.config import PlanConfig
from sftflow.tasks.plan.plan_files import plan_from_index
from sftflow.tasks.plan.row_length import ROW_LENGTH_FILE, RowLength, read_row_length
from sftflow.tasks.plan.stage import PLAN_CACHE

AUTO = RowLength(value=2048, setting="auto", reason="auto: the longest row that fits ... in 79.1 GiB free (H100)")


def test_the_plan_records_how_its_rows_were_chosen(tmp_path):
    from sftflow.tasks.train.mock import MockConfig, write_mock_index

    write_mock_index(MockConfig(num_docs=32, vocab_size=512, max_length=512, seed=1), tmp_path / "data")
    config = PlanConfig(num_ranks=1, tokens_per_rank=2048)
    plan_from_index(tmp_path / "data", config, tmp_path / "plan", row_length=AUTO)
    assert read_row_length(tmp_path / "plan") == AUTO
    with pytest.raises(ValueError, match="rows of 1,024 tokens, and the row length's choice says 2,048"):
        plan_from_index(tmp_path / "data", config.model_copy(update={"tokens_per_rank": 1024}), tmp_path / "plan",
                        row_length=AUTO)  # fmt: skip
    # Planned again without a choice (a caller of its own): no record of an earlier plan's choice stays behind.
    plan_from_index(tmp_path / "data", config, tmp_path / "plan")
    assert not (tmp_path / "plan" / ROW_LENGTH_FILE).exists() and read_row_length(tmp_path / "plan") is None


def test_the_plan_key_holds_the_number_and_auto_never_the_reason():
    def key(tokens: int, row_length: RowLength | None) -> str:
        config = PlanConfig(num_ranks=1, tokens_per_rank=tokens)
        return PLAN_CACHE.key_for({"index": "i", "config": config, "work_dir": "w", "row_length": row_length})

    busier = AUTO.model_copy(update={"reason": "auto: the longest row that fits ... in 78.9 GiB free (H100)"})
    assert key(2048, AUTO) == key(2048, busier)  # a GPU with a little less free that plans the same rows
    assert key(2048, AUTO) != key(4096, AUTO.model_copy(update={"value": 4096}))
    set_rows = RowLength(value=2048, setting=2048, reason="set")
    assert key(2048, set_rows) == key(2048, None)  # a set number keys as it did without a record
    assert key(2048, set_rows) != key(2048, AUTO)  # `auto` that lands on a set number's rows plans (and says) anew
