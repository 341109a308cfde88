"""The plan stage's result: `plan.npz`, the config it was planned with and its statistics."""

from __future__ import annotations

from pathlib import Path

from sftflow.tasks.core.manifests import Manifest
from sftflow.tasks.plan.config import PlanConfig, PlanStats


class PlanManifest(Manifest):
    """`plan.npz` (see `sftflow.tasks.plan.planner`), planned from the index with this sha256."""

    index_sha256: str
    config: PlanConfig
    stats: PlanStats

    @property
    def dir(self) -> Path:
        return Path(self.path).parent
