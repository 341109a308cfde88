"""The run config's models: each setting defined once, what the flow fills in, and the errors a user sees."""

from __future__ import annotations

import numpy as np
import pytest

from sftflow.flows.config import load_config, plan_config
from sftflow.tasks.plan.config import PlanConfig, SourceShare
from sftflow.tasks.plan.planner import plan


def test_a_run_configs_plan_section_is_the_planners_config_filled_in_by_the_flow(tmp_path):
    """One model: the `plan` section is a `PlanConfig`; the flow fills in the ranks, the mixture of `data.sources`
    and an `auto` row length, and the planner refuses a config left unresolved."""
    raw = {
        "data": {"tokenizer": "t", "sources": [{"path": "a.jsonl", "weight": 0.3}, "b.jsonl"]},
        "plan": {"tokens_per_rank": 64, "epochs": 2},
        "train": {"nproc": 2},
    }
    cfg = load_config(default=raw)
    assert isinstance(cfg.plan, PlanConfig) and cfg.plan.num_ranks is None
    resolved = plan_config(cfg)
    assert (resolved.num_ranks, resolved.tokens_per_rank, resolved.epochs) == (2, 64, 2)
    assert resolved.mixture == (SourceShare(name="a.jsonl", weight=0.3), SourceShare(name="b.jsonl"))
    with pytest.raises(ValueError, match="needs num_ranks and tokens_per_rank as numbers"):
        plan(np.array([10, 20]), np.array([9, 19]), cfg.plan)
    with pytest.raises(ValueError, match="plan.mixture: set each source's weight"):
        load_config(default={**raw, "plan": {"mixture": [{"name": "a.jsonl", "weight": 0.5}]}})
    with pytest.raises(ValueError, match="plan.max_steps: set train.max_steps"):
        load_config(default={**raw, "plan": {"max_steps": 3}})
    two = {**raw, "data": {"tokenizer": "t", "sources": [{"path": "a.jsonl", "weight": 0.3, "epochs": 1}]}}
    with pytest.raises(ValueError, match="source 'a.jsonl': give one of weight, max_tokens and epochs"):
        load_config(default=two)
