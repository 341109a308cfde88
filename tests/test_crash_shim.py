"""The crash hook (`tests/crash_shim`) on a run that ends before its crash step: the run finishes as without it (the
hook passes the worker's end-of-run checkpoint call through)."""

from __future__ import annotations

from sftflow.tasks.plan.planner import PlanConfig
from tests.tasks.train_helpers import metrics, planned_mock, run


def test_a_run_that_ends_before_the_crash_step_finishes(tmp_path, tiny_tokenizer, tiny_tokenizer_dir, inject_crash):
    config, _, arrays = planned_mock(
        tmp_path, len(tiny_tokenizer), tiny_tokenizer_dir, PlanConfig(num_ranks=1, tokens_per_rank=128)
    )
    inject_crash("crash_after_step=99")
    result = run(config, tmp_path / "run", max_steps=3, checkpoint=dict(every=2))
    assert result.steps == 3
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert not (tmp_path / "run" / "fault-fired").exists()
