"""Tasks from lm-evaluation-harness's registry (the optional `bench` extra), scored on the models already loaded.

Its tasks read their data sets through `datasets` (a task YAML can name local `data_files`); each task's headline
metric becomes one row beside the local tasks'.
"""

from __future__ import annotations

import importlib.util

from sftflow.tasks.eval.bench_result import TaskResult

# The metric reported for a task, the first of these it has; else its first numeric metric.
PREFERRED = ("exact_match,strict-match", "exact_match,flexible-extract", "exact_match,none", "acc,none")


def require_lm_eval() -> None:
    try:
        missing = importlib.util.find_spec("lm_eval") is None
    except ValueError:  # sys.modules holds None for it: its import is blocked
        missing = True
    if missing:
        raise ValueError(
            "bench.lm_eval_tasks: lm-evaluation-harness is not installed; pip install 'sftflow[bench]' (or list the "
            "tasks as local files in bench.tasks, which need nothing more)"
        )


def headline(metrics: dict) -> tuple[str, float]:
    """(name, value) of the metric a task is reported by."""
    for key in PREFERRED:
        if isinstance(metrics.get(key), (int, float)):
            return key.split(",")[0], float(metrics[key])
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and "stderr" not in key:
            return key.split(",")[0], float(value)
    raise ValueError(f"lm-eval reported no numeric metric: {sorted(metrics)}")


def run_lm_eval(models: dict, tokenizer, task_names: list[str], include: str | None = None) -> list[TaskResult]:
    """`task_names` scored on each model by lm-eval; `include`: a folder of task YAMLs of the user's."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = None
    if include:
        # Indexing lm-eval's own registry takes most of a minute: only when a task is not in the user's folder.
        tasks = TaskManager(include_path=include, include_defaults=False)
        if not set(task_names) <= set(tasks.all_tasks):
            tasks = TaskManager(include_path=include)
    per_model = {}
    for name, model in models.items():
        device = str(next(model.parameters()).device)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device=device)
        per_model[name] = simple_evaluate(model=lm, tasks=task_names, task_manager=tasks)
    results = []
    for task in task_names:
        scores, metric, items = {}, "", 0
        for name, out in per_model.items():
            metric, scores[name] = headline(out["results"][task])
            items = int(out.get("n-samples", {}).get(task, {}).get("effective", 0))
        results.append(TaskResult(name=task, kind="lm_eval", metric=metric, scores=scores, items=items))
    return results
