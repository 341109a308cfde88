"""The `bench` stage task: the tuned model (and the base, and the registry's champion) on benchmark tasks, with a
report, samples and artifacts.

Cached on the models' content hashes, the task files' contents and settings, the tokenizer, the chat template text
and the code, so a rerun with nothing changed is Cached and editing one task file reruns the stage.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.caching import StageCache, retry_on_io_error
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.manifests import BenchReport, BenchTaskScores, ModelRef, TokenizerRef
from sftflow.tasks.core.stage import stage_task
from sftflow.tasks.eval.bench import run_bench
from sftflow.tasks.eval.bench_config import BenchTaskFile, LmEvalTasks
from sftflow.tasks.eval.bench_result import TaskResult


def bench_run(
    tuned: ModelRef,
    base: ModelRef | None,
    tokenizer_path: str,
    chat_template: str | None,
    vocab_size: int | None,
    tasks: list[BenchTaskFile],
    lm_eval: LmEvalTasks | None = None,
    champion: ModelRef | None = None,
) -> list[TaskResult]:
    """Load the models and score them on every task: the local files here, `lm_eval`'s through lm-eval."""
    from transformers import AutoTokenizer

    from sftflow.tasks.data.chat_template import ChatTemplate
    from sftflow.tasks.eval.stage import load_model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    template = None
    if chat_template is not None:
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        template = ChatTemplate(chat_template, special, name="the data's chat template")
    models = {}
    if base is not None:
        models["base"] = load_model(base, vocab_size)
    models["tuned"] = load_model(tuned, vocab_size)
    if champion is not None:
        models["champion"] = load_model(champion, vocab_size)
    results = run_bench(models, tokenizer, template, tasks)
    if lm_eval is not None:
        from sftflow.tasks.eval.bench_lm_eval import run_lm_eval

        results += run_lm_eval(models, tokenizer, lm_eval.names, lm_eval.include)
    return results


