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


def test_train_options_are_sections_and_every_flat_key_names_its_new_one():
    """`train` nests its components (optimizer, schedule, memory, checkpoint, metrics); each removed flat key, in a
    file or `--set`, fails with one line naming a key that exists."""
    from sftflow.flows.config import config_field
    from sftflow.tasks.train.config import MOVED_KEYS

    cfg = load_config(default={}, overrides={"train.optimizer.lr": "1e-4", "train.checkpoint.every": "3"})
    assert (cfg.train.optimizer.lr, cfg.train.checkpoint.every, cfg.train.schedule.kind) == (1e-4, 3, "cosine")
    assert len(MOVED_KEYS) == 27
    for old, new in MOVED_KEYS.items():
        config_field(new)  # raises for a key that does not exist
        with pytest.raises(ValueError, match=rf"^command line \(--set or an option\): 'train.{old}' is now '{new}'$"):
            load_config(default={}, overrides={f"train.{old}": "1"})
    with pytest.raises(ValueError, match=r"'train.schedule': .* now train.schedule.kind \(schedule: \{kind: linear"):
        load_config(default={"train": {"schedule": "linear"}})


def test_a_flows_overrides_are_the_command_lines_set(tmp_path):
    """A flow's `overrides` (dotted keys, as `-p overrides='{...}'` passes them) and its shorthand parameters
    (`learning_rate`, `max_steps`, `epochs`) go through `load_config`, the function behind the CLI's `--set`: the
    same config for the same keys, inline or from a file, and the same one-line errors, blamed on `overrides`."""
    from sftflow.flows.config import SFTConfig, resolve_config, with_shorthands

    path = tmp_path / "run.yaml"
    path.write_text("demo: {records: 50}\nplan: {tokens_per_rank: 512}\ntrain: {optimizer: {lr: 1.0e-3}}\n")
    overrides = {"train.optimizer.lr": 1e-5, "plan.epochs": 2, "train.checkpoint.every": 3}
    from_cli = load_config(path, {"train.optimizer.lr": "1e-5", "plan.epochs": "2", "train.checkpoint.every": "3"})
    from_file = resolve_config(str(path), None, overrides)
    inline = resolve_config(None, SFTConfig.from_yaml(path), overrides)
    assert from_file == inline == from_cli
    assert (inline.train.optimizer.lr, inline.plan.epochs, inline.train.checkpoint.every) == (1e-5, 2, 3)
    assert inline.plan.tokens_per_rank == 512  # what the overrides leave is the file's
    assert resolve_config(str(path), None, {}) == resolve_config(str(path), None) == SFTConfig.from_yaml(path)

    shorthands = with_shorthands({"train.checkpoint.every": 3}, learning_rate=1e-5, max_steps=None, epochs=2)
    assert shorthands == {"train.checkpoint.every": 3, "train.optimizer.lr": 1e-5, "plan.epochs": 2}
    assert resolve_config(str(path), None, shorthands) == from_cli
    with pytest.raises(ValueError, match=r"^learning_rate and overrides\['train.optimizer.lr'\] both set"):
        with_shorthands({"train.optimizer.lr": 1e-5}, learning_rate=1e-4)

    for bad, message in [
        (
            {"train.optimizer.lrr": 1e-5},
            "overrides: unknown key 'train.optimizer.lrr'; did you mean 'train.optimizer.lr'?",
        ),
        ({"train.lr": 1e-5}, "overrides: 'train.lr' is now 'train.optimizer.lr'"),
        ({"plan.epochs": 0}, "overrides: 'plan.epochs': Input should be greater than or equal to 1"),
        ({"work_dir.x": 1}, "work_dir.x: 'work_dir' is a value, not a section"),
    ]:
        for config_path, config in ((str(path), None), (None, inline)):
            with pytest.raises(ValueError) as err:
                resolve_config(config_path, config, bad)
            assert str(err.value) == message and "\n" not in str(err.value)


def test_the_sft_flow_refuses_a_bad_override_before_any_stage(tmp_path):
    """On Prefect's engine, as a deployment run passes them: an unknown key, or a shorthand and an override of the
    same key, fail the `sft` run with one line, before it takes the work folder or runs a stage."""
    from sftflow.flows.config import SFTConfig
    from sftflow.flows.sft import sft

    config = SFTConfig(work_dir=str(tmp_path / "work"), demo={"records": 10})
    for params, message in [
        ({"overrides": {"train.optimizer.lrr": 1e-5}}, "unknown key 'train.optimizer.lrr'"),
        ({"overrides": {"plan.epochs": 2}, "epochs": 3}, "epochs and overrides['plan.epochs'] both set plan.epochs"),
    ]:
        state = sft(config=config, **params, return_state=True)
        assert state.is_failed()
        error = state.result(raise_on_failure=False)
        assert isinstance(error, ValueError) and message in str(error) and "\n" not in str(error)
    assert not (tmp_path / "work").exists()


def test_a_value_no_member_of_a_union_takes_is_one_problem_naming_the_key():
    """`tokens_per_rank: int | "auto"`: the error names the user's key, not pydantic's union members, and says what
    each member takes."""
    from sftflow.flows.config import load_config

    with pytest.raises(ValueError) as err:
        load_config(None, {"plan.tokens_per_rank": "many"})
    message = str(err.value)
    assert "\n" not in message and "constrained" not in message and "literal" not in message
    assert "'plan.tokens_per_rank': Input should be a valid integer" in message
    assert message.endswith("or Input should be 'auto'")
