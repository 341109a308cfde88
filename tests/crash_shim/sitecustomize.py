"""Test-only crash injection for training workers, loaded by Python at start-up when this folder is on PYTHONPATH
(the `inject_crash` fixture in `tests/conftest.py` puts it there).

`SFTFLOW_TEST_CRASH=crash_after_step=N[,rank=R][,lr=X]` makes a worker (`python -m sftflow.tasks.train.worker
RUN_DIR`) SIGKILL rank R (default: the last) right after optimizer step N and its checkpoint, once per run folder:
the marker `RUN_DIR/fault-fired` stops a resumed attempt from crashing again. With `lr=X`, only a run whose learning
rate is X crashes (a served deployment runs other flows beside the one under test).

The hook wraps `Checkpointer.due`, which the worker's loop calls on every rank once a step's metrics are written:
at step N every rank saves (if a checkpoint is due there: a collective), then rank R kills itself and the others
block in the next step's collectives until torchrun tears the group down, as a real crash leaves them. Where steps
are queued ahead of their totals (on a GPU) the loop first asks `Checkpointer.will_save(N)` whether to finish step
N before queueing the next: the hook says yes for step N, so that the crash comes with step N's totals in the
progress and nothing of step N + 1 has run.
"""

import os

_SPEC = os.environ.get("SFTFLOW_TEST_CRASH")
_TARGET = "sftflow.tasks.train.checkpoint"


def _install(module) -> None:
    import json
    import signal
    import sys
    from pathlib import Path

    fields = dict(item.split("=", 1) for item in _SPEC.split(","))
    if set(fields) - {"crash_after_step", "rank", "lr"} or "crash_after_step" not in fields:
        raise ValueError(f"SFTFLOW_TEST_CRASH={_SPEC!r}: expected crash_after_step=N[,rank=R][,lr=X]")
    if not sys.argv or not sys.argv[0].endswith(os.path.join("train", "worker.py")):
        return  # not a training worker (the launcher, the flow, a CLI)
    run_dir = Path(sys.argv[-1])
    if "lr" in fields:
        lr = json.loads((run_dir / "run.json").read_text())["config"]["optimizer"]["lr"]
        if float(lr) != float(fields["lr"]):
            return
    marker = run_dir / "fault-fired"
    if marker.exists():  # decided once at start-up, so that every rank agrees
        return
    crash_step = int(fields["crash_after_step"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    crash_rank = int(fields.get("rank", world - 1))
    due, will_save = module.Checkpointer.due, module.Checkpointer.will_save

    def finishing_will_save(self, step: int) -> bool:
        return step == crash_step or will_save(self, step)

    def crashing_due(self, step: int, last: bool = False) -> bool:
        if step != crash_step:
            return due(self, step, last=last)
        if due(self, step, last=last):
            self.save(step)
        if rank == crash_rank:
            marker.write_text(f"rank {rank} killed itself after step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return False

    module.Checkpointer.due, module.Checkpointer.will_save = crashing_due, finishing_will_save


if _SPEC:
    import importlib.abc
    import importlib.util
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                _install(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