def score_rows(tasks: dict[str, BenchTaskScores]) -> list[str]:
    """A markdown table of every task's score per model, with the tuned model's gain over the base in points and the
    mean over the tasks."""
    models = list(next(iter(tasks.values())).scores)
    delta = "base" in models and "tuned" in models
    head = ["task", "metric", "items", *models] + (["Δ points"] if delta else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    means = {m: sum(t.scores[m] for t in tasks.values()) / len(tasks) for m in models}
    rows = [(name, t.metric, str(t.items), t.scores) for name, t in tasks.items()] + [("**mean**", "", "", means)]
    for name, metric, items, scores in rows:
        row = [name, metric, items, *(f"{scores[m]:.1%}" for m in models)]
        if delta:
            row.append(f"{100 * (scores['tuned'] - scores['base']):+.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def subset_rows(results: list[TaskResult]) -> list[str]:
    """A markdown table of each task's score per subset and model (tasks whose items name a subset); none without."""
    with_subsets = [r for r in results if r.subsets]
    if not with_subsets:
        return []
    models = list(with_subsets[0].scores)
    delta = "base" in models and "tuned" in models
    head = ["task", "subset", "items", *models] + (["Δ points"] if delta else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in with_subsets:
        for subset, group in r.subsets.items():
            scores = group["scores"]
            row = [r.name, subset, str(group["items"]), *(f"{scores[m]:.1%}" for m in models)]
            if delta:
                row.append(f"{100 * (scores['tuned'] - scores['base']):+.1f}")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def subset_table(results: list[TaskResult]) -> list[dict]:
    return [
        {"task": r.name, "subset": subset, "items": group["items"], **group["scores"]}
        for r in results
        for subset, group in r.subsets.items()
    ]


def plot_scores(tasks: dict[str, BenchTaskScores], out_png: Path) -> Path:
    """Bars of each task's score, one per model side by side."""
    import numpy as np

    from sftflow.tasks.eval.report import _figure, _save

    names = list(tasks)
    models = list(next(iter(tasks.values())).scores)
    fig, ax = _figure(width=max(5, 1.2 * len(names) + 2))
    width = 0.8 / len(models)
    x = np.arange(len(names))
    for k, model in enumerate(models):
        ax.bar(x + k * width, [100 * tasks[n].scores[model] for n in names], width, label=model)
    ax.set_xticks(x + width * (len(models) - 1) / 2, names, rotation=20, ha="right")
    ax.set_ylabel("score (%)")
    ax.set_ylim(0, 100)
    return _save(fig, ax, "sftflow: benchmark tasks", out_png, axis="y")


def summary_rows(report: BenchReport) -> list[str]:
    return ["Benchmarks:", "", *score_rows(report.tasks)]


def report_markdown(
    tasks: dict[str, BenchTaskScores], results: list[TaskResult], chat_template: str | None, plot: Path | None = None
) -> str:
    lines = ["# sft-bench", "", *score_rows(tasks), ""]
    by_subset = subset_rows(results)
    if by_subset:
        lines += ["## By subset", "", *by_subset, ""]
    if plot is not None:
        lines += [f"Scores plot: `{plot}`", ""]
    for r in results:
        if r.prompt_example:
            lines += [f"Prompt of `{r.name}`'s first item:", "", "```", r.prompt_example, "```", ""]
    lines.append("Chat template: the data's" if chat_template is not None else "Chat template: none (plain text)")
    return "\n".join(lines) + "\n"


def table_rows(results: list[TaskResult]) -> list[dict]:
    return [{"task": r.name, "metric": r.metric, "items": r.items, **r.scores} for r in results]


BENCH_CACHE = StageCache(stage="bench", version="1", entries=(__name__,))


@stage_task(BENCH_CACHE, name="bench", retries=1, retry_delay_seconds=1, retry_condition_fn=retry_on_io_error)
def bench_task(
    out_dir: Path,
    tuned: ModelRef,
    base: ModelRef | None,
    tokenizer: TokenizerRef,
    chat_template: str | None,
    vocab_size: int | None,
    tasks: list[BenchTaskFile],
    lm_eval: LmEvalTasks | None,
    champion: ModelRef | None,
    work_dir: str,
) -> BenchReport:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    results = bench_run(tuned, base, tokenizer.path, chat_template, vocab_size, tasks, lm_eval, champion)
    samples = out_dir / "samples.jsonl"
    write_atomic(
        samples,
        "".join(json.dumps({"task": r.name, **s}, ensure_ascii=False) + "\n" for r in results for s in r.samples),
    )
    report = out_dir / "report.json"
    body = {
        "tasks": [{k: v for k, v in vars(r).items() if k != "samples"} for r in results],
        "task_files": [{"name": f.task.name, "path": f.path, "sha256": f.sha256} for f in tasks],
        "chat_template": chat_template,
    }
    write_atomic(report, json.dumps(body, indent=2, ensure_ascii=False))
    scores = {r.name: BenchTaskScores(metric=r.metric, items=r.items, scores=r.scores) for r in results}
    plot = plot_scores(scores, out_dir / "bench.png")
    markdown = report_markdown(scores, results, chat_template, plot)
    write_atomic(out_dir / "report.md", markdown)
    # The artifact shows the plot inline (Prefect's UI cannot open a path on the runner); report.md names the file.
    inline = f"\n![benchmark scores](data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()})\n"
    create_markdown_artifact(
        markdown + inline, key="sft-bench-report", description="base vs tuned on the benchmark tasks"
    )
    create_table_artifact(table_rows(results), key="sft-bench-scores", description="benchmark scores by task")
    if any(r.subsets for r in results):
        create_table_artifact(subset_table(results), key="sft-bench-subsets", description="benchmark scores by subset")
    models = {"tuned": tuned.sha256}
    if base is not None:
        models = {"base": base.sha256, **models}
    if champion is not None:
        models["champion"] = champion.sha256
    return BenchReport(
        path=str(report),
        sha256=sha256_file(report),
        tasks=scores,
        models=models,
        markdown_path=str(out_dir / "report.md"),
        samples_path=str(samples),
        plot_path=str(plot),
    )
