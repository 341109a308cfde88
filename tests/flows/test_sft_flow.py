"""The whole `sft` pipeline on Prefect's real engine with a real torchrun worker: caching across runs, what a config
change reruns, and resuming a failed training run from its checkpoint without redoing data or plan.

The base model is a local Hugging Face folder (a tiny Qwen3 with the family's real structure), as users bring one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftflow.flows.config import SFTConfig
from sftflow.flows.sft import sft
from tests.flows.conftest import RecordedTaskRuns

pytestmark = pytest.mark.slow

DEMO_RECORDS = 160


def _config(work_dir: Path, **train) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work_dir),
            "demo": {"records": DEMO_RECORDS, "bench": True},
            "plan": {"tokens_per_rank": 512, "epochs": 1},
            "train": {
                "model": str(work_dir / "base-model"),
                "optimizer": {"lr": 1e-3},
                "max_steps": 6,
                "checkpoint": {"every": 2},
                "num_threads": 1,
                **train,
            },
            "eval": {"max_docs": 8, "max_generations": 2, "num_examples": 1},
        }
    )


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from transformers import AutoTokenizer

    from sftflow.tasks.demo import write_demo
    from tests.tasks.family_configs import save_family_model

    work = tmp_path_factory.mktemp("sft")
    # The demo's data and tokenizer, as the flow writes them (it reuses what is there), and a base model over its
    # vocabulary.
    demo = write_demo(work / "demo", n=DEMO_RECORDS, seed=0)
    save_family_model("qwen3", len(AutoTokenizer.from_pretrained(demo["tokenizer"])), work / "base-model")
    with RecordedTaskRuns() as runs:
        state = sft(config=_config(work), promote=True, return_state=True)
    return work, state, runs.states()


def test_first_run_completes_every_stage(first_run):
    _, state, states = first_run
    assert state.is_completed()
    assert {k: set(v) for k, v in states.items()} == {
        "render": {"Completed"},
        "spans": {"Completed"},
        "pbin": {"Completed"},
        "index": {"Completed"},
        "plan": {"Completed"},
        "train": {"Completed"},
        "evaluate": {"Completed"},
        "bench": {"Completed"},
        "promote": {"Completed"},
    }
    result = state.result()
    assert result.train.steps == 6
    # The gate ran last: an empty registry takes the first model as its champion.
    assert result.promotion.decision == "promoted" and result.promotion.champion == "v0001"
    assert Path(result.train.hf_dir, "config.json").is_file()
    # The run's template line says how the data stage chose the template (the demo names chatml).
    resolved = json.loads(Path(result.train.run_dir, "run.json").read_text())["resolved"]
    assert resolved["template"]["value"] == "chatml"
    assert resolved["template"]["reason"] == "named in data.render.template"
    # The export renders conversations as the training data was rendered: the template travels with it.
    from transformers import AutoTokenizer

    from sftflow.tasks.data.chat_template import builtin_template_text

    exported = AutoTokenizer.from_pretrained(result.train.hf_dir)
    assert exported.chat_template == builtin_template_text("chatml")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert (
        exported.apply_chat_template(chat, tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    assert set(result.eval.metrics) == {"base", "tuned"}
    assert Path(result.eval.plot_path).is_file()


def test_second_run_is_cached_end_to_end(first_run):
    work, first, _ = first_run
    with RecordedTaskRuns() as runs:
        state = sft(config=_config(work), return_state=True)
    assert state.is_completed()
    states = runs.states()
    assert all(set(v) == {"Cached"} for v in states.values()), states
    assert state.result() == first.result().model_copy(update={"promotion": None})  # this run has no gate


def test_learning_rate_change_reruns_only_train_and_eval_and_a_failed_run_resumes(first_run, caplog, inject_crash):
    """A new learning rate (the flow's flat parameter) reruns training and evaluation only. Its first attempt crashes
    without retries; a fresh run of the flow, given the same learning rate as an override (`overrides`, the general
    form of the shorthand), resumes that training run from its checkpoint without redoing data or plan: the two
    forms make one config."""
    work, first, _ = first_run
    config = _config(work).model_copy(update={"train_retries": 0})
    inject_crash("crash_after_step=3")
    with RecordedTaskRuns() as runs:
        failed = sft(config=config, learning_rate=5e-4, return_state=True)
    inject_crash(None)
    assert failed.is_failed()
    states = runs.states()
    for stage in ("render", "spans", "pbin", "index", "plan"):
        assert states[stage] == ["Cached"], (stage, states)
    assert states["train"] == ["Failed"]
    assert "evaluate" not in states

    caplog.clear()
    with RecordedTaskRuns() as runs:
        state = sft(config=config, overrides={"train.optimizer.lr": 5e-4}, return_state=True)
    assert state.is_completed()
    states = runs.states()
    for stage in ("render", "spans", "pbin", "index", "plan"):
        assert states[stage] == ["Cached"], (stage, states)
    assert states["train"] == ["Completed"] and states["evaluate"] == ["Completed"]
    run_dir = Path(state.result().train.run_dir)
    assert run_dir != Path(first.result().train.run_dir)
    assert (run_dir / "fault-fired").is_file()  # the crash happened in this run folder
    # The crash came after step 3; the latest checkpoint was step 2, so the fresh run resumed there, not from scratch.
    assert any("resumed all components from" in r.getMessage() and "step-2" in r.getMessage() for r in caplog.records)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # the crashed attempt's step-3 line was replaced, not duplicated


def test_force_recomputes_the_named_stage_only(first_run):
    work, first, _ = first_run
    with RecordedTaskRuns() as runs:
        state = sft(config=_config(work), force=["plan"], return_state=True)
    assert state.is_completed()
    states = runs.states()
    assert states["plan"] == ["Completed"]
    # The recomputed plan is byte-identical, so nothing after it has new inputs.
    for stage in ("render", "spans", "pbin", "index", "train", "evaluate", "bench"):
        assert states[stage] == ["Cached"], (stage, states)
    assert state.result().plan == first.result().plan

    with pytest.raises(ValueError, match="unknown stage"):
        sft(config=_config(work), force=["planning"])


def test_the_parent_run_carries_the_summary(first_run):
    """A deployment's run page opens on the parent `sft` run: its summary artifact holds the eval table and the
    loss curve inline."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    _, state, _ = first_run
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sft-summary"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])),
        )
    assert len(artifacts) == 1
    summary = artifacts[0].data
    assert "| tuned |" in summary and "| base |" in summary
    assert "![loss curve](data:image/png;base64," in summary
    assert "Promotion: **promoted**, champion `v0001`" in summary
    # The demo's benchmark tasks ran as a stage of the pipeline: their table is in the summary too.
    assert "| arithmetic | exact_match | 24 |" in summary and "| capitals | accuracy | 12 |" in summary


