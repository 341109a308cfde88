"""The edges where runs used to lose data or trust what they should not: checkpoint pruning after a kill mid-save, a
metrics line cut short, two writers on one folder, changed inputs, damaged checkpoints, temporary files after a
failed write. Each test reproduces the failure as it was met, on real torchrun runs where training is involved."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sftflow.tasks.core.atomic import atomic_writer, write_atomic
from sftflow.tasks.core.caching import outputs_valid, retry_on_io_error, write_checksums
from sftflow.tasks.data.index import build_index
from sftflow.tasks.data.pbin import write_pbin
from sftflow.tasks.data.reader import IndexedDataset
from sftflow.tasks.data.records import TokenizedDoc
from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
from sftflow.tasks.train.checkpoint import prune_checkpoints
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.launch import train
from sftflow.tasks.train.mock import write_mock_index
from tests.tasks.train_helpers import losses, mock_config, planned_mock, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("reliability")
    config, _, _ = planned_mock(
        root,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=1, tokens_per_rank=64, micro_batches_per_step=1, epochs=2, seed=0),
        checkpoint=dict(every=4, keep_last=1),
        schedule=dict(warmup_steps=2),
    )
    return root, config


@pytest.fixture(scope="module")
def three_steps(base) -> Path:
    """A run stopped by `max_steps` at step 3, off the checkpoint grid of 4 (its last step is saved anyway). The tests
    that resume or damage it work on copies, so that one launch serves them all."""
    root, config = base
    out = root / "three-steps"
    run(config, out, max_steps=3)
    return out


def _complete(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / ".metadata").is_file())


def test_a_kill_during_a_save_does_not_make_pruning_delete_the_checkpoint_latest_names(base):
    """keep_last 1, checkpoints every 4 steps: a kill while step-12 was being written left a partial step-12; resuming
    from step-8 with max_steps 10 saves step-10, and the partial folder above it must not push it out."""
    root, config = base
    out = root / "killed-mid-save"
    run(config, out, max_steps=8)
    checkpoints = out / "checkpoints"
    assert _complete(checkpoints) == ["step-8"]
    partial = checkpoints / "step-12"  # what a SIGKILL during dcp.save leaves: shard files, no .metadata
    partial.mkdir()
    for file in (checkpoints / "step-8").glob("*.distcp"):
        shutil.copy(file, partial / file.name)

    run(config, out, max_steps=10, checkpoint=dict(resume=True))
    assert (checkpoints / "latest").read_text().strip() == "step-10"
    assert _complete(checkpoints) == ["step-10"]
    assert partial.is_dir()  # above the step just saved: left for the save of step 12 to replace
    run(
        config, out, max_steps=12, checkpoint=dict(resume=True)
    )  # the resume that used to fail: latest named a deleted step-10
    assert (checkpoints / "latest").read_text().strip() == "step-12"
    assert _complete(checkpoints) == ["step-12"]


def test_pruning_keeps_the_newest_complete_checkpoints_up_to_the_step_saved(tmp_path):
    for step, complete in ((2, True), (4, False), (6, True), (8, True), (12, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    assert prune_checkpoints(tmp_path, keep_last=2, current=8) == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-12", "step-6", "step-8"]


def test_a_metrics_line_cut_short_does_not_block_the_resume(base, three_steps):
    root, config = base
    out = root / "cut-metrics"
    shutil.copytree(three_steps, out)
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # the disk filled up mid-line
    run(config, out, max_steps=6, checkpoint=dict(resume=True))
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert None not in losses(out)


HOLD = """
import sys, time
from sftflow.tasks.core.locks import exclusive
with exclusive(sys.argv[1], "test"):
    print("held", flush=True)
    time.sleep(120)
