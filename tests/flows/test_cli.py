"""`sftflow plan` run as scripts call it (the data command is tested in test_data_flow.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sftflow.tasks.demo import write_demo
from tests.flows.conftest import run_cli


def test_plan_from_lengths_prints_the_stats_contract(tmp_path):
    lengths = np.random.default_rng(0).integers(16, 800, size=5000)
    np.save(tmp_path / "lengths.npy", lengths)
    args = ["plan", "--lengths", str(tmp_path / "lengths.npy"), "--num-ranks", "4", "--tokens-per-rank", "2048"]
    result = run_cli(*args, "--out", str(tmp_path / "plan"), "--stats-json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    keys = {"efficiency", "token_imbalance", "cost_imbalance", "num_steps", "num_rows", "planning_seconds"}
    keys.add("dropped_docs")
    assert keys <= set(stats)
    assert 0.9 < stats["efficiency"] <= 1.0
    with np.load(tmp_path / "plan" / "plan.npz") as plan:
        assert int(plan["num_ranks"]) == 4
        assert sorted(plan["doc_ids"].tolist()) == list(range(len(lengths)))


def test_plan_from_data_and_bad_arguments(tmp_path):
    demo = write_demo(tmp_path / "demo", n=80)
    data = tmp_path / "data"
    result = run_cli("data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"]), "--out", str(data))
    assert result.returncode == 0, result.stderr
    result = run_cli("plan", "--data", str(data), "--tokens-per-rank", "512", "--out", str(tmp_path / "p"), "--stats")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "p" / "plan.npz").is_file()
    assert json.loads(result.stdout)["num_steps"] > 0

    result = run_cli("plan", "--tokens-per-rank", "512", "--out", str(tmp_path / "q"))
    assert result.returncode == 2 and "exactly one of --data" in result.stderr
    result = run_cli("plan", "--data", str(data), "--mode", "zigzag", "--out", str(tmp_path / "q"))
    assert result.returncode == 2 and "mode" in result.stderr and "Traceback" not in result.stderr


def test_train_and_eval_commands(tmp_path):
    """data → plan → train → train --resume → eval through the console script, as the CLI contract spells them."""
    demo = write_demo(tmp_path / "demo", n=80)
    data, plan, run = tmp_path / "data", tmp_path / "plan", tmp_path / "run"
    assert (
        run_cli(
            "data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"]), "--out", str(data)
        ).returncode
        == 0
    )
    args = ["plan", "--data", str(data), "--num-ranks", "2", "--tokens-per-rank", "512", "--out", str(plan)]
    assert run_cli(*args).returncode == 0
    train = ["train", "--data", str(data), "--plan", str(plan), "--model", "tiny-llama", "--out", str(run)]
    result = run_cli(*train, "--nproc", "2", "--max-steps", "2", "--checkpoint-every", "1", "--lr", "1e-3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-2"

    # Rerunning into a run folder that holds checkpoints needs --resume; with it, training continues from `latest`
    # (here on 1 process: the 2-rank checkpoint reshards).
    result = run_cli(*train, "--max-steps", "3")
    assert result.returncode == 2 and "--resume" in result.stderr
    result = run_cli(*train, "--max-steps", "3", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

    result = run_cli(
        "eval", "--model", str(run / "hf"), "--data", str(data), "--base", "tiny-llama", "--out", str(tmp_path / "eval")
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| tuned |" in result.stdout and "| base |" in result.stdout
    assert (tmp_path / "eval" / "report.md").is_file()


def test_messages_say_where_and_what_to_do(tmp_path, caplog):
    """Vague and silent cases of the first hour: each names the file or key and the way out."""
    import logging

    from typer.testing import CliRunner

    from sftflow.flows.cli import app
    from sftflow.flows.config import SFTConfig
    from sftflow.tasks.plan import PlanConfig
    from sftflow.tasks.plan_stage import plan_from_index

    runner = CliRunner()
    result = runner.invoke(app, ["train", "--plan", str(tmp_path)])
    assert result.exit_code == 2 and "--data is required" in result.output and "mock" not in result.output

    config = tmp_path / "typo.yaml"
    config.write_text("demo: {records: 50}\nplan: {tokens_per_rnak: 512}\ntrain: {lerning_rate: 1e-3}\nevla: {}\n")
    with pytest.raises(ValueError) as err:
        SFTConfig.from_yaml(config)
    message = str(err.value)
    assert message.startswith(f"{config}: ")
    assert "unknown key 'plan.tokens_per_rnak'; did you mean 'plan.tokens_per_rank'?" in message
    assert "unknown key 'evla'; did you mean 'eval'?" in message
    assert "unknown key 'train.lerning_rate'; expected one of" in message and " lr," in message

    demo = write_demo(tmp_path / "demo", n=40)
    data = tmp_path / "data"
    assert (
        run_cli(
            "data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"]), "--out", str(data)
        ).returncode
        == 0
    )
    index = json.loads((data / "data.json").read_text())["index"]["path"]
    with pytest.raises(
        ValueError, match=r"conversations\.jsonl:\d+ has \d+ tokens, more than a row holds .*--max-length"
    ):
        plan_from_index(Path(index).parent, PlanConfig(num_ranks=1, tokens_per_rank=8), tmp_path / "plan")
    shard = next(data.glob("**/shard.pbin"))
    listing = runner.invoke(app, ["inspect", str(shard), "-n", "1"])
    assert listing.exit_code == 0 and "pass --tokenizer" in listing.output

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with caplog.at_level(logging.WARNING):
        result = run_cli(
            "data", "--source", str(empty), "--tokenizer", str(demo["tokenizer"]), "--out", str(tmp_path / "e")
        )
    assert result.returncode == 0
    assert f"{empty}: no records (an empty file?)" in result.stderr
    index = json.loads((tmp_path / "e" / "data.json").read_text())["index"]["path"]
    with pytest.raises(ValueError, match=r"nothing to plan: the dataset index .* has no train documents .*empty file"):
        plan_from_index(Path(index).parent, PlanConfig(num_ranks=1, tokens_per_rank=512), tmp_path / "plan2")


def test_the_cli_and_the_config_share_their_defaults():
    import inspect

    from sftflow.flows.cli import plan
    from sftflow.flows.config import PlanSection

    defaults = {name: p.default for name, p in inspect.signature(plan).parameters.items()}
    for name in ("tokens_per_rank", "epochs", "seed", "mode", "drop_last"):
        assert defaults[name] == PlanSection.model_fields[name].default, name


def test_help_shows_what_options_take_not_their_types():
    """No `<str>`/`<bool>` tags: a flag shows nothing, a value a word (N, PATH, TEXT) or its choices, and options
    a command needs without a config file say so."""
    from typer.testing import CliRunner

    from sftflow.flows.cli import app

    runner = CliRunner()
    for command in ("data", "plan", "train", "eval", "inspect", "run", "promote", "server"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        assert "<str>" not in result.output and "<bool>" not in result.output and "<int>" not in result.output
    data_help = runner.invoke(app, ["data", "--help"], env={"COLUMNS": "200"}).output
    assert "--mask-policy" in data_help and "generation|roles" in data_help
    assert "(required without --config)" in data_help
    lines = {line.split()[1]: line for line in data_help.splitlines() if line.strip("│ ").startswith("--")}
    assert " N " in lines["--max-length"] and "TEXT" not in lines["--force"]
