"""The planner's measured cost table: it reproduces the two-term model where the table is that model, continues
past its longest length, is validated with errors naming the problem, travels in the plan's config as points (not
a path), and, when attention is expensive, gives plans better balanced under that cost than the default estimate."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from sftflow.flows.config import SFTConfig, load_config, plan_config
from sftflow.tasks.plan.cost import DocCost
from sftflow.tasks.plan.planner import PlanConfig, plan, plan_stats


def test_a_table_of_the_two_term_model_reproduces_it_and_continues_past_its_end():
    a, b = 3.0, 1 / 512
    table = tuple((L, a + b * L) for L in (1, 256, 1024, 4096))  # per-token time of a·L + b·L²
    model, measured = DocCost(a=a, b=b), DocCost(a=1.0, b=0.0, table=table)
    lengths = np.array([1, 7, 256, 300, 1000, 4096, 5000, 65536])
    np.testing.assert_allclose(measured(lengths), model(lengths), rtol=1e-12)
    assert measured(100) == pytest.approx(model(100))  # a scalar in, a float out
    # below the shortest length the per-token time is held, not extrapolated
    short = DocCost(a=1.0, b=0.0, table=((64, 2.0), (128, 3.0)))
    assert short(16) == pytest.approx(16 * 2.0) and short(256) == pytest.approx(256 * 5.0)


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([[512, 1.0]], "at least 2"),
        ([[512, 1.0], [256, 2.0]], "strictly increasing"),
        ([[0, 1.0], [256, 2.0]], "positive"),
        ([[256, 1.0], [512, -2.0]], "positive number"),
        ([["x", 1.0], [512, 2.0]], r"\[\[length, time_per_token\]"),
    ],
)
def test_a_bad_table_is_an_error_saying_what_is_wrong(points, message):
    with pytest.raises(ValidationError, match=message):
        PlanConfig(num_ranks=1, tokens_per_rank=1024, cost_table=points)


def test_a_table_file_is_read_into_the_config_relative_to_the_run_config(tmp_path):
    (tmp_path / "tables").mkdir()
    table = {"gpu": "test", "points": [[256, 1.0], [4096, 3.0]]}
    (tmp_path / "tables" / "h200.json").write_text(json.dumps(table))
    (tmp_path / "run.yaml").write_text(
        "demo: {records: 20}\nplan: {tokens_per_rank: 1024, cost_table: tables/h200.json}\n"
    )
    config = plan_config(load_config(tmp_path / "run.yaml"))
    # the points, not the path, are what the plan's cache key sees: editing the file replans
    assert config.cost_table == ((256, 1.0), (4096, 3.0))
    assert "h200.json" not in config.model_dump_json()

    with pytest.raises(ValidationError, match="file not found"):
        plan_config(SFTConfig.model_validate({"demo": {}, "plan": {"cost_table": str(tmp_path / "missing.json")}}))
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValidationError, match=r'bad.json: expected an object with "points"'):
        plan_config(SFTConfig.model_validate({"demo": {}, "plan": {"cost_table": str(tmp_path / "bad.json")}}))


def test_with_expensive_attention_the_table_balances_ranks_better_than_the_estimate():
    rng = np.random.default_rng(0)
    short = np.clip(rng.lognormal(np.log(300), 0.8, size=3000), 16, 4096).astype(np.int64)
    long = rng.integers(2048, 4096, size=150)  # a few long documents, each a row of its own or nearly
    lengths = np.concatenate([short, long])
    rng.shuffle(lengths)
    loss = np.maximum(lengths // 2, 1)
    base = {"num_ranks": 4, "tokens_per_rank": 4096, "micro_batches_per_step": 2, "seed": 1}
    # attention-dominated: per-token time grows 16x from 256 to 4096 tokens (long rows, small model, long context)
    steep = PlanConfig(**base, cost_table=((256, 1.0), (4096, 16.0)))
    estimate = PlanConfig(**base)  # a·L + L²/tokens_per_rank: a full-length document costs twice its tokens

    with_table, stats = plan(lengths, loss, steep)
    with_estimate, _ = plan(lengths, loss, estimate)
    judged = plan_stats(with_estimate, lengths, steep, [with_estimate.num_steps], 0.0)
    assert stats.cost_imbalance < judged.cost_imbalance, (stats.cost_imbalance, judged.cost_imbalance)
    assert with_table.num_steps == with_estimate.num_steps  # same rows, arranged by the measured cost