"""


def _hold(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_trainer_on_a_held_run_folder_is_refused_naming_the_holder(base):
    root, config = base
    out = root / "held"
    holder = _hold(out / ".lock-node0")
    try:
        with pytest.raises(ValueError, match=rf"training run {out} is in use by PID {holder.pid} on \S+"):
            run(config, out, max_steps=1)
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up: its lock is gone with it, and the next run takes the folder.
    assert json.loads((out / ".lock-node0").read_text())["pid"] == holder.pid
    run(config, out, max_steps=1)
    assert json.loads((out / ".lock-node0").read_text())["pid"] == os.getpid()


WRITER = """
import sys, time
from sftflow.tasks.core.locks import hold_as_writer
hold_as_writer(sys.argv[1])
print("writing", flush=True)
time.sleep(120)
"""

LAUNCH = """
import json, sys
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.launch import train
train(TrainConfig.model_validate(json.loads(sys.argv[1])))
"""


def test_a_launch_is_refused_while_a_worker_of_an_earlier_launch_lives(base):
    """A process holding the run's writers lock (what every worker does for its life) keeps any new launch out, with
    its PID in the one line; once it is gone the run starts."""
    root, config = base
    out = root / "old-writer"
    out.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out / ".writers-node0")], stdout=subprocess.PIPE)
    assert writer.stdout.readline().strip() == b"writing"
    try:
        with pytest.raises(ValueError, match=rf"earlier launch still run \(PID {writer.pid}\)"):
            run(config, out, max_steps=1)
    finally:
        writer.kill()
        writer.wait()
    run(config, out, max_steps=1)
    assert losses(out) and len(losses(out)) == 1


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):  # ended while being read
                continue
    found = [child for child, parent in parents.items() if parent == pid]
    for child in found:  # grows while walked
        found += [grandchild for grandchild, parent in parents.items() if parent == child]
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_die_with_a_launcher_killed_outright_and_the_resume_is_the_only_writer(tmp_path, tiny_tokenizer,
                                                                                       tiny_tokenizer_dir):  # fmt: skip
    """The launcher SIGKILLed while its worker is stopped (`kill -STOP`): torchrun and the worker die with it, so the
    `--resume` that follows is the run's one writer and its metrics hold every step once, in order."""
    import signal
    import time

    config, _, _ = planned_mock(
        tmp_path,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=1, tokens_per_rank=64, micro_batches_per_step=1, epochs=30, seed=0),
        checkpoint=dict(every=3, keep_last=1),
        schedule=dict(warmup_steps=2),
    )
    out = tmp_path / "run"
    settings = {**config.model_dump(mode="json"), "out": str(out), "max_steps": 40}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH, json.dumps(settings)])
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert launcher.poll() is None and time.monotonic() < deadline, "the first run ended before 4 steps"
        time.sleep(0.05)
    processes = _descendants(launcher.pid)  # torchrun and its worker
    assert len(processes) >= 2
    worker = processes[-1]
    os.kill(worker, signal.SIGSTOP)
    launcher.kill()
    launcher.wait()
    try:
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in processes):  # killed (a zombie until reaped), stopped worker included
            assert time.monotonic() < deadline, [pid for pid in processes if _alive(pid)]
            time.sleep(0.1)
    finally:  # whatever the outcome, leave no stopped worker behind
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    run(config.model_copy(update={"out": str(out)}), out, max_steps=40, checkpoint=dict(resume=True))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 41))


def test_a_second_sftflow_command_on_a_held_work_dir_is_one_line_naming_the_holder(tmp_path):
    from sftflow.tasks.demo import write_demo

    demo = write_demo(tmp_path / "demo", n=3)
    out = tmp_path / "out"
    holder = _hold(out / ".sftflow.lock")
    try:
        exe = Path(sys.executable).with_name("sftflow")
        args = [str(exe), "data", "--source", str(demo["data"]), "--tokenizer", str(demo["tokenizer"])]
        # No Prefect API is reached: the flow refuses before its first task. PREFECT_API_URL points nowhere usable so
        # that no local server is started for this.
        env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api")
        result = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0
    assert f"in use by PID {holder.pid}" in result.stderr + result.stdout


def _index(root: Path) -> Path:
    rng = np.random.default_rng(0)
    docs = [
        TokenizedDoc(rng.integers(5, 300, n), np.array([[1, n]], dtype=np.int32), f"d.jsonl:{i + 1}")
        for i, n in enumerate(rng.integers(4, 40, 60))
    ]
    write_pbin(root / "a.pbin", docs, 400, {})
    build_index([root / "a.pbin"], root / "index", eval_fraction=0.0)
    return root / "index"


