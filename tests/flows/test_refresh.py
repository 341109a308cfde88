"""`sft-refresh` on Prefect's real engine: the first refresh trains and promotes, an unchanged refresh stops after the
Cached data stage, and new records train again and go through the gate."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

import sftflow.flows.refresh as refresh_module
from sftflow.flows.config import SFTConfig
from sftflow.flows.refresh import sft_refresh
from sftflow.tasks.demo import write_demo
from tests.flows.conftest import RecordedTaskRuns

pytestmark = pytest.mark.slow


def _config(work: Path, data: Path, tokenizer: Path) -> SFTConfig:
    return SFTConfig.model_validate(
        {
            "work_dir": str(work),
            "data": {
                "sources": [str(data)],
                "tokenizer": str(tokenizer),
                "render": {"template": "chatml"},
                "index": {"eval_fraction": 0.1},
            },
            "plan": {"tokens_per_rank": 512},
            "train": {"model": "tiny-llama", "max_steps": 3, "num_threads": 1},
            "eval": {"max_docs": 6, "max_generations": 1, "num_examples": 1},
        }
    )


def _locked(path: Path) -> bool:
    """Whether some open file holds `path`'s flock (a fresh descriptor conflicts even in the holder's process)."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_refresh_trains_and_promotes_only_when_the_data_changed(tmp_path, monkeypatch):
    demo = write_demo(tmp_path / "demo", n=160)
    lines = Path(demo["data"]).read_text().splitlines(keepends=True)
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(lines[:120]))
    cfg = _config(tmp_path / "work", source, demo["tokenizer"])
    # The record of the chained run is written while the work folder is still locked: a refresh started after
    # `sft` returned and before the record would otherwise train the same data again.
    held_at_record = []
    write = refresh_module.write_atomic

    def record(path, text):
        held_at_record.append(_locked(tmp_path / "work" / ".sftflow.lock"))
        return write(path, text)

    monkeypatch.setattr(refresh_module, "write_atomic", record)

    first = sft_refresh(config=cfg)
    assert first.changed and first.trained_on is None
    assert first.run.promotion.decision == "promoted" and first.run.promotion.champion == "v0001"

    with RecordedTaskRuns() as runs:
        unchanged = sft_refresh(config=cfg)
    assert not unchanged.changed and unchanged.run is None
    assert unchanged.trained_on == first.index_sha256
    assert set(runs.states()) == {"render", "spans", "pbin", "index"}  # no plan, train, eval or gate
    assert all(s == "Cached" for states in runs.states().values() for s in states)

    source.write_text("".join(lines))  # 40 new records
    changed = sft_refresh(config=cfg)
    assert changed.changed and changed.trained_on == first.index_sha256
    assert changed.index_sha256 != first.index_sha256
    assert changed.run.promotion is not None and changed.run.promotion.candidate_sha256
    record = json.loads((tmp_path / "work" / "refresh.json").read_text())
    assert record == {"index_sha256": changed.index_sha256, "then": "promote"}
    assert held_at_record == [True, True]
    assert not _locked(tmp_path / "work" / ".sftflow.lock")

    # A chain that only trained leaves the gate to the next `then="promote"`, even on unchanged data.
    only_train = sft_refresh(config=cfg, then="train")
    assert not only_train.changed and only_train.run is None  # trained and gated already: nothing to do
    source.write_text("".join(lines[:150]))
    trained = sft_refresh(config=cfg, then="train")
    assert trained.changed and trained.run.promotion is None
    gated = sft_refresh(config=cfg)
    assert not gated.changed and gated.run is not None and gated.run.promotion is not None
