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


def test_one_max_length_and_the_old_key_names_the_new_one(tmp_path):
    """Tokenization owns the longest document (it drops or truncates); the index's old key says where it went, in
    the file and on the command line, as a config error (exit 2) naming the file."""
    from typer.testing import CliRunner

    from sftflow.flows.cli import app
    from sftflow.tasks.data.index_config import IndexConfig

    assert "max_length" not in IndexConfig.model_fields
    raw = {"data": {"tokenizer": "t", "sources": ["a.jsonl"], "index": {"max_length": 512}}}
    with pytest.raises(ValueError, match=r"^config: 'data.index.max_length' is now 'data.spans.max_length'$"):
        load_config(default=raw)
    with pytest.raises(ValueError, match=r"^command line .*'data.index.max_length' is now 'data.spans.max_length'$"):
        data = {"tokenizer": "t", "sources": ["a.jsonl"]}
        load_config(default={"data": data}, overrides={"data.index.max_length": 8})
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  tokenizer: t\n  sources: [a.jsonl]\n  index: {max_length: 512}\n")
    result = CliRunner().invoke(app, ["plan", "--config", str(path), "--out", str(tmp_path / "plan")])
    assert result.exit_code == 2, result.output
    assert f"{path}: 'data.index.max_length' is now 'data.spans.max_length'" in result.output