def test_training_progress_reaches_prefect_at_a_bounded_rate(first_run):
    """The train task's log and the parent's copy hold the first and the last step and at most one line each 30 s
    between, not one line a step (`progress_log.ThrottledProgress`; its rate is tested on a fake clock)."""
    import re
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    from sftflow.tasks.train.metrics import read_metrics

    _, state, _ = first_run
    parent_id = state.state_details.flow_run_id
    records = read_metrics(Path(state.result().train.run_dir) / "metrics.jsonl")
    # Six steps take a few seconds: two lines. A machine slow enough to take 30 s or more may log one more a 30 s.
    most = 3 + int(sum(r["step_time_s"] for r in records) // 30)
    APILogHandler().flush()
    step_line = re.compile(r"^(?:\[train\]|sft-train) step (\d+)/6 loss ")

    def steps(flow_run_id) -> list[int]:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return sorted(int(m.group(1)) for m in (step_line.match(log.message) for log in logs) if m)

    def bounded(found: list[int]) -> bool:
        return found[:1] == [1] and found[-1:] == [6] and len(found) <= most

    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 15  # logs reach the API in batches
        while not bounded(steps(parent_id)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert bounded(steps(parent_id)), steps(parent_id)
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))
        )
        [task_steps] = [steps(run.id) for run in children if steps(run.id)]  # the sft-train run's train task
        assert bounded(task_steps), task_steps
