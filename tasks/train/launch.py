"""Launching training: write `run.json`, run `torchrun -m sftflow.tasks.train.worker RUN_DIR`, stream its output.

`train(config)` is the plain function (the CLI calls it); `sftflow.tasks.train.stage` holds the Prefect tasks around
it (`train_stage_task`, cached, for the pipeline; `train_task`, plain). Call a task directly inside a flow, not with
`.submit()`: the subprocess is supervised from the calling thread, which a thread-pool timeout could not interrupt.
Prefect is imported only where a run needs it, so this module (and `torchrun_command`) also works on a machine
without prefect, such as a bare GPU image.

- Every output line of every worker goes to the Prefect run logger (or the `sftflow.train` logger outside a run).
- The torchrun process tree runs in its own process group (session). On timeout, cancellation (SIGTERM/SIGINT to
  this process) or any error, the whole group is killed: no orphan workers keep GPUs busy.
- A non-zero exit raises `TrainingFailed`, so Prefect retries fire; a retry resumes from the run's `latest`
  checkpoint (the stage task resumes whenever the run folder holds one).
- During training a Prefect progress artifact follows `metrics.jsonl`; at the end a table artifact holds the metrics.
- A `LiveMetrics` follower given to `train` (the pipeline's live experiment tracking) is started with the run and
  stopped when it ends; it works from threads of its own, so nothing it waits on holds the training loop.

Multi-node: run this same task on every node with the same config (a shared `out` folder on a shared filesystem,
the same `rdzv_endpoint`/`rdzv_id`) and each node's `node_rank`; torchrun's c10d rendezvous forms one world.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from sftflow.tasks.core.disk_full import DiskFull, from_report_line
from sftflow.tasks.core.fingerprint import sha256_file, sha256_tree
from sftflow.tasks.core.leftovers import remove_stale_temporaries
from sftflow.tasks.core.locks import check_no_writers, exclusive
from sftflow.tasks.core.manifests import TrainResult
from sftflow.tasks.train.checkpoint import latest_checkpoint
from sftflow.tasks.train.config import TrainConfig, write_run_json
from sftflow.tasks.train.data import load_plan, plan_path
from sftflow.tasks.train.errors import TrainingFailed  # noqa: F401  (raised here; imported from here by callers)
from sftflow.tasks.train.lifetime import LAUNCHER_PID_VAR, WRITERS_VAR
from sftflow.tasks.train.metrics import read_metrics
from sftflow.tasks.train.progress_log import ThrottledProgress

WORKER_MODULE = "sftflow.tasks.train.worker"
TORCHRUN_MODULE = "sftflow.tasks.train.torchrun"
_KILL_GRACE_S = 10.0
_PROGRESS_EVERY_S = 5.0


class LiveMetrics(Protocol):
    """Follows a run's `metrics.jsonl` while it trains, such as `sftflow.tasks.track.live.LiveTracker`. Given as an
    object, not imported here: tracking code is then no part of the train stage's code fingerprint, so changing it
    retrains nothing. Neither method raises, and `stop` returns within seconds."""

    def start(self, run_dir: Path) -> None: ...

    def stop(self, trained: bool) -> None: ...


def torchrun_command(config: TrainConfig, run_dir: Path) -> list[str]:
    """`python -m sftflow.tasks.train.torchrun ...` (torchrun): standalone on one node, c10d rendezvous across
    several."""
    # torchrun's own `main` behind an entry point that makes it die with this launcher (`lifetime`)
    cmd = [sys.executable, "-m", TORCHRUN_MODULE, f"--nproc-per-node={config.nproc}"]
    if config.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={config.nnodes}",
            f"--node-rank={config.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
            f"--rdzv-id={config.rdzv_id}",
        ]
    return cmd + ["-m", WORKER_MODULE, str(run_dir)]


def input_manifests(config: TrainConfig) -> dict:
    """What the run was made from: the plan file's hash and arrays' sizes, and the data index's manifest."""
    plan = load_plan(config.plan)
    path = plan_path(config.plan)
    manifests = {
        "plan": {
            "path": str(path),
            "sha256": sha256_file(path),
            "num_steps": plan.num_steps,
            "num_ranks": plan.num_ranks,
            "micro_batches_per_step": plan.micro_batches_per_step,
            "mode": plan.mode,
        }
    }
    index_json = Path(config.data) / "index.json"
    manifests["data"] = {
        "path": config.data,
        "index_sha256": sha256_file(index_json) if index_json.is_file() else None,
    }
    return manifests


