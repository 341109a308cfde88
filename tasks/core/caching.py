"""Content-derived caching for stage tasks.

A stage's cache key is a hash of
  - the stage name and its format version,
  - a fingerprint of the source code of every sftflow module the stage runs: the import closure of its entry
    modules, found from their import statements (`sftflow.tasks.core.code_closure`), not a hand-kept list
    (TASK_SOURCE alone hashes only the thin task body, so a change in the plain function underneath, or in a
    kernel, would go unnoticed),
  - its inputs, where manifests contribute their content hashes (never bare paths).

Plain `INPUTS` is not enough: two different tasks with equal arguments would share a key.

The stage writes into `work_dir/<stage>/<key>/`, so a key names an output folder, and every file there is listed with
its sha256 in `CHECKSUMS`. Before Prefect may reuse a cached result, `StageCache` checks that folder: if a file is gone
or changed, the policy returns no key, the task runs again and rewrites the same folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from pydantic import BaseModel

from sftflow.tasks.core import code_closure
from sftflow.tasks.core.atomic import PERMANENT_ERRNOS, is_temporary, write_atomic
from sftflow.tasks.core.disk_full import disk_full_error
from sftflow.tasks.core.fingerprint import sha256_file, sha256_json

CHECKSUMS = "CHECKSUMS"
MANIFEST = "manifest.json"


def _normalise(value: Any) -> Any:
    """JSON-able form of an input: a pydantic model hashes as its JSON dump, so a typed model and the dict it dumps to
    give one key; an object with a `cache_key()` method (a resolved training run) as what that returns. Unkeyed
    fields (`_NOT_KEYED`) are left out at any depth."""
    if callable(getattr(value, "cache_key", None)):
        value = value.cache_key()
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items() if k not in _NOT_KEYED}
    return value


def stage_key(stage: str, version: str, entries: tuple[str, ...], inputs: dict[str, Any]) -> str:
    payload = {
        "stage": stage,
        "version": version,
        "code": code_closure.cached_code_fingerprint(entries),
        "inputs": _normalise(dict(sorted(inputs.items()))),
    }
    return sha256_json(payload)[:24]


# Fields that change how a task runs but not what it produces, as parameters or inside a config model. `node_rank`
# differs between the nodes of one multi-node training run, which must share one run folder; `live_track` follows a
# training run's metrics to the trackers, and another tracker must not retrain the model.
_NOT_KEYED = {"timeout_s", "node_rank", "live_track"}


def stage_dir(work_dir: str | Path, stage: str, key: str) -> Path:
    return Path(work_dir) / stage / key


def write_checksums(out_dir: Path, include: tuple[str, ...] | None = None) -> None:
    """List files under `out_dir` (all, or those under the `include` names) with their sha256.

    Written last, so it also marks a complete output.
    """
    lines = []
    roots = [out_dir] if include is None else [out_dir / name for name in include]
    files = {f for root in roots for f in ([root] if root.is_file() else root.rglob("*")) if f.is_file()}
    # A temporary file is another writer's (or a crashed one's) unfinished output, never part of this one.
    for file in sorted(p for p in files if p.name != CHECKSUMS and not is_temporary(p)):
        lines.append(f"{sha256_file(file)}  {file.relative_to(out_dir)}")
    write_atomic(out_dir / CHECKSUMS, "\n".join(lines) + "\n")


def outputs_valid(out_dir: Path) -> bool:
    listing = out_dir / CHECKSUMS
    if not listing.is_file():
        return False
    for line in listing.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split("  ", 1)
        file = out_dir / name
        if not file.is_file() or sha256_file(file) != digest:
            return False
    return True


def write_manifest(out_dir: Path, manifest: BaseModel) -> None:
    write_atomic(out_dir / MANIFEST, manifest.model_dump_json(indent=2))


def read_manifest(out_dir: Path, model: type[BaseModel]) -> BaseModel:
    return model.model_validate(json.loads((out_dir / MANIFEST).read_text()))


@dataclass
class StageCache(CachePolicy):
    """Cache policy for a stage task whose parameters include `work_dir`.

    `stage_task` (in `sftflow.tasks.core.stage`) calls `output_dir(inputs)` with the task's bound arguments to learn
    where to write, and Prefect calls `compute_key` with the same arguments, so the two cannot disagree.
    """

    stage: str = ""
    version: str = "1"
    # The modules the stage starts from: the task's module, and any run by name (the torchrun worker).
    entries: tuple[str, ...] = ()

    def key_for(self, inputs: dict[str, Any]) -> str:
        return stage_key(self.stage, self.version, self.entries, inputs)

    def output_dir(self, inputs: dict[str, Any]) -> Path:
        return stage_dir(inputs["work_dir"], self.stage, self.key_for(inputs))

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str | None:
        key = f"{self.stage}-{self.key_for(inputs)}"
        if not outputs_valid(self.output_dir(inputs)):
            # Missing or changed output: forget the cached manifest so the task runs again and rewrites the folder.
            _forget_record(task_ctx, key)
        return key


def _forget_record(task_ctx, key: str) -> None:
    # ResultStore has no delete; with local storage (the default, and what sftflow configures) a record is one file.
    store = getattr(task_ctx, "result_store", None)
    storage = getattr(store, "result_storage", None)
    resolve = getattr(storage, "_resolve_path", None)
    if store is None or resolve is None or store.metadata_storage is not None:
        return
    Path(resolve(key)).unlink(missing_ok=True)


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry anything but bad input (a `ValueError`) and a full disk (a retry meets the same disk): a crashed or
    killed training run resumes on retry."""
    try:
        state.result()
    except ValueError:
        return False
    except Exception as err:
        return disk_full_error(err) is None
    return False


def retry_on_io_error(task, task_run, state) -> bool:
    """Retry transient I/O failures; bad input (ValueError, a missing file) and a full disk, quota or read-only
    filesystem (a retry meets the same) are not retried."""
    try:
        state.result()
    except FileNotFoundError:
        return False
    except OSError as err:
        return err.errno not in PERMANENT_ERRNOS
    except Exception:
        return False
    return False
