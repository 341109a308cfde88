"""The `sft-refresh` flow: refresh the data, and only when it changed, train, evaluate and run the promotion gate.

Meant for a schedule (`sft-refresh/chain`): on a night when no source changed it is the data stage's Cached no-op
and stops there. "Changed" means the dataset index differs from the one the last chained run trained on, which is
recorded in `WORK_DIR/refresh.json` only after that run completed, so a chained run that failed is retried by the
next refresh even though the data did not change again. The work folder's lock is held from the data stage to that
record, so a second refresh cannot slip in between the run's end and the record and train the same data again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from sftflow.flows.config import SFTConfig, resolve_config
from sftflow.flows.data import sft_data
from sftflow.flows.results import work_dir_lock
from sftflow.flows.sft import SFTResult, sft
from sftflow.tasks.core.atomic import write_atomic


class RefreshResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index_sha256: str
    changed: bool  # the index differs from the one the last chained run trained on
    trained_on: str | None  # the index the last completed chained run trained on, before this refresh
    run: SFTResult | None = None  # the chained pipeline run, when the data changed


def _record(work: Path) -> Path:
    return work / "refresh.json"


def last_chained(work: Path) -> dict:
    """`{"index_sha256", "then"}` of the last completed chained run, or {}."""
    path = _record(work)
    return json.loads(path.read_text()) if path.is_file() else {}


@flow(name="sft-refresh", log_prints=True)
def sft_refresh(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    then: Literal["train", "promote"] = "promote",
) -> RefreshResult:
    """Refresh the data; if the index changed since the last chained run, run `sft` (with the gate for
    `then="promote"`)."""
    cfg = resolve_config(config_path, config, overrides)
    work = Path(cfg.work_dir).resolve()
    with work_dir_lock(work):
        return _refresh(cfg, work, then)


def _refresh(cfg: SFTConfig, work: Path, then: Literal["train", "promote"]) -> RefreshResult:
    logger = get_run_logger()
    data = sft_data(config=cfg)
    last = last_chained(work)
    before = last.get("index_sha256")
    # A chain that only trained has not been through the gate: a later `then="promote"` still runs it once.
    gated = last.get("then", "promote") == "promote" or then == "train"
    if data.index.sha256 == before and gated:
        logger.info("sft-refresh: the data did not change since the last chained run; nothing to train")
        return RefreshResult(index_sha256=data.index.sha256, changed=False, trained_on=before)
    logger.info(
        "sft-refresh: the dataset index changed (%s -> %s): %s",
        (before or "none")[:12],
        data.index.sha256[:12],
        "train, evaluate and run the promotion gate" if then == "promote" else "train and evaluate",
    )
    run = sft(config=cfg, promote=then == "promote")
    write_atomic(_record(work), json.dumps({"index_sha256": run.data.index.sha256, "then": then}) + "\n")
    changed = run.data.index.sha256 != before
    return RefreshResult(index_sha256=run.data.index.sha256, changed=changed, trained_on=before, run=run)