def _logger():
    """The Prefect run logger inside a run, else the `sftflow.train` logger (also where prefect is not installed)."""
    if _in_prefect_run():
        from prefect import get_run_logger

        return get_run_logger()
    logger = logging.getLogger("sftflow.train")
    if not logger.hasHandlers():
        logger.addHandler(logging.StreamHandler())
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return logger


def _in_prefect_run() -> bool:
    try:
        from prefect.context import FlowRunContext, TaskRunContext
    except ImportError:  # a bare GPU image: no Prefect run can be in progress
        return False
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


class _Progress:
    """A Prefect progress artifact that follows metrics.jsonl (only inside a Prefect run)."""

    def __init__(self, metrics_path: Path, total_steps: int, enabled: bool):
        self.metrics_path, self.total_steps = metrics_path, max(total_steps, 1)
        self.artifact_id = None
        self.last = 0.0
        if enabled:
            from prefect.artifacts import create_progress_artifact

            self.artifact_id = create_progress_artifact(0.0, key="train-progress", description="training steps done")

    def tick(self, force: bool = False) -> None:
        if self.artifact_id is None or (not force and time.monotonic() - self.last < _PROGRESS_EVERY_S):
            return
        from prefect.artifacts import update_progress_artifact

        self.last = time.monotonic()
        records = read_metrics(self.metrics_path)
        step = records[-1]["step"] if records else 0
        update_progress_artifact(self.artifact_id, progress=min(100.0, 100.0 * step / self.total_steps))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the whole process group (torchrun forwards it to its workers), SIGKILL whatever is left after a grace
    period. Also run after a normal exit: a worker that outlived its agent must not keep a GPU."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return  # the group is gone: every process of the run has exited
    try:
        proc.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


_RUNNING: set[subprocess.Popen] = set()  # the torchrun process groups this process supervises now


def stop_running_training() -> None:
    """Kill every torchrun process group this process supervises (from any thread): for a process about to end at
    once, whose supervising threads will run no `finally`."""
    for proc in list(_RUNNING):
        _kill_group(proc)


class _Terminated(BaseException):
    """SIGTERM reached a launcher that had no handler of its own for it (a plain process, not a Prefect run)."""


