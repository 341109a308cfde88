"""A training run killed outright, as the OOM killer or a lost machine stops one: the real launcher
(`sftflow.tasks.train.launch.train`) in a process of its own, SIGKILLed together with torchrun and its workers once
the run's first checkpoint is complete (its `latest` marker written) and before the run ends.

    launcher (own session) ──▶ torchrun (own session) ──▶ workers (a session each)
        └─ all listed once the first step is logged; every one of their process groups SIGKILLed when `latest` appears

No hook in the run decides the moment: the kill lands wherever the run is then (the next step, or that step's
checkpoint save). A run that ends before the kill reaches it is not a kill; `Kill.landed` says so, and the caller
tries again or reports it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sftflow.tasks.train.checkpoint import LATEST
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.errors import TrainingFailed

_POLL_S = 0.005  # a CPU step of the check's tiny runs takes tens of milliseconds or more


@dataclass(frozen=True)
class Kill:
    landed: bool  # False: the run had ended (or reached its last checkpoint) before the kill
    pids: tuple[int, ...]  # the processes SIGKILLed: the launcher, torchrun and the workers
    logged_steps: tuple[int, ...]  # the steps the killed run had written to metrics.jsonl
    latest: int  # the step its `latest` marker named after the kill (the step a resume starts from)
    attempts: int = 1

    @property
    def processes(self) -> int:
        return len(self.pids)

    def describe(self) -> str:
        last = max(self.logged_steps, default=0)
        where = f"in step {last + 1}" if last == self.latest else f"saving step {last}'s checkpoint"
        return f"{self.processes} processes (launcher, torchrun, workers) SIGKILLed {where}, latest step-{self.latest}"


def _children() -> dict[int, list[int]]:
    """Every process's children: from /proc where there is one (Linux, with or without procps), else from `ps`."""
    pairs: list[tuple[int, int]] = []
    proc = Path("/proc")
    if (proc / "self" / "stat").is_file():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone since the listing
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ")"
            pairs.append((int(entry.name), int(stat[stat.rindex(")") + 2 :].split()[1])))
    else:
        out = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True, check=True)
        pairs = [(int(pid), int(ppid)) for pid, ppid in (line.split() for line in out.stdout.splitlines())]
    children: dict[int, list[int]] = {}
    for pid, ppid in pairs:
        children.setdefault(ppid, []).append(pid)
    return children


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants alive now."""
    children, tree, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def kill_tree(pids: list[int]) -> None:
    """SIGKILL every process group among `pids` (each of torchrun and its workers runs in a session of its own),
    then each process, whatever group it is in; never this process's own group."""
    own = os.getpgrp()
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in groups - {own}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _latest_step(checkpoints: Path) -> int:
    marker = checkpoints / LATEST
    return int(marker.read_text().strip().removeprefix("step-")) if marker.is_file() else 0


def _logged_steps(metrics: Path) -> tuple[int, ...]:
    if not metrics.is_file():
        return ()
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):  # the line the kill cut short
            pass
    return tuple(steps)


def launch_and_kill(config: TrainConfig, timeout_s: float = 600.0) -> Kill:
    """Start `train(config)` in a new session; once the first step is logged, list its process tree; once `latest`
    names a checkpoint, SIGKILL the tree. Raises `TrainingFailed` when the run stops by itself without a checkpoint."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "check-config.json").write_text(config.model_dump_json())
    log_path = run_dir / "launcher.log"
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    cmd = [sys.executable, "-m", __name__, str(run_dir / "check-config.json")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[int] = []
    killed = False
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not tree and metrics.is_file() and metrics.stat().st_size:
                tree = process_tree(proc.pid)  # every process of the run has started by the first step's end
            if tree and (checkpoints / LATEST).is_file():
                kill_tree(tree)
                killed = True
                break
            time.sleep(_POLL_S)
    finally:
        if not killed and proc.poll() is None:  # a timeout or an error here: nothing of the run is left running
            kill_tree(process_tree(proc.pid))
        proc.wait()
    latest = _latest_step(checkpoints)
    if latest == 0:
        tail = "\n".join(log_path.read_text().splitlines()[-20:])
        raise TrainingFailed(f"check: the run to kill stopped (code {proc.returncode}) before any checkpoint:\n{tail}")
    landed = proc.returncode == -signal.SIGKILL and latest < (config.max_steps or sys.maxsize)
    return Kill(landed=landed, pids=tuple(tree), logged_steps=_logged_steps(metrics), latest=latest)


def kill_after_a_checkpoint(config: TrainConfig, tries: int = 2) -> Kill:
    """`launch_and_kill` into a fresh `config.out`, again while the run ends before the kill lands, `tries` times in
    all; the last `Kill` (landed or not) says how many it took."""
    import shutil

    for attempt in range(1, tries + 1):
        shutil.rmtree(config.run_dir, ignore_errors=True)
        kill = replace(launch_and_kill(config), attempts=attempt)
        if kill.landed:
            break
    return kill


def main(argv: list[str]) -> None:
    """The killed launcher's process: `python -m sftflow.tasks.check.kill CONFIG_JSON`."""
    from sftflow.tasks.train.launch import train

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    train(TrainConfig.model_validate_json(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
