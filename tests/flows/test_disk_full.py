"""A full disk ends a command with one line naming the file, what was being written and what a rerun does (exit 2),
on a real small filesystem: a tmpfs mounted in a user and mount namespace of its own (`unshare -Urm`), skipped
where this machine does not allow one. The log file turns itself off at its first failed write."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sftflow.flows.console import log_file, logged_to


def test_the_log_file_turns_itself_off_at_its_first_failed_write(tmp_path, capfd):
    """`/dev/full` fails every write with ENOSPC, as a full disk does: one line says the log stopped, instead of a
    `--- Logging error ---` block (with its traceback) for every record after."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    work = tmp_path / "work"
    work.mkdir()
    (work / "sftflow.log").symlink_to("/dev/full")
    logger = logging.getLogger("sftflow.test-full-log")
    with logged_to(work) as path:
        for i in range(50):
            logger.warning("record %d", i)
        assert log_file() is None  # the error line no longer points at a log that stopped
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count(f"stopped writing {path}") == 1
    assert "No space left on device" in err


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=60
    )
    return probe.returncode == 0


def small_filesystem(test):
    """Runs `test` (slow: whole commands) where a tmpfs can be mounted, else skips it."""
    allowed = sys.platform.startswith("linux") and _can_mount_tmpfs()
    reason = "mounting a tmpfs in a user namespace (unshare -Urm) is not allowed here"
    return pytest.mark.slow(pytest.mark.skipif(not allowed, reason=reason)(test))


def in_small_filesystem(mount: Path, size: str, script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the shell `script` with a tmpfs of `size` mounted on `mount`, seen by the script's processes only.
    `$SFTFLOW` is the console script; the Prefect API is the test harness's."""
    from prefect.settings import PREFECT_API_URL

    mount.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        SFTFLOW=str(Path(sys.executable).with_name("sftflow")),
    )
    wrapped = f'mount -t tmpfs -o size={size} tmpfs "$0" || exit 99\n{script}'
    result = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", wrapped, str(mount)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode != 99, result.stderr
    return result


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@small_filesystem
def test_a_full_disk_in_training_is_one_line_and_the_rerun_resumes_from_the_step_it_names(tmp_path):
    """Checkpoints every 3 steps, keep_last 1, on 2 MiB: step-3 fits, step-6 beside it does not. The command ends
    with the one line the user needs, exit 2; once there is room (the tmpfs grown), `--resume` continues from the
    checkpoint the line named and the run has every step once."""
    from sftflow.tasks.plan.planner import PlanConfig
    from sftflow.tasks.tiny import train_tokenizer
    from tests.conftest import TINY_CORPUS
    from tests.tasks.train_helpers import planned_mock

    train_tokenizer(TINY_CORPUS * 20, tmp_path / "tokenizer", vocab_size=400)
    config, _, _ = planned_mock(
        tmp_path, 400, tmp_path / "tokenizer",
        PlanConfig(num_ranks=1, tokens_per_rank=64, micro_batches_per_step=1, epochs=2, seed=0),
    )  # fmt: skip
    mount, kept = tmp_path / "small", tmp_path / "kept"
    run = mount / "run"
    command = (
        f'"$SFTFLOW" train --data {config.data} --plan {config.plan} --out {run} --model tiny-llama --max-steps 9 '
        "--checkpoint-every 3 --set train.checkpoint.keep_last=1 --set train.num_threads=1 --set train.export=false "
        f"--set train.device=cpu --set work_dir={mount}"
    )
    script = f"""
{command}
echo "first=$?" >&2
cp -r {run} {kept}
mount -o remount,size=16m "$0"
{command} --resume
echo "second=$?" >&2
cp {run}/metrics.jsonl {kept}/resumed-metrics.jsonl
"""
    result = in_small_filesystem(mount, "2m", script)
    assert "first=2" in result.stderr, result.stderr[-3000:]
    errors = _error_lines(result.stderr)
    assert errors[0] == (
        f"error: {run}/checkpoints/step-6: no space left on device while writing checkpoint step-6; free space and "
        "rerun: it resumes from step-3 with --resume"
    )
    assert f"run dir: {run}" in result.stderr
    assert (kept / "checkpoints" / "latest").read_text().strip() == "step-3"  # the data stayed safe
    assert "second=0" in result.stderr, result.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (kept / "resumed-metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))


@small_filesystem
def test_a_full_disk_in_the_data_stage_is_one_line_naming_the_file(tmp_path):
    from sftflow.tasks.demo import write_demo

    demo = write_demo(tmp_path / "demo", n=400)
    mount = tmp_path / "small"
    (tmp_path / "link").symlink_to(mount)  # given as a relative path through a link: the notice says where it is
    script = f'cd {tmp_path} && "$SFTFLOW" data --source {demo["data"]} --tokenizer {demo["tokenizer"]} --out link/data'
    result = in_small_filesystem(mount, "160k", script)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[0] == f"work dir: {mount}/data"
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr
    (error,) = _error_lines(result.stderr)
    assert error.startswith(f"error: {mount}/data/")
    assert ": no space left on device" in error
    assert "; free space and rerun: the work already done is reused" in error


@small_filesystem
def test_a_full_disk_in_the_pipeline_is_one_line_with_the_checkpoint_a_rerun_resumes_from(tmp_path):
    """`sftflow run` with its work dir on 2.5 MiB: the data, the plan and checkpoint step-3 fit, step-6 does not.
    The log file stops once (it used to print a `--- Logging error ---` block for every record after), the train
    stage is not retried (the disk stays full), and the command ends with one line, exit 2."""
    mount = tmp_path / "small"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"work_dir: {mount}\n"
        "demo: {records: 200, seed: 0}\n"
        "plan: {tokens_per_rank: 256, micro_batches_per_step: 1, epochs: 2, seed: 0}\n"
        "train: {model: tiny-llama, nproc: 1, num_threads: 1, max_steps: 9, checkpoint: {every: 3, keep_last: 1},\n"
        "        device: cpu}\n"
        "eval: {max_docs: 8, max_generations: 2, num_examples: 1}\n"
    )
    result = in_small_filesystem(mount, "2500k", f'"$SFTFLOW" run {config}')
    assert result.returncode == 2, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Logging error" not in output and "RecursionError" not in output
    assert output.count(f"stopped writing {mount}/sftflow.log") == 1
    assert output.count("launching:") == 1  # no retry
    (error,) = _error_lines(result.stderr)
    assert re.fullmatch(
        rf"error: {mount}/train/\w+/checkpoints/step-6: no space left on device while writing checkpoint step-6; "
        r"free space and rerun: it resumes from step-3",
        error,
    ), error