def run_streaming(cmd: list[str], env: dict, timeout_s: float | None, on_line, on_tick=lambda: None) -> int:
    """Run `cmd` in its own session; call `on_line` for every output line (from this thread). Returns the exit code.
    Kills the process group on timeout, cancellation or any exception, then re-raises."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True
    )
    _RUNNING.add(proc)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    previous = None
    # SIGTERM's default action would end this process without the `finally` below, leaving torchrun (in a session
    # of its own) running: raise instead. A handler already installed is kept: Prefect's raises its
    # `TerminationSignal`, which the `finally` handles as well, and a flow run only reports a cancel as Cancelled
    # (not Crashed) when that signal, raised by that handler, reaches its engine.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

        def on_sigterm(signum, frame):
            raise _Terminated()

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"training exceeded timeout_s={timeout_s}; killed the torchrun process group")
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                on_tick()
                continue
            if line is None:
                break
            on_line(line)
            on_tick()
        return proc.wait()
    finally:
        _kill_group(proc)
        _RUNNING.discard(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (a container or `taskset` limit), which
    `os.cpu_count()` ignores, so workers would start one OpenMP thread per host core and fight over the few allowed."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


# torch reads its allocator settings from either name (PYTORCH_ALLOC_CONF is the newer one).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def writers_file(run_dir: Path, node_rank: int) -> Path:
    """The file every worker of a run on this node holds a shared lock on (`lifetime`)."""
    return run_dir / f".writers-node{node_rank}"


def _worker_env(config: TrainConfig) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[LAUNCHER_PID_VAR] = str(os.getpid())
    env[WRITERS_VAR] = str(writers_file(config.run_dir, config.node_rank))
    if config.num_threads is not None:  # the config's count wins: the run's float summation order depends on it
        env["OMP_NUM_THREADS"] = str(config.num_threads)
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // config.nproc)))
    if _runs_on_cpu(config):
        # OpenMP's default spin-waiting collapses a CPU worker on a busy machine: a thread spins at each of the
        # step's ~1000 small parallel regions while its partner waits for a core, so the demo ran 30x slower for a
        # 2x smaller share of the CPU. Sleeping threads give up the core instead, and the step slows in proportion.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    elif not any(name in env for name in ALLOC_CONF_VARS):
        # Packed rows differ in length and documents in count, so the caching allocator's fixed-size segments strand
        # memory between steps (reserved memory far above the peak, a larger row from running out);
        # segments that grow in place do not, at the same speed (benchmarks/results/training.jsonl, the caching
        # allocator rows). A setting the user made, under either of torch's names, is kept.
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def check_one_device_options(config: TrainConfig, vocab_size: int | None = None) -> None:
    """The optimizer options of the one-device path, refused before torchrun starts when `parallel: auto` will not
    resolve to it here (a CPU run, where auto means FSDP), or when this host has less memory available than the
    offloaded moments take, rather than by the worker after the model is built."""
    if not config.optimizer.in_backward and config.optimizer.offload == "off":
        return  # nothing of the one-device path asked for: no need to look for a GPU
    from sftflow.tasks.train.config import check_one_device_path

    check_one_device_path(config, "cpu" if _runs_on_cpu(config) else "cuda")
    if config.optimizer.offload != "off":
        import torch
        from transformers import AutoModelForCausalLM

        from sftflow.tasks.train.host_moments import available_host_bytes, check_host_room, offloaded_numel
        from sftflow.tasks.train.model import model_config

        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(
                model_config(config.model, vocab_size=vocab_size, overrides=config.model_overrides)
            )
        check_host_room(8 * offloaded_numel(lm, config.optimizer.offload)[0], available_host_bytes())


def _runs_on_cpu(config: TrainConfig) -> bool:
    return config.device == "cpu" or config.device == "auto" and not _cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def train(
    config: TrainConfig, *, resume: bool | None = None, live: LiveMetrics | None = None, resolved=None
) -> TrainResult:
    """Run (or resume) training into `config.out`; blocks until torchrun exits. Raises `TrainingFailed` on failure.
    `live` follows the run's metrics while it trains; `resolved` (`sftflow.tasks.train.resolved.ResolvedRun`): the
    run's choices, made by the caller (default: resolved here, `resolve_run`)."""
    resume = config.checkpoint.resume if resume is None else resume
    run_dir = config.run_dir
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    latest = latest_checkpoint(run_dir / "checkpoints")
    if latest is not None and not resume:
        raise ValueError(
            f"{run_dir} already holds a training run (latest checkpoint {latest.name}); pass resume=True "
            "(--resume) to continue it, or choose a new out folder"
        )
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"resume": resume})})
    # One launcher per run folder and node: a second would resume from this one's live checkpoints and interleave
    # its metrics.
    with exclusive(run_dir / f".lock-node{config.node_rank}", f"training run {run_dir}"):
        # ... and no worker of an earlier launch still alive (its launcher was killed outright, say)
        check_no_writers(writers_file(run_dir, config.node_rank), f"training run {run_dir}")
        remove_stale_temporaries(run_dir)  # what a killed launch of this run left half-written
        return _launch(config, run_dir, live, resolved)


