"""The latest manifest of each stage, kept in the work folder (`data.json`, `plan.json`, `train.json`, `eval.json`).

A stage flow run alone (a deployment rerun) reads its inputs from here, so it never recomputes upstream stages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def write_stage_result(work_dir: str | Path, stage: str, manifest: BaseModel) -> Path:
    path = Path(work_dir) / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(manifest.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def read_stage_result(work_dir: str | Path, stage: str, model: type[M]) -> M:
    path = Path(work_dir) / f"{stage}.json"
    if not path.is_file():
        raise ValueError(f"{path}: no {stage} result in this work folder; run the `sft-{stage}` stage (or `sft`) first")
    return model.model_validate_json(path.read_text())
