"""A local model registry: numbered versions of exported models and a `champion` pointer to the one in service.

    registry/
      v0001/  model/ (the Hugging Face folder as trained)  card.json (hash, source run, eval metrics, time)
      v0002/  ...
      champion      "v0002": the version in service
      history.jsonl one line per decision (promoted or kept, with the reasons)

Only whole versions are ever visible: a version is copied into a hidden temporary folder and renamed into place, and
the pointer is replaced atomically after that, so a process killed at any moment leaves the previous champion in
service and at worst one finished version nobody points at (or a hidden leftover the next publish removes). One
writer at a time holds `registry/.lock`.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from sftflow.tasks.core.atomic import fsync_folder, write_atomic
from sftflow.tasks.core.fingerprint import sha256_tree
from sftflow.tasks.core.leftovers import remove
from sftflow.tasks.core.locks import exclusive

_VERSION = re.compile(r"^v(\d{4,})$")
CHAMPION = "champion"


@dataclass(frozen=True)
class ModelVersion:
    name: str
    path: Path  # the version folder; the model is in `path / "model"`
    card: dict

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def sha256(self) -> str:
        return self.card["sha256"]


class Registry:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def lock(self):
        self.root.mkdir(parents=True, exist_ok=True)
        return exclusive(self.root / ".lock", f"registry {self.root}")

    def versions(self) -> list[str]:
        if not self.root.is_dir():
            return []
        names = [p.name for p in self.root.iterdir() if p.is_dir() and _VERSION.match(p.name)]
        return sorted(names, key=lambda n: int(n[1:]))

    def version(self, name: str) -> ModelVersion:
        path = self.root / name
        card = path / "card.json"
        if not card.is_file():
            raise ValueError(f"{path}: not a registry version (no card.json)")
        return ModelVersion(name=name, path=path, card=json.loads(card.read_text()))

    def champion(self) -> ModelVersion | None:
        pointer = self.root / CHAMPION
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        if not _VERSION.match(name) or not (self.root / name).is_dir():
            raise ValueError(f"{pointer}: names {name!r}, which is not a version in {self.root}")
        return self.version(name)

    def publish(self, model_dir: str | Path, card: dict) -> ModelVersion:
        """Copy `model_dir` in as the next version (not yet champion). Call while holding `lock()`."""
        model_dir = Path(model_dir)
        for leftover in self.root.glob(".v*.tmp"):  # a publish killed midway: never visible, removed here
            remove(leftover)
        taken = self.versions()
        name = f"v{(int(taken[-1][1:]) + 1 if taken else 1):04d}"
        staging = self.root / f".{name}.tmp"
        shutil.copytree(model_dir, staging / "model")
        # The caller's hash of the folder when it has one: hashing a multi-GB export again costs minutes.
        sha = card.get("sha256") or sha256_tree(staging / "model")
        card = {**card, "version": name, "sha256": sha, "published_at": time.time()}
        write_atomic(staging / "card.json", json.dumps(card, indent=2))
        staging.rename(self.root / name)
        fsync_folder(self.root)
        return self.version(name)

    def set_champion(self, version: ModelVersion) -> None:
        """Point `champion` at `version` (atomically). Call while holding `lock()`."""
        write_atomic(self.root / CHAMPION, version.name + "\n")

    def record(self, entry: dict) -> None:
        """Append a decision to `history.jsonl` (the log of what was promoted or kept, and why)."""
        with open(self.root / "history.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), **entry}) + "\n")