def _launch(config: TrainConfig, run_dir: Path, live: LiveMetrics | None, resolved=None) -> TrainResult:
    plan = load_plan(config.plan)
    from sftflow.tasks.data.reader import IndexedDataset

    # Training reads what the index recorded, or nothing: every index array and shard is checked against the
    # index's sha256s here, once per node, before any worker starts (one read of the data).
    checked = IndexedDataset(config.data, split=config.data_split, verify=True)
    vocab_size = checked.vocab_size
    checked.reader.close()
    # torch and transformers: only once a run is launched
    from sftflow.tasks.train.checkpoint import checkpoint_to_load
    from sftflow.tasks.train.checksums import verify_checksums
    from sftflow.tasks.train.config import checkpoint_config
    from sftflow.tasks.train.model import preflight

    preflight(
        config.model, packed=plan.mode == "packed", overrides=config.model_overrides, lora=config.lora,
        vocab_size=vocab_size,
    )  # fmt: skip
    check_one_device_options(config, vocab_size)
    if config.quantize == "nf4":
        import importlib.util

        import torch

        from sftflow.tasks.train.quantize import nf4_refusal

        refusal = nf4_refusal(
            config, cuda=torch.cuda.is_available(), bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None
        )
        if refusal is not None:
            raise ValueError(refusal)
    from sftflow.tasks.train.export import verify_export

    verify_export(config.model)  # a model folder sftflow exported is checked against its CHECKSUMS before it is read
    checkpoint = checkpoint_to_load(checkpoint_config(config))
    if checkpoint is not None:
        resuming = checkpoint.parent == run_dir / "checkpoints"
        verify_checksums(checkpoint, config.checkpoint.trust, resuming)  # before any reader unpickles its .metadata
    # Every `auto` made concrete once, here: the workers apply what run.json says (`resolved`).
    if resolved is None:
        from sftflow.tasks.train.resolved import resolve_run

        resolved = resolve_run(config, dataset_vocab=vocab_size)
    write_run_json(config, input_manifests(config), run_dir / "run.json", resolved.to_json())

    logger = _logger()
    for line in resolved.table():  # the run's first lines: what it runs with, and why
        logger.info("[run] %s", line)
    cmd = torchrun_command(config, run_dir)
    logger.info("launching: %s", " ".join(cmd))
    plan_steps = plan.num_steps
    total = plan_steps if config.max_steps is None else min(config.max_steps, plan_steps)
    progress = _Progress(run_dir / "metrics.jsonl", total, enabled=_in_prefect_run())
    user_error = run_dir / "worker-error.txt"  # `sftflow.tasks.train.worker.USER_ERROR`
    user_error.unlink(missing_ok=True)
    if live is not None:
        live.start(run_dir)
    code = None
    disk_full: list[DiskFull] = []
    # A Prefect run keeps every line it logs: step lines at a bounded rate there (`progress_log`).
    emit = ThrottledProgress(logger.info) if _in_prefect_run() else logger.info

    def on_line(line: str) -> None:
        full = from_report_line(line)
        if full is not None and not disk_full:  # the first rank's report
            disk_full.append(full)
        emit(line)

    try:
        code = run_streaming(cmd, _worker_env(config), config.timeout_s, on_line, progress.tick)
    finally:
        if isinstance(emit, ThrottledProgress):
            emit.flush()
        if live is not None:
            live.stop(trained=code == 0)
    if code != 0:
        if disk_full:
            raise disk_full[0].adding(rerun=_resumes_from(run_dir))
        if user_error.is_file():  # bad input found by a worker: one located line, and no retry can fix it
            raise ValueError(user_error.read_text())
        raise TrainingFailed(f"torchrun exited with code {code} (run dir {run_dir}); see the log above")
    progress.tick(force=True)
    return _result(config, run_dir)


def _resumes_from(run_dir: Path) -> str:
    """What a rerun of the run does: resume from its latest checkpoint, or start over when it saved none."""
    try:
        latest = latest_checkpoint(run_dir / "checkpoints")
    except ValueError:  # `latest` names a step the full disk left incomplete
        latest = None
    return f"it resumes from {latest.name}" if latest is not None else "it starts again from step 0 (no checkpoint)"


def _result(config: TrainConfig, run_dir: Path) -> TrainResult:
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    latest = latest_checkpoint(run_dir / "checkpoints")
    hf = run_dir / "hf"
    # The full model (merged, for a LoRA run), else a LoRA run's adapter alone (`lora.merge: false`).
    exported = hf if (hf / "config.json").is_file() else hf / "adapter" if (hf / "adapter").is_dir() else None
    if records and _in_prefect_run():
        from prefect.artifacts import create_table_artifact

        keep = ("step", "loss", "grad_norm", "lr", "trained_tokens", "tokens_per_s", "mfu", "skipped")
        stride = max(1, len(records) // 200)
        rows = [{k: r.get(k) for k in keep} for r in records[::stride]]
        create_table_artifact(rows, key="train-metrics", description=f"training metrics of {run_dir}")
    return TrainResult(
        run_dir=str(run_dir),
        steps=records[-1]["step"] if records else 0,
        final_loss=losses[-1] if losses else None,
        trained_tokens=sum(r["trained_tokens"] for r in records),
        metrics_path=str(run_dir / "metrics.jsonl"),
        checkpoint=str(latest) if latest else None,
        hf_dir=str(exported) if exported is not None else None,
        hf_sha256=sha256_tree(exported) if exported is not None else None,
    )
