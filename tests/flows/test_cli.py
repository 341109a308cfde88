"""The stage commands as scripts call them. One data → plan → train run through the console script (a process each,
~15 s of start-up apiece) is shared by every test that can use it; what needs no Prefect flow runs in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sftflow.flows.cli import app
from sftflow.tasks.demo import write_demo
from tests.flows.conftest import run_cli

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """`sftflow data` in the README's form (two sources, one of them empty), then `plan` and `train` on a config file
    in another folder than the working directory: its relative `work_dir` resolves against the file, and each
    command's default input is the previous one's default output there."""
    root = tmp_path_factory.mktemp("cli")
    demo = write_demo(root / "demo", n=80)
    empty = root / "empty.jsonl"
    empty.write_text("")
    (root / "conf").mkdir()
    config = root / "conf" / "run.yaml"
    config.write_text("work_dir: ../work\nplan: {tokens_per_rank: 512}\n")
    work = root / "work"
    data = run_cli(
        "data", "--source", str(demo["data"]), "--source", str(empty), "--tokenizer", str(demo["tokenizer"]),
        "--out", str(work / "data"),
    )  # fmt: skip
    plan = run_cli("plan", "--config", str(config), "--num-ranks", "2", "--stats")
    train = run_cli(
        "train", "--config", str(config), "--nproc", "2", "--max-steps", "2", "--checkpoint-every", "1",
        "--lr", "1e-3", "--set", "train.checkpoint.keep_last=3", "--set", "track.tensorboard=true",
        "--set", "track.live_every_s=0.5",
    )  # fmt: skip
    return dict(root=root, config=config, work=work, empty=empty, data=data, plan=plan, train=train)


@pytest.mark.slow
def test_train_with_track_in_the_config_sends_the_steps_and_finishes_the_run(pipeline):
    """`sftflow train` with `track:` set (here `--set track.tensorboard=true`): no pipeline will add an eval, so
    the live run is finished and recorded closed when training ends."""
    pytest.importorskip("tensorboard", reason="needs the track extra (tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert pipeline["train"].returncode == 0, pipeline["train"].stderr[-3000:]
    (live,) = json.loads((pipeline["work"] / "run" / "live_track.json").read_text())
    assert live["tracker"] == "tensorboard" and live["sent_through"] == 2 and live["closed"]
    events = EventAccumulator(live["url"])
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


@pytest.mark.slow  # builds the pipeline fixture: data, plan and a training run through the CLI
def test_stage_commands_chain_through_the_config_work_folder(pipeline):
    work = pipeline["work"]
    for name in ("data", "plan", "train"):
        assert pipeline[name].returncode == 0, (name, pipeline[name].stderr[-3000:])
    assert f"{pipeline['empty']}: no records (an empty file?)" in pipeline["data"].stderr
    assert json.loads(pipeline["data"].stdout)["docs_train"] > 0
    assert json.loads(pipeline["plan"].stdout)["num_steps"] > 0
    with np.load(work / "plan" / "plan.npz") as plan:
        assert int(plan["num_ranks"]) == 2 and int(plan["tokens_per_rank"]) == 512  # flag, and the config file
    run = work / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-2"
    config = json.loads((run / "run.json").read_text())["config"]
    assert config["optimizer"]["lr"] == 1e-3 and config["checkpoint"]["keep_last"] == 3  # a flag and --set
    assert config["nproc"] == 2


def test_train_resumes_and_eval_reports(pipeline):
    config = str(pipeline["config"])
    # Rerunning into a run folder that holds checkpoints needs --resume; with it, training continues from `latest`
    # (here on 1 process: the 2-rank checkpoint reshards).
    result = invoke("train", "--config", config, "--max-steps", "3")
    assert result.exit_code == 2 and "--resume" in result.output
    result = invoke("train", "--config", config, "--max-steps", "3", "--resume")
    assert result.exit_code == 0, result.output[-3000:]
    run = pipeline["work"] / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    report = pipeline["root"] / "report"
    result = invoke(
        "eval", "--config", config, "--base", "tiny-llama", "--out", str(report),
        "--set", "eval.max_docs=8", "--set", "eval.max_generations=2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    assert "| tuned |" in result.output and "| base |" in result.output
    assert (report / "report.md").is_file()


def test_plan_from_lengths_prints_the_stats_contract(tmp_path):
    lengths = np.random.default_rng(0).integers(16, 800, size=5000)
    np.save(tmp_path / "lengths.npy", lengths)
    args = ["plan", "--lengths", str(tmp_path / "lengths.npy"), "--num-ranks", "4", "--tokens-per-rank", "2048"]
    result = invoke(*args, "--out", str(tmp_path / "plan"), "--stats-json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])
    keys = {"efficiency", "token_imbalance", "cost_imbalance", "num_steps", "num_rows", "planning_seconds"}
    keys.add("dropped_docs")
    assert keys <= set(stats)
    assert 0.9 < stats["efficiency"] <= 1.0
    with np.load(tmp_path / "plan" / "plan.npz") as plan:
        assert int(plan["num_ranks"]) == 4
        assert sorted(plan["doc_ids"].tolist()) == list(range(len(lengths)))


def test_bad_arguments_are_one_line_naming_the_way_out(pipeline, tmp_path):
    config, data = str(pipeline["config"]), str(pipeline["work"] / "data")

    def one_line_error(result, *expected: str) -> None:
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        for text in expected:
            assert text in result.output, result.output

    one_line_error(invoke("plan", "--data", data, "--lengths", "x.npy"), "one of --data DIR or --lengths")
    one_line_error(invoke("plan", "--config", config, "--set", "plan.mode=zigzag"), "'plan.mode'")
    one_line_error(invoke("plan", "--set", "plan.tokens_per_rnak=8"), "did you mean 'plan.tokens_per_rank'?")
    one_line_error(invoke("train", "--set", "train.optimizer.lr"), "expected KEY=VALUE")
    one_line_error(invoke("train", "--keep-last", "3"), "--set train.checkpoint.keep_last=VALUE")
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("work_dir: nothing-here\n")
    missing = tmp_path / "nothing-here" / "data"
    one_line_error(invoke("train", "--config", str(elsewhere)), f"{missing}: neither a `sftflow data` output")
    one_line_error(invoke("data", "--config", str(elsewhere)), "--source and --tokenizer are required")


def test_messages_say_where_and_what_to_do(pipeline, tmp_path):
    """Vague and silent cases of the first hour: each names the file or key and the way out."""
    from sftflow.flows.config import SFTConfig
    from sftflow.tasks.data.index import build_index
    from sftflow.tasks.plan.plan_files import plan_from_index
    from sftflow.tasks.plan.planner import PlanConfig

    config = tmp_path / "typo.yaml"
    config.write_text("demo: {records: 50}\nplan: {tokens_per_rnak: 512}\ntrain: {lerning_rate: 1e-3}\nevla: {}\n")
    with pytest.raises(ValueError) as err:
        SFTConfig.from_yaml(config)
    message = str(err.value)
    assert message.startswith(f"{config}: ")
    assert "unknown key 'plan.tokens_per_rnak'; did you mean 'plan.tokens_per_rank'?" in message
    assert "unknown key 'evla'; did you mean 'eval'?" in message
    assert "unknown key 'train.lerning_rate'; expected one of" in message and " optimizer," in message
    # A typo on the command line is the command line's, not the file's
    from sftflow.flows.config import load_config

    good = tmp_path / "good.yaml"
    good.write_text("demo: {records: 50}\nplan: {tokens_per_rank: 512}\n")
    with pytest.raises(ValueError) as err:
        load_config(good, {"train.learning_rate": "1e-3", "plan.epochs": "0"})
    message = str(err.value)
    assert message.startswith("command line (--set or an option): ") and str(good) not in message
    assert "unknown key 'train.learning_rate'" in message and "'plan.epochs'" in message
    good.write_text("demo: {records: 50}\nplan: {tokens_per_rnak: 512}\n")
    with pytest.raises(ValueError) as err:
        load_config(good, {"train.optimizer.lr": "1e-3"})
    assert str(err.value).startswith(f"{good}: unknown key 'plan.tokens_per_rnak'")

    data = pipeline["work"] / "data"
    index = json.loads((data / "data.json").read_text())["index"]["path"]
    with pytest.raises(
        ValueError, match=r"conversations\.jsonl:\d+ has \d+ tokens, more than a row holds .*--max-length"
    ):
        plan_from_index(Path(index).parent, PlanConfig(num_ranks=1, tokens_per_rank=8), tmp_path / "plan")
    shard = next(data.glob("**/shard.pbin"))
    listing = invoke("inspect", str(shard), "-n", "1")
    assert listing.exit_code == 0 and "pass --tokenizer" in listing.output

    build_index([], tmp_path / "empty-index")
    with pytest.raises(ValueError, match=r"nothing to plan: the dataset index .* has no train documents .*empty file"):
        plan_from_index(tmp_path / "empty-index", PlanConfig(num_ranks=1, tokens_per_rank=512), tmp_path / "plan2")


def test_a_user_error_in_a_flow_reaches_the_terminal_once(tmp_path, tiny_tokenizer_dir):
    """A bad record found inside nested flow runs (`sft` → `sft-data` → render): the terminal shows its one line
    once, as the command's `error:`, not again in each run's final state; the log keeps every record of it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assitant", "content": "x"}]}))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"work_dir: work\ndata: {{sources: [{bad}], tokenizer: {tiny_tokenizer_dir}, render: {{template: chatml}}}}\n"
    )
    result = run_cli("run", str(config))
    terminal = result.stdout + result.stderr
    reason = f"{bad}:1: messages[1].role is 'assitant'"
    assert result.returncode == 2, terminal
    assert terminal.count(reason) == 1, terminal
    assert f"error: {reason}" in terminal
    assert (tmp_path / "work" / "sftflow.log").read_text().count(reason) >= 3  # task, flows: all still logged