def _data_run(root: Path, tokenizer_dir: Path) -> TrainConfig:
    index = _index(root)
    dataset = IndexedDataset(index)
    arrays, _ = plan(dataset.lengths, dataset.trainable_target_counts(), PlanConfig(num_ranks=1, tokens_per_rank=128))
    save_plan(arrays, root / "plan.npz")
    return TrainConfig(
        data=str(index), plan=str(root / "plan.npz"), model="tiny-llama", tokenizer=str(tokenizer_dir),
        out=str(root / "run"), max_steps=1, num_threads=1, export=False,
    )  # fmt: skip


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["pbin_token", "train_ids", "plan"])
def test_a_changed_input_is_refused_before_training_with_its_path(damage, tmp_path, tiny_tokenizer_dir):
    config = _data_run(tmp_path, tiny_tokenizer_dir)
    if damage == "pbin_token":
        target = tmp_path / "a.pbin"
        _flip(target, target.stat().st_size // 3)  # inside the tokens section
        message = "the shard changed since the dataset index"
    elif damage == "train_ids":
        target = tmp_path / "index" / "train_ids.npy"
        _flip(target, target.stat().st_size - 3)
        message = "index array 'train_ids' changed"
    else:
        target = tmp_path / "plan.npz"
        _flip(target, target.stat().st_size // 2)
        message = "not a readable plan"
    with pytest.raises(ValueError, match=message) as err:
        train(config)
    assert str(target) in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_damaged_checkpoint_is_refused_before_it_is_loaded(base, three_steps):
    root, config = base
    out = root / "damaged"
    shutil.copytree(three_steps, out)
    step = out / "checkpoints" / "step-3"
    assert (step / "CHECKSUMS").is_file()
    shard = next(step.glob("*.distcp"))
    _flip(shard, shard.stat().st_size // 2)
    damaged = rf"checkpoint {step} is damaged: {shard} does not match its sha256.*no earlier checkpoint is kept"
    with pytest.raises(ValueError, match=damaged):  # keep_last 1: nothing earlier to go back to
        run(config, out, max_steps=6, checkpoint=dict(resume=True))
    _flip(shard, shard.stat().st_size // 2)  # repaired: the same bytes as written
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes() + b"\x00")  # a crafted pickle is refused too
    with pytest.raises(ValueError, match=r"\.metadata does not match its sha256"):
        run(config, out, max_steps=6, checkpoint=dict(resume=True, init_from=None))


class _Planted:
    """A pickle that creates a file when it is loaded: what a crafted `.metadata` could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_without_its_checksums_is_refused_unless_trusted(base, three_steps, tmp_path):
    """Deleting `CHECKSUMS` is no way past the check: a crafted `.metadata` in a checkpoint without a listing is
    refused before anything unpickles it, for `--resume` and `--init-from` alike; `train.checkpoint.trust` loads an
    unlisted checkpoint the user vouches for. A file the listing does not name is refused too."""
    import pickle

    root, config = base
    out = root / "unlisted"
    shutil.copytree(three_steps, out)
    step = out / "checkpoints" / "step-3"
    (step / "CHECKSUMS").unlink()
    with pytest.raises(ValueError, match=rf"checkpoint {step} has no CHECKSUMS.*train.checkpoint.trust: true"):
        run(config, out, max_steps=6, checkpoint=dict(resume=True))
    trusted = run(config, out, max_steps=6, checkpoint=dict(resume=True, trust=True))
    assert trusted.steps == 6

    crafted = root / "crafted"
    shutil.copytree(three_steps, crafted)
    step = crafted / "checkpoints" / "step-3"
    marker = tmp_path / "code-ran"
    (step / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    (step / "CHECKSUMS").unlink()
    with pytest.raises(ValueError, match="has no CHECKSUMS"):
        run(config, root / "from-crafted", max_steps=1, checkpoint=dict(init_from=str(step)))
    assert not marker.exists()

    extra = root / "extra-file"
    shutil.copytree(three_steps, extra)
    step = extra / "checkpoints" / "step-3"
    (step / "__0_1.distcp").write_bytes(b"not written by the save")
    with pytest.raises(ValueError, match=r"__0_1.distcp is not in .*CHECKSUMS"):
        run(config, extra, max_steps=6, checkpoint=dict(resume=True))


def test_a_failed_write_leaves_no_temporary_file_and_a_full_disk_is_not_retried(tmp_path, monkeypatch):
    target = tmp_path / "out" / "rendered.jsonl"

    class DiskFull(Exception):
        pass

    with pytest.raises(DiskFull):
        with atomic_writer(target, "w", encoding="utf-8") as f:
            f.write("x" * 1000)
            raise DiskFull
    assert list((tmp_path / "out").iterdir()) == []

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        write_atomic(target, "y" * 1000)
    monkeypatch.undo()
    assert list((tmp_path / "out").iterdir()) == []

    class State:
        def __init__(self, error):
            self.error = error

        def result(self):
            raise self.error

    assert retry_on_io_error(None, None, State(OSError(errno.ENOSPC, "full"))) is False
    assert retry_on_io_error(None, None, State(OSError(errno.EIO, "flaky"))) is True

    # A crashed writer's temporary file is never listed as part of an output.
    (tmp_path / "out" / "a.txt").write_text("a")
    (tmp_path / "out" / ".b.txt.123.abc.tmp").write_text("half")
    write_checksums(tmp_path / "out")
    assert ".tmp" not in (tmp_path / "out" / "CHECKSUMS").read_text()
    assert outputs_valid(tmp_path / "out")


def test_max_steps_stops_early_without_bending_the_learning_rate_curve(base, three_steps):
    """The schedule spans the plan: stopping at step 3 and resuming to step 6 gives the learning rates (and losses)
    of one run to step 6, and both follow the curve of the whole plan (it used to be squeezed into max_steps)."""
    from tests.tasks.train_helpers import metrics

    root, config = base
    straight, split = root / "lr-straight", root / "lr-split"
    run(config, straight, max_steps=6)
    shutil.copytree(three_steps, split)
    run(config, split, max_steps=6, checkpoint=dict(resume=True))
    lrs = [m["lr"] for m in metrics(straight)]
    assert [m["lr"] for m in metrics(split)] == lrs
    assert losses(split) == losses(straight)
    from sftflow.tasks.train.config import schedule_config
    from sftflow.tasks.train.data import load_plan
    from sftflow.tasks.train.worker import lr_factor

    steps = load_plan(config.plan).num_steps
    assert steps > 12
    curve = schedule_config(config, steps)
    assert lrs == pytest.approx([config.optimizer.lr * lr_factor(s, curve) for s in range(6)], rel=1e-12)


def test_bad_input_found_inside_a_worker_is_one_located_error_not_a_traceback(base):
    """Data that does not match its plan is found by the workers at the first step; the launcher reports the
    worker's one line as a `ValueError` (the CLI's exit 2, no Prefect retry) instead of torchrun's traceback."""
    root, config = base
    vocab_size = IndexedDataset(config.data).vocab_size
    other_data = write_mock_index(mock_config(vocab_size, seed=5), root / "other-data")
    with pytest.raises(ValueError, match=r"plan.npz: step 0 plans \d+ trained tokens but its batches hold \d+"):
        run(config, root / "mismatch", max_steps=2, data=str(other_data))


def test_a_model_that_does_not_fit_is_one_report_and_not_retried(base):
    """A run whose model cannot be allocated (a hidden size of 2**27: the embedding alone asks ~150 GiB of host
    memory, refused at once) ends with the worker's report, where it ran out and what would leave room, raised as
    a `ValueError`, which the train stage does not retry: the same settings would run out again."""
    from prefect.states import Failed

    from sftflow.tasks.core.caching import retry_unless_bad_input

    root, config = base
    report = r"^out of host memory on rank 0 while building the model: you tried to allocate"
    with pytest.raises(ValueError, match=report) as err:
        run(config, root / "too-big", max_steps=1, model_overrides={"hidden_size": 2**27})
    assert "train.lora" in str(err.value)
    state = Failed(data=err.value)
    assert retry_unless_bad_input(None, None, state) is False


def test_steps_queued_ahead_train_log_and_save_what_steps_run_one_by_one(base, monkeypatch, caplog):
    """On a GPU the worker queues step s + 1 before it reads step s's totals (a CPU computes as it queues, so it
    runs them one by one). Forced on here (`SFTFLOW_QUEUE_STEPS=1`): every metric but the wall time and every tensor
    of both checkpoints (steps 4 and 6) equal a launch's that runs its steps one by one."""
    import logging

    import torch

    from tests.tasks.train_helpers import metrics, read_dcp

    root, config = base
    ref, ahead = root / "one-by-one", root / "queued-ahead"
    run(config, ref, max_steps=6, checkpoint=dict(keep_last=2))
    monkeypatch.setenv("SFTFLOW_QUEUE_STEPS", "1")
    with caplog.at_level(logging.INFO):
        run(config, ahead, max_steps=6, checkpoint=dict(keep_last=2))
    assert "steps queued ahead: on (set by SFTFLOW_QUEUE_STEPS=1)" in caplog.text
    kept = ("step", "epoch", "loss", "grad_norm", "lr", "trained_tokens", "tokens", "skipped")  # all but times
    assert [[m[k] for k in kept] for m in metrics(ahead)] == [[m[k] for k in kept] for m in metrics(ref)]
    assert _complete(ahead / "checkpoints") == _complete(ref / "checkpoints") == ["step-4", "step-6"]
    for step in ("step-4", "step-6"):
        saved, expected = read_dcp(ahead / "checkpoints" / step), read_dcp(ref / "checkpoints" / step)
        assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected), step
