"""A three-source mixture through the real `sft-data` and `sft-plan` flows: sources keep their names from the config
file, the plan meets the requested shares, and a weight change reruns the plan alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from sftflow.flows.config import load_config
from sftflow.flows.data import sft_data
from sftflow.flows.plan import sft_plan
from sftflow.flows.train import sft_train
from sftflow.tasks.demo import write_demo
from sftflow.tasks.plan.row_length import read_row_length
from tests.flows.conftest import task_states

pytestmark = pytest.mark.slow


def _write_config(folder: Path, demo: dict, weights: list[float]) -> Path:
    config = {
        "work_dir": "work",
        "data": {
            "sources": [
                {"path": "data/chat.jsonl", "weight": weights[0]},
                {"path": "data/code.jsonl", "name": "code", "weight": weights[1]},
                {"path": "data/math.jsonl", "weight": weights[2]},
            ],
            "tokenizer": str(demo["tokenizer"]),
            "render": {"template": "chatml"},
            "index": {"eval_fraction": 0.1},
        },
        "plan": {"tokens_per_rank": 512},
    }
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_three_source_mixture_plans_its_shares_and_reruns_only_the_plan(tmp_path):
    demo = write_demo(tmp_path / "demo", n=150)
    records = [json.loads(line) for line in Path(demo["data"]).read_text().splitlines()]
    # every other record carries a tag: metrics break down by it too
    lines = [
        json.dumps({**r, "tag": "long" if i % 3 == 0 else "short"} if i % 2 else r) + "\n"
        for i, r in enumerate(records)
    ]
    (tmp_path / "data").mkdir()
    for name, part in (("chat", lines[:80]), ("code", lines[80:120]), ("math", lines[120:])):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(part))

    config_path = _write_config(tmp_path, demo, [0.2, 0.3, 0.5])
    data = sft_data(config_path=str(config_path))
    index_json = json.loads(Path(data.index.path).read_text())
    assert index_json["sources"] == ["chat.jsonl", "code", "math.jsonl"]
    assert sorted(index_json["tags"]) == ["long", "short"]
    plan = sft_plan(config_path=str(config_path), data=data)
    shares = {s.name: s for s in plan.stats.sources}
    for name, weight in (("chat.jsonl", 0.2), ("code", 0.3), ("math.jsonl", 0.5)):
        assert shares[name].requested_share == pytest.approx(weight)
        assert abs(shares[name].planned_share - weight) < 0.03, shares[name]
    assert shares["math.jsonl"].planned_docs > shares["math.jsonl"].docs  # the small source is up-sampled
    stats = json.loads((Path(plan.path).parent / "stats.json").read_text())
    assert [s["name"] for s in stats["sources"]] == ["chat.jsonl", "code", "math.jsonl"]

    # Another weight changes the plan, not the data: every data task is Cached.
    config_path = _write_config(tmp_path, demo, [0.6, 0.2, 0.2])
    state = sft_data(config_path=str(config_path), return_state=True)
    assert all(s == "Cached" for states in task_states(state).values() for s in states), task_states(state)
    state = sft_plan(config_path=str(config_path), data=state.result(), return_state=True)
    assert task_states(state) == {"plan": ["Completed"]}
    replanned = state.result()
    assert replanned.sha256 != plan.sha256
    assert abs({s.name: s for s in replanned.stats.sources}["chat.jsonl"].planned_share - 0.6) < 0.03

    # `tokens_per_rank: auto` becomes a number before the plan's cache key is made: the tiny preset fits rows up to its
    # 2048 positions, and the same settings again are Cached; the plan records why its rows have that length (the
    # reason is not keyed: a GPU with a little less free memory that plans the same rows reuses the plan).
    for expected, gib in (("Completed", 4), ("Cached", 3.5)):
        auto = load_config(config_path, {"plan.tokens_per_rank": "auto", "plan.device_memory_gib": gib})
        state = sft_plan(config=auto, data=data, return_state=True)
        assert task_states(state) == {"plan": [expected]}
        with np.load(state.result().path) as arrays:
            assert int(arrays["tokens_per_rank"]) == 2048
        recorded = read_row_length(state.result().dir)
        assert (recorded.value, recorded.setting) == (2048, "auto")
        assert recorded.reason.endswith("in 4.0 GiB free (plan.device_memory_gib)")  # as first planned

    # Training logs each step's trained tokens per source, and its loss and token accuracy per source and per tag.
    overrides = {"train.model": "tiny-llama", "train.max_steps": 3, "train.num_threads": 1}
    trained = sft_train(config=load_config(config_path, overrides), data=state_data(tmp_path), plan=replanned)
    rows = [json.loads(line) for line in Path(trained.metrics_path).read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert set(row["trained_tokens_by_source"]) == {"chat.jsonl", "code", "math.jsonl"}
        assert sum(row["trained_tokens_by_source"].values()) == row["trained_tokens"]
        assert {k: v["trained_tokens"] for k, v in row["breakdown"]["source"].items()} == row[
            "trained_tokens_by_source"
        ]
        tags = row["breakdown"]["tag"]
        assert set(tags) <= {"short", "long", "(none)"} and "(none)" in tags
        assert sum(t["trained_tokens"] for t in tags.values()) == row["trained_tokens"]


def state_data(folder: Path):
    from sftflow.flows.data import load_data_result

    return load_data_result(folder / "work")
