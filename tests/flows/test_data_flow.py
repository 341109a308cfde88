"""`sft-data` on Prefect's real engine: caching across runs, precise invalidation, retries, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sftflow.flows.config import DataConfig, SFTConfig
from sftflow.flows.data import run_data, sft_data
from sftflow.tasks.demo import write_demo
from sftflow.tasks.tiny import builtin_chatml_template
from tests.flows.conftest import run_counts, task_states

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo(tmp_path_factory.mktemp("demo"), n=120)


def _config(demo, template: Path, **extra) -> DataConfig:
    return DataConfig(
        sources=[str(demo["data"])], tokenizer=str(demo["tokenizer"]), render={"template": str(template)}, **extra
    )


def _run(config: DataConfig, work_dir: Path):
    state = sft_data(config=SFTConfig(work_dir=str(work_dir), data=config), return_state=True)
    return state, task_states(state)


def test_second_run_is_cached_and_edits_rerun_only_what_depends_on_them(demo, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(builtin_chatml_template())
    config = _config(demo, template)
    work = tmp_path / "work"

    state, states = _run(config, work)
    assert state.is_completed()
    assert states == {"render": ["Completed"], "spans": ["Completed"], "pbin": ["Completed"], "index": ["Completed"]}
    first = state.result()
    assert first.index.num_train > 0
    # How the template was chosen goes into data.json for the train stage; a data.json from before it was recorded
    # still loads, without it.
    from sftflow.flows.data import DataResult, load_data_result
    from sftflow.flows.steps import data_inputs
    from sftflow.tasks.core.manifests import TemplateChoice

    assert first.template_choice == TemplateChoice(name="chat.jinja", how="file")
    assert data_inputs(work)[2:] == (first.chat_template, first.template_choice)
    assert load_data_result(work) == first
    old = json.loads(first.model_dump_json(exclude={"template_choice"}))
    assert DataResult.model_validate(old).template_choice is None

    state, states = _run(config, work)
    assert all(s == ["Cached"] for s in states.values()), states
    assert state.result() == first

    # Deleting the pbin shard reruns pbin alone: it rewrites identical bytes, so the index stays cached.
    Path(first.pbin[0].path).unlink()
    state, states = _run(config, work)
    assert states == {"render": ["Cached"], "spans": ["Cached"], "pbin": ["Completed"], "index": ["Cached"]}, states
    assert Path(first.pbin[0].path).is_file()

    # Editing the template reruns render and everything after it.
    cue = "'<|im_start|>' + message['role']"
    template.write_text(builtin_chatml_template().replace(cue, cue + " + ' '"))
    state, states = _run(config, work)
    assert all(s == ["Completed"] for s in states.values()), states
    assert state.result().rendered[0].sha256 != first.rendered[0].sha256


def test_corrupted_output_is_recomputed_not_trusted(demo, tmp_path):
    config = DataConfig(sources=[str(demo["data"])], tokenizer=str(demo["tokenizer"]), render={"template": "chatml"})
    work = tmp_path / "work"
    first = run_data(config, str(work))
    rendered = Path(first.rendered[0].path)
    rendered.write_text(rendered.read_text().replace("assistant", "assistent"))
    state, states = _run(config, work)
    assert states["render"] == ["Completed"]
    assert Path(first.rendered[0].path).read_text() == Path(state.result().rendered[0].path).read_text()
    assert "assistent" not in rendered.read_text()


def test_transient_io_error_is_retried(demo, tmp_path, monkeypatch):
    from sftflow.tasks.data import stage as data_stages

    marker = tmp_path / "fault-fired"
    tokenize = data_stages.tokenize_rendered_shard

    def fails_once(*args, **kwargs):
        if not marker.exists():
            marker.write_text("fired")
            raise OSError("injected transient I/O error in spans")
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(data_stages, "tokenize_rendered_shard", fails_once)
    config = DataConfig(sources=[str(demo["data"])], tokenizer=str(demo["tokenizer"]), render={"template": "chatml"})
    state = sft_data(config=SFTConfig(work_dir=str(tmp_path / "work"), data=config), return_state=True)
    assert state.is_completed()
    assert marker.is_file()  # the fault did fire
    assert run_counts(state)["spans"] == [2]


def test_bad_input_fails_once_with_a_located_message(tmp_path, demo):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    bad.write_text(good + "\n" + json.dumps({"messages": [{"role": "assitant", "content": "x"}]}) + "\n")
    config = DataConfig(sources=[str(bad)], tokenizer=str(demo["tokenizer"]), render={"template": "chatml"})
    state = sft_data(config=SFTConfig(work_dir=str(tmp_path / "work"), data=config), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*role"):
        state.result()
    assert run_counts(state)["render"] == [1]  # a ValueError is not retried


def test_rejects_are_counted_instead_of_failing(tmp_path, demo):
    bad = tmp_path / "mixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": 3}]},
        "not json",
    ]
    bad.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    config = DataConfig(
        sources=[str(bad)],
        tokenizer=str(demo["tokenizer"]),
        render={"template": "chatml", "on_bad_record": "reject"},
        index={"eval_fraction": 0.0},
    )
    result = run_data(config, str(tmp_path / "work"))
    assert result.rendered[0].num_records == 1
    assert result.rendered[0].num_rejected == 2
    rejects = [json.loads(line) for line in Path(result.rendered[0].rejects_path).read_text().splitlines()]
    assert sorted(r["source"].rsplit(":", 1)[1] for r in rejects) == ["2", "3"]
    assert result.index.num_train == 1


def test_a_record_with_nothing_trained_is_found_by_its_line(tmp_path, demo):
    """A conversation with no assistant turn renders, but none of its tokens is trained: under `on_bad_record:
    error` it stops the stage with its file:line, under `reject` it is counted and listed by file:line."""
    source = tmp_path / "untrained.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [good, {"messages": [{"role": "user", "content": "only a question"}]}, good]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(sources=[str(source)], tokenizer=str(demo["tokenizer"]), render={"template": "chatml"})
    with pytest.raises(ValueError, match=rf"^{source}:2: no token of this record is trained"):
        run_data(config, str(tmp_path / "work-error"))
    config = config.model_copy(update={"render": config.render.model_copy(update={"on_bad_record": "reject"})})
    result = run_data(config, str(tmp_path / "work-reject"))
    assert result.summary()["records_rejected_spans"] == 1
    (listing,) = result.spans_rejects()
    assert listing in result.summary()["rejects"]
    rejected = [json.loads(line) for line in Path(listing).read_text().splitlines()]
    assert rejected == [{"source": f"{source}:2", "reason": "no_trained_tokens"}]


def test_cli_data_and_inspect(tmp_path, demo):
    from typer.testing import CliRunner

    from sftflow.flows.cli import app

    runner = CliRunner()
    out = tmp_path / "out"
    args = ["data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"]), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "data.json").is_file()
    # The demo tokenizer is a byte-level BPE, so spans ran on tiktoken (checked against HF).
    assert {t["tokenizer_backend"] for t in json.loads((out / "data.json").read_text())["tokenized"]} == {"tiktoken"}
    listing = runner.invoke(app, ["inspect", str(out), "--format", "jsonl"])
    assert listing.exit_code == 0
    first = json.loads(listing.output.splitlines()[0])
    assert set(first) == {"source", "input_ids", "loss_mask"} and 1 in first["loss_mask"]
    shutil.rmtree(out)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}\n')
    args = ["data", "--source", str(bad), "--tokenizer", str(demo["tokenizer"]), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "bad.jsonl:1" in result.output and "Traceback" not in result.output

    result = runner.invoke(app, [*args, "--tokenizer-backend", "rust"])
    assert result.exit_code == 2 and "spans.tokenizer_backend" in result.output


def test_a_user_error_is_one_line_on_the_terminal_and_a_traceback_in_the_work_log(tmp_path, demo):
    """As a user runs it: the console script, Prefect's own logging to the terminal, a record with a typo."""
    from tests.flows.conftest import run_cli

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assitant", "content": "x"}]}))
    out = tmp_path / "out"
    result = run_cli("data", "--source", str(bad), "--tokenizer", str(demo["tokenizer"]), "--out", str(out))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {bad}:1: messages[1].role is 'assitant'; expected one of system/user/assistant/tool "
        f"(details: {out / 'sftflow.log'})"
    ]
    log = (out / "sftflow.log").read_text()
    assert "Traceback" in log and "RecordError" in log