def test_every_default_is_the_config_models_own():
    """An option that sets a config field has no default of its own; its help shows the field's."""
    import inspect

    from sftflow.flows import cli
    from sftflow.flows.config import config_field

    for command in (cli.data, cli.plan, cli.train, cli.eval_command, cli.run, cli.check):
        for name, key in cli._config_keys(command).items():
            assert inspect.signature(command).parameters[name].default in (None, False), (command.__name__, name)
            config_field(key)  # a real field
    lines = {line.split()[1]: line for line in invoke("plan", "--help").output.splitlines() if "--" in line[:8]}
    assert "plan.tokens_per_rank, default 2048" in lines["--tokens-per-rank"]


def test_help_shows_what_options_take_not_their_types():
    """No `<str>`/`<bool>` tags: a flag shows nothing, a value a word (N, PATH, TEXT) or its choices, and options
    a command needs without a config file say so."""
    for command in ("data", "plan", "train", "eval", "inspect", "run", "promote", "server", "check"):
        result = invoke(command, "--help")
        assert result.exit_code == 0, result.output
        assert "<str>" not in result.output and "<bool>" not in result.output and "<int>" not in result.output
    data_help = invoke("data", "--help").output
    assert "--task-runner" in data_help and "threads|processes|dask" in data_help
    assert "(required without --config)" in data_help
    lines = {line.split()[1]: line for line in data_help.splitlines() if line.strip("│ ").startswith("--")}
    assert " N " in lines["--max-length"] and "TEXT" not in lines["--force"]
    # Which Prefect API a run uses, as it is now: the server PREFECT_API_URL names, else sftflow's local one
    run_help = " ".join(invoke("run", "--help").output.split())
    assert "ephemeral" not in run_help and "PREFECT_API_URL's server when set, else a local server" in run_help


