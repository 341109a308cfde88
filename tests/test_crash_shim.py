"""The crash hook (`tests/crash_shim`): a run that ends before its crash step finishes as without it; the hook has a
loop that queues steps ahead finish step N before it saves and crashes; such a run, killed and resumed, logs what a
launch never killed does."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.launch import TrainingFailed, train
from tests.tasks.train_helpers import losses, metrics, planned_mock, run


def test_a_run_that_ends_before_the_crash_step_finishes(tmp_path, tiny_tokenizer, tiny_tokenizer_dir, inject_crash):
    config, _, arrays = planned_mock(
        tmp_path, len(tiny_tokenizer), tiny_tokenizer_dir, PlanConfig(num_ranks=1, tokens_per_rank=128)
    )
    inject_crash("crash_after_step=99")
    result = run(config, tmp_path / "run", max_steps=3, checkpoint=dict(every=2))
    assert result.steps == 3
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert not (tmp_path / "run" / "fault-fired").exists()


def _shim(monkeypatch, run_dir, spec: str):
    """The hook installed on a stand-in checkpoint module, as a worker of rank 0 of 2 would install it."""
    monkeypatch.delenv("SFTFLOW_TEST_CRASH", raising=False)  # loaded inert; the spec is given below
    path = Path(__file__).parent / "crash_shim" / "sitecustomize.py"
    loaded = importlib.util.spec_from_file_location("crash_shim_under_test", path)
    shim = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(shim)
    monkeypatch.setattr(shim, "_SPEC", spec)
    monkeypatch.setattr(sys, "argv", [str(Path("sftflow", "tasks", "train", "worker.py")), str(run_dir)])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    class Progress:
        step = 0

    class Checkpointer:
        def __init__(self):
            self.states, self.saved = {"progress": Progress()}, []

        def due(self, step: int, last: bool = False) -> bool:
            return step % 2 == 0

        def will_save(self, step: int) -> bool:
            return step % 2 == 0

        def save(self, step: int) -> None:
            self.saved.append((step, self.states["progress"].step))

    module = type(sys)("checkpoint_stand_in")
    module.Checkpointer = Checkpointer
    shim._install(module)
    return module.Checkpointer()


@pytest.mark.parametrize("crash_step", [3, 4])  # a step without a checkpoint of its own, and one with
def test_the_hook_finishes_step_n_before_it_saves_and_crashes(tmp_path, monkeypatch, crash_step):
    # rank 1 of 2 is the one that would kill itself: this process, rank 0, only saves
    checkpointer = _shim(monkeypatch, tmp_path, f"crash_after_step={crash_step},rank=1")
    # steps queued ahead: asked before step N's totals are read; the hook has the loop finish step N first
    assert checkpointer.will_save(crash_step) is True and checkpointer.saved == []
    assert checkpointer.will_save(crash_step + 2) is (crash_step % 2 == 0)  # other steps: the checkpointer's own
    assert checkpointer.due(crash_step + 2) is (crash_step % 2 == 0)
    checkpointer.states["progress"].step = crash_step  # the loop asks `due` once step N's totals are in
    assert checkpointer.due(crash_step) is False  # saved here by the hook where due, never again by the loop
    assert checkpointer.saved == ([(4, 4)] if crash_step == 4 else [])


@pytest.mark.parametrize("crash_step", [3, 4])  # after a step without a checkpoint of its own, and one with
def test_steps_queued_ahead_kill_and_resume_bit_exactly(
    tmp_path, tiny_tokenizer, tiny_tokenizer_dir, inject_crash, monkeypatch, caplog, crash_step
):
    """The GPU's loop (step s + 1 queued before step s's totals are read) on the CPU, killed right after step 3 (the
    last checkpoint is step 2's) or right after the checkpoint of step 4, and resumed: every step as a launch never
    killed logs it."""
    monkeypatch.setenv("SFTFLOW_QUEUE_STEPS", "1")
    config, _, _ = planned_mock(
        tmp_path, len(tiny_tokenizer), tiny_tokenizer_dir, PlanConfig(num_ranks=1, tokens_per_rank=128),
        max_steps=6, checkpoint=dict(every=2),
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        run(config, tmp_path / "reference", max_steps=6, checkpoint=dict(every=2))
    assert "steps queued ahead: on (set by SFTFLOW_QUEUE_STEPS=1)" in caplog.text
    crashed = config.model_copy(update={"out": str(tmp_path / "crashed")})
    inject_crash(f"crash_after_step={crash_step}")
    with pytest.raises(TrainingFailed):
        train(crashed)
    inject_crash(None)
    assert (tmp_path / "crashed" / "fault-fired").is_file()
    assert train(crashed, resume=True).steps == 6
    got, want = metrics(tmp_path / "crashed"), metrics(tmp_path / "reference")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path / "crashed") == losses(tmp_path / "reference")
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
