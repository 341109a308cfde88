"""The latest manifest of each stage, kept in the work folder (`data.json`, `plan.json`, `train.json`, `eval.json`).

A stage flow run alone (a deployment rerun) reads its inputs from here, so it never recomputes upstream stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from sftflow.flows.served_process import guard_runner_child
from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.leftovers import remove_stale_temporaries
from sftflow.tasks.core.locks import exclusive

M = TypeVar("M", bound=BaseModel)


@contextmanager
def work_dir_lock(work_dir: str | Path, node_rank: int = 0) -> Iterator[None]:
    """Held by every flow while it writes into `work_dir`: a second run on the same folder is refused with the
    holder's PID and host (`sftflow.tasks.core.locks`). The nodes of one multi-node training run each hold their own.
    A flow run process that a Prefect runner started ends, and lets go, with that runner and with its API
    (`sftflow.flows.served_process`). Taking it removes what a killed writer left at the folder's top (a half-written
    `data.json` or `plan.json`'s temporary; `sftflow.tasks.core.leftovers`)."""
    name = ".sftflow.lock" if node_rank == 0 else f".sftflow-node{node_rank}.lock"
    with exclusive(Path(work_dir) / name, f"work_dir {work_dir}"):
        guard_runner_child()
        remove_stale_temporaries(Path(work_dir), top_only=True)
        yield


def write_stage_result(work_dir: str | Path, stage: str, manifest: BaseModel) -> Path:
    return write_atomic(Path(work_dir) / f"{stage}.json", manifest.model_dump_json(indent=2))


def read_stage_result(work_dir: str | Path, stage: str, model: type[M]) -> M:
    path = Path(work_dir) / f"{stage}.json"
    if not path.is_file():
        raise ValueError(f"{path}: no {stage} result in this work folder; run the `sft-{stage}` stage (or `sft`) first")
    return model.model_validate_json(path.read_text())