def test_top_level_help_shows_no_type_tags_on_flags():
    """`sftflow --help`: its flags (--debug, --help) take no value, so their lines show no `<bool>`."""
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    assert "--debug" in result.output and "<bool>" not in result.output


def test_data_keeps_the_documented_command_line(tmp_path):
    """`sftflow data --source --tokenizer [--template] [--format] [--mask-policy] [--bos] [--eos] [--max-length]
    [--on-bad-record] --out`: scripts depend on these flags; each sets its config field."""
    from sftflow.flows import cli

    values = dict.fromkeys(cli._config_keys(cli.data)) | dict(
        source=["a.jsonl"],
        tokenizer="tok",
        template="chatml",
        format="sharegpt",
        mask_policy="roles",
        bos="never",
        eos="always",
        max_length=512,
        on_bad_record="reject",
        set=None,
        config=None,
    )
    data = cli._run_config(cli.data, values).data
    assert (data.render.format, data.render.mask_policy, data.render.on_bad_record) == ("sharegpt", "roles", "reject")
    assert (data.spans.bos, data.spans.eos, data.spans.max_length) == ("never", "always", 512)
    bad = invoke("data", "--source", "a.jsonl", "--tokenizer", "tok", "--eos", "sometimes", "--out", str(tmp_path))
    assert bad.exit_code == 2 and "data.spans.eos" in bad.output and "'always' or 'never'" in bad.output, bad.output


def test_every_flow_process_lets_its_openmp_threads_sleep():
    """A deployment's flow run (a subprocess Prefect starts, which imports the flows before torch) evaluates with
    OpenMP threads that sleep while they wait, as the CLI's do; a value the user set is kept."""
    import os
    import subprocess
    import sys

    probe = "import sftflow.flows.sft, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "PASSIVE"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=dict(env, OMP_WAIT_POLICY="ACTIVE"), capture_output=True, text=True
    )
    assert out.stdout.split()[0] == "ACTIVE"


def test_option_types_read_as_older_typer_releases_report_them():
    """Typer releases before its own type descriptors (GPU images ship them) hand the command click's options, with
    only click's type names: the command's metavars are the same from those."""
    import click

    from sftflow.flows.cli import _type_name

    options = [click.Option(["--x"], type=t) for t in (int, float, str, click.Path())]
    assert not any(hasattr(o, "display_type") for o in options)
    assert [_type_name(o) for o in options] == ["int", "float", "str", "path"]
