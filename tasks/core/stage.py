"""One way to make a stage task: a plain function that writes into its output folder, wrapped by `stage_task`.

    @stage_task(PLAN_CACHE, name="plan", retries=2)
    def plan_task(out_dir: Path, index: DatasetIndex, config: PlanConfig, work_dir: str) -> PlanManifest:
        ...  # write files into out_dir, return their manifest

The task Prefect sees takes the same arguments without `out_dir`. On each call the helper
  1. binds the arguments, so the cache inputs are exactly the call's parameters (no list written by hand can drift
     from the signature: the cache policy hashes the same bound arguments),
  2. verifies every manifest among them (the file it names is there and unchanged) before the stage trusts it,
  3. derives the output folder `work_dir/<stage>/<key>/` from the same bound arguments, creates it, and removes
     the temporary files an earlier, killed run of this stage left there (`sftflow.tasks.core.leftovers`),
  4. runs the function, then writes its result as `manifest.json` and lists the folder in `CHECKSUMS` (last, so the
     listing marks a complete output), both through the one atomic-write function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from prefect import task
from pydantic import BaseModel

from sftflow.tasks.core.caching import MANIFEST, StageCache, write_checksums, write_manifest
from sftflow.tasks.core.leftovers import remove_stale_temporaries
from sftflow.tasks.core.manifests import Manifest


def verify_inputs(inputs: dict[str, Any]) -> None:
    """Check every manifest argument (also inside lists) against its file."""
    for value in inputs.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, Manifest):
                item.verify()


def stage_task(cache: StageCache, *, checked: tuple[str, ...] | None = None, **task_options) -> Callable:
    """Decorator: `fn(out_dir, **inputs) -> manifest` becomes a cached Prefect task `task(**inputs) -> manifest`.

    `inputs` must include `work_dir`. `checked` names the files and folders `CHECKSUMS` lists (default: all of the
    output folder); the manifest is always among them. `task_options` go to `prefect.task` (name, retries, ...);
    results persist as JSON, so a cached run's manifest is read back without pickle.
    """

    def decorate(fn: Callable[..., Any]):
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        if not params or params[0].name != "out_dir":
            raise TypeError(f"{fn.__qualname__}: a stage function's first parameter is `out_dir`")
        task_signature = signature.replace(parameters=params[1:])
        if "work_dir" not in task_signature.parameters:
            raise TypeError(f"{fn.__qualname__}: a stage function takes `work_dir` (its output folder is under it)")
        include = None if checked is None else (*checked, MANIFEST)

        @functools.wraps(fn)
        def run_stage(*args, **kwargs):
            bound = task_signature.bind(*args, **kwargs)
            bound.apply_defaults()
            inputs = dict(bound.arguments)
            verify_inputs(inputs)
            out_dir = cache.output_dir(inputs)
            out_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(out_dir)
            result = fn(out_dir, **inputs)
            if isinstance(result, BaseModel):
                write_manifest(out_dir, result)
            write_checksums(out_dir, include=include)
            return result

        # Prefect reads parameters from the signature: the task's, without `out_dir`.
        run_stage.__signature__ = task_signature
        run_stage.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "out_dir"}
        options = {"persist_result": True, "result_serializer": "json", **task_options}
        return task(run_stage, cache_policy=cache, **options)

    return decorate
