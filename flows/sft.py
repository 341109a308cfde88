"""The `sft` flow: sft-data → sft-plan → sft-train → sft-eval (→ sft-bench) (→ sft-promote) (→ track), each stage
also a flow of its own; `track` sends the finished run to the trackers the config names (its step metrics reach
them while it trains, `sftflow.tasks.track.live`). `sft-bench` runs where the config names benchmark tasks, and
`sft-check` first where `check.before_train` is set.

Every stage is cached on content: a rerun with the same inputs is Cached end to end; editing the chat template
reruns data and everything after it; changing only the learning rate reruns train and eval. `force` names stages to
recompute regardless. A failed train stage resumes from its last checkpoint on the next attempt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import BaseModel, ConfigDict

from sftflow.flows.bench import sft_bench
from sftflow.flows.check import sft_check
from sftflow.flows.config import SFTConfig, bench_config, resolve_config, with_shorthands
from sftflow.flows.data import DataResult, sft_data
from sftflow.flows.eval import sft_eval
from sftflow.flows.plan import sft_plan
from sftflow.flows.promote import sft_promote
from sftflow.flows.results import work_dir_lock
from sftflow.flows.run_page import loss_curve_artifact, progress_in_parent_log, stage_links_markdown
from sftflow.flows.train import sft_train
from sftflow.tasks.core.manifests import BenchReport, EvalReport, PromoteResult, TrainResult
from sftflow.tasks.plan.manifest import PlanManifest
from sftflow.tasks.track.sinks import TrackedRun
from sftflow.tasks.track.stage import track_task

STAGES = ("data", "plan", "train", "eval", "bench")


class SFTResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: DataResult
    plan: PlanManifest
    train: TrainResult
    eval: EvalReport
    bench: BenchReport | None = None
    promotion: PromoteResult | None = None
    tracking: list[TrackedRun] = []


@flow(name="sft", log_prints=True)
def sft(
    config_path: str | None = None,
    config: SFTConfig | None = None,
    overrides: dict[str, Any] | None = None,
    learning_rate: float | None = None,
    max_steps: int | None = None,
    epochs: int | None = None,
    force: list[str] | None = None,
    promote: bool = False,
) -> SFTResult:
    """Conversations + base model → fine-tuned, evaluated checkpoint.

    `config_path` (YAML) or `config` (inline) is the whole configuration; `overrides` sets any field of it by its
    dotted key, as the CLI's `--set` does (`-p overrides='{"train.optimizer.lr": 1e-5}'`). `learning_rate`,
    `max_steps` and `epochs` are shorthands of `train.optimizer.lr`, `train.max_steps` and `plan.epochs`
    (`-p learning_rate=1e-5`). `force` lists stages to recompute. `promote` ends with the promotion gate
    (`sft-promote`): the new model replaces the registry's champion only if it beats it on the same eval documents.
    """
    force = list(force or [])
    unknown = sorted(set(force) - set(STAGES))
    if unknown:
        raise ValueError(f"force: unknown stage(s) {unknown}; expected some of {list(STAGES)}")
    shorthands = {"learning_rate": learning_rate, "max_steps": max_steps, "epochs": epochs}
    cfg = resolve_config(config_path, config, with_shorthands(overrides, **shorthands))
    with work_dir_lock(Path(cfg.work_dir).resolve()):
        if cfg.check.before_train:  # a gate, not a stage: it runs each time, and a failed check stops the run here
            sft_check(config=cfg)
        data = sft_data(config=cfg, force="data" in force)
        plan = sft_plan(config=cfg, force="plan" in force, data=data)
        with progress_in_parent_log():
            trained = sft_train(config=cfg, force="train" in force, data=data, plan=plan, end_tracking=False)
        report = sft_eval(config=cfg, force="eval" in force, data=data, train=trained)
        bench = None
        if bench_config(cfg).enabled:
            bench = sft_bench(config=cfg, force="bench" in force, data=data, train=trained)
        promotion = sft_promote(config=cfg, data=data, train=trained, bench=bench) if promote else None
        tracking = []
        if cfg.track.enabled:
            tracking = track_task(
                cfg.track, cfg.model_dump(mode="json"), trained, report, cfg.work_dir, promotion, bench
            )
    result = SFTResult(
        data=data, plan=plan, train=trained, eval=report, bench=bench, promotion=promotion, tracking=tracking
    )
    from prefect.artifacts import create_markdown_artifact

    # On the parent run, where a deployment's run page opens: the stage runs carry the details.
    loss_curve_artifact(report.plot_path)
    summary = summary_markdown(result) + "\n\n## Stage runs\n\n" + "\n".join(stage_links_markdown())
    create_markdown_artifact(summary, key="sft-summary", description="sft: data, plan, train, eval")
    return result


def summary_markdown(result: SFTResult) -> str:
    """The run at a glance: what each stage made, the eval table and the loss curve (inline: the UI renders a data:
    URL image in markdown, checked in headless Chromium by tests/deployments)."""
    import base64

    from sftflow.tasks.eval.report import source_rows

    s, t, m = result.plan.stats, result.train, result.eval.metrics
    lines = [
        "# sft",
        "",
        f"- data: {result.data.index.num_train} train / {result.data.index.num_eval} eval documents, "
        f"{result.data.index.num_train_tokens} train tokens",
        f"- plan: {s.num_steps} steps, packing efficiency {s.efficiency:.1%}",
        f"- train: {t.steps} steps, final loss {t.final_loss}, model `{t.hf_dir}`",
        "",
        "| model | loss | perplexity | token accuracy | exact match |",
        "|---|---|---|---|---|",
    ]
    for name, row in m.items():
        exact = "n/a" if row.exact_match is None else f"{row.exact_match:.1%}"
        lines.append(f"| {name} | {row.loss:.4f} | {row.perplexity:.2f} | {row.token_accuracy:.1%} | {exact} |")
    if len(s.sources) > 1:
        lines += ["", "| source | planned share (asked) | document visits |", "|---|---|---|"]
        lines += [
            f"| {src.name} | {src.planned_share:.1%} ({src.requested_share:.1%}) | {src.planned_docs} of {src.docs} |"
            for src in s.sources
        ]
    for by in ("source", "tag"):
        rows = source_rows(m, by=by)
        if rows:
            lines += ["", *rows]
    if result.bench is not None:
        from sftflow.tasks.eval.bench_stage import summary_rows

        lines += ["", *summary_rows(result.bench)]
    plot = result.eval.plot_path
    if plot and Path(plot).is_file():
        image = base64.b64encode(Path(plot).read_bytes()).decode()
        lines += ["", f"![loss curve](data:image/png;base64,{image})"]
    lines += ["", f"Report: `{result.eval.markdown_path}`"]
    for t in result.tracking:
        lines += ["", f"Tracked in {t.tracker}: {t.url}" if t.ok else f"Not tracked in {t.tracker}: {t.error}"]
    if result.promotion is not None:
        p = result.promotion
        lines += ["", f"Promotion: **{p.decision}**, champion `{p.champion}`", *[f"- {r}" for r in p.reasons]]
    return "\n".join(lines)
