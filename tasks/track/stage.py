"""The `track` Prefect task: send a finished run (config, step metrics, eval, plots, model) to the configured trackers.

Tracking never fails a run: a tracker that cannot be reached, or whose client is not installed, is a warning naming
it, and the other trackers still get the run. A run is sent once per tracker and target:
`WORK_DIR/track/<key>/track.json` (keyed by the trained model and the eval report) records what each tracker holds
and where, so a cached rerun of the pipeline sends nothing twice, one whose tracker was down retries that tracker
only, and turning on another tracker sends to that one alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.fingerprint import sha256_json
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.core.manifests import EvalReport, PromoteResult, TrainResult
from sftflow.tasks.track.config import TrackConfig
from sftflow.tasks.track.record import RunRecord, flatten, step_rows
from sftflow.tasks.track.sinks import TrackedRun, register_in_mlflow, to_mlflow, to_tensorboard, to_wandb
from sftflow.tasks.train.metrics import read_metrics


def prefect_tags() -> dict[str, str]:
    """The current Prefect flow run, for the tracker to link back to."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return {}
    from prefect.runtime import flow_run

    tags = {"prefect.flow_run_id": str(context.flow_run.id), "prefect.flow_run_name": context.flow_run.name}
    url = flow_run.ui_url  # None when no UI URL is configured
    if url:
        tags["prefect.flow_run_url"] = str(url)
    return tags


def run_record(
    config: dict,
    train: TrainResult,
    report: EvalReport,
    name: str,
    tags: dict[str, str],
    promotion: PromoteResult | None = None,
) -> RunRecord:
    images = [Path(p) for p in (report.plot_path, str(Path(report.path).parent / "source_loss.png")) if p]
    return RunRecord(
        name=name,
        params=flatten(config),
        steps=step_rows(read_metrics(train.metrics_path)) if train.metrics_path else [],
        eval=dict(report.metrics),
        final_step=train.steps,
        images=[p for p in images if p.is_file()],
        model_dir=Path(train.hf_dir) if train.hf_dir else None,
        tags=tags,
        # "unchanged": the candidate already is the champion, promoted by an earlier gate (perhaps untracked then).
        promoted_as=promotion.champion if promotion is not None and promotion.decision != "kept" else None,
    )


def send(record: RunRecord, config: TrackConfig, work_dir: Path, done: dict[str, TrackedRun]) -> list[TrackedRun]:
    """Every configured tracker not already in `done` gets the run; a failure is a warning and a `TrackedRun` with
    `ok=False`."""
    targets = []
    if config.mlflow is not None:
        where = f"{config.mlflow.uri} (experiment {config.mlflow.experiment})"
        targets.append(("mlflow", where, lambda: to_mlflow(record, config.mlflow)))
    if config.tensorboard:
        log_dir = work_dir / "tensorboard" / record.name
        targets.append(("tensorboard", str(log_dir), lambda: to_tensorboard(record, log_dir)))
    if config.wandb is not None:
        where = f"project {config.wandb.entity or ''}/{config.wandb.project} ({config.wandb.mode})"
        targets.append(("wandb", where, lambda: to_wandb(record, config.wandb, work_dir / "wandb")))
    results = []
    for tracker, where, send_one in targets:
        earlier = done.get(tracker)
        if earlier is not None and earlier.ok and earlier.target == where:
            results.append(_registered_later(earlier, record, config))
            continue
        try:
            results.append(send_one().model_copy(update={"target": where}))
        except Exception as err:  # noqa: BLE001 -- a tracker's failure must never fail the training run
            message = f"{type(err).__name__}: {err}".splitlines()[0]
            stage_logger("sftflow.track").warning("track: %s at %s did not get this run: %s", tracker, where, message)
            results.append(TrackedRun(tracker=tracker, ok=False, error=message, target=where))
    return results


def _registered_later(done: TrackedRun, record: RunRecord, config: TrackConfig) -> TrackedRun:
    """An MLflow run sent before the gate promoted its model (a later gate run) gets its registry version now."""
    target = config.mlflow
    if done.tracker != "mlflow" or done.model_version or not (target and target.registered_model):
        return done
    if not record.promoted_as:
        return done
    try:
        version = register_in_mlflow(target, done.run_id, record.promoted_as)
    except Exception as err:  # noqa: BLE001 -- as for any tracker failure: a warning, and the next run retries
        stage_logger("sftflow.track").warning("track: mlflow could not register the promoted model: %s", err)
        return done
    return done.model_copy(update={"model_version": version})


def track_run(
    config: TrackConfig,
    run_config: dict,
    train: TrainResult,
    report: EvalReport,
    work_dir: str | Path,
    promotion: PromoteResult | None = None,
) -> list[TrackedRun]:
    work_dir = Path(work_dir)
    # Keyed by what is sent, not by where: turning another tracker on sends to that one alone.
    key = sha256_json({"model": train.hf_sha256 or train.run_dir, "eval": report.sha256})[:24]
    out = work_dir / "track" / key
    state = out / "track.json"
    done = {}
    if state.is_file():
        done = {r["tracker"]: TrackedRun(**r) for r in json.loads(state.read_text())}
    name = f"sftflow-{Path(train.run_dir).name}-{key[:8]}"
    record = run_record(run_config, train, report, name, prefect_tags(), promotion)
    tracked = send(record, config, work_dir, done)
    # Trackers no longer configured keep their entries, so turning one off and on again sends nothing twice.
    kept = {t.tracker for t in tracked}
    state_rows = [t.model_dump() for t in tracked] + [d.model_dump() for name, d in done.items() if name not in kept]
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(state, json.dumps(state_rows, indent=2))
    return tracked


@task(name="track")
def track_task(
    config: TrackConfig,
    run_config: dict,
    train: TrainResult,
    report: EvalReport,
    work_dir: str,
    promotion: PromoteResult | None = None,
) -> list[TrackedRun]:
    from prefect.artifacts import create_markdown_artifact

    tracked = track_run(config, run_config, train, report, work_dir, promotion)
    lines = ["# Tracked", ""]
    for t in tracked:
        where = f"[{t.url}]({t.url})" if t.url and t.url.startswith("http") else f"`{t.url}`"
        lines.append(f"- {t.tracker}: {where}" if t.ok else f"- {t.tracker}: not tracked ({t.error})")
        if t.model_version:
            lines.append(f"  - registered model version {t.model_version}, alias `champion`")
    create_markdown_artifact("\n".join(lines), key="sft-tracking", description="where this run is tracked")
    return tracked
