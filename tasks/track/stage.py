"""The `track` Prefect task: send a finished run (config, step metrics, eval, plots, model) to the configured trackers.

Tracking never fails a run: a tracker that cannot be reached, or whose client is not installed, is a warning naming
it, and the other trackers still get the run. A run is sent once per tracker and target:
`WORK_DIR/track/<key>/track.json` (keyed by the trained model and the eval report) records what each tracker holds
and where, so a cached rerun of the pipeline sends nothing twice, one whose tracker was down retries that tracker
only, and turning on another tracker sends to that one alone.

Where live tracking opened a tracker run while the model trained (`sftflow.tasks.track.live`, recorded in
`run_dir/live_track.json`), the send completes that run with what it lacks (the steps after the last one it holds,
the config, eval, plots and model) rather than making another.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from prefect import task

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.fingerprint import sha256_json
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.core.manifests import BenchReport, EvalReport, PromoteResult, TrainResult
from sftflow.tasks.track.config import TrackConfig
from sftflow.tasks.track.live import LiveRun, read_live_runs, write_live_runs
from sftflow.tasks.track.prefect_link import prefect_tags
from sftflow.tasks.track.record import RunRecord, flatten, step_rows
from sftflow.tasks.track.sinks import TrackedRun, register_in_mlflow, to_mlflow, to_tensorboard, to_wandb
from sftflow.tasks.train.metrics import read_metrics


def run_record(
    config: dict,
    train: TrainResult,
    report: EvalReport,
    name: str,
    tags: dict[str, str],
    promotion: PromoteResult | None = None,
    bench: BenchReport | None = None,
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
        bench=dict(bench.tasks) if bench is not None else {},
    )


def send(
    record: RunRecord,
    config: TrackConfig,
    work_dir: Path,
    done: dict[str, TrackedRun],
    live: dict[str, LiveRun] | None = None,
) -> list[TrackedRun]:
    """Every configured tracker not already in `done` gets the run, into its open run in `live` if it has one; a
    failure is a warning and a `TrackedRun` with `ok=False`."""
    results = []
    for tracker, where in config.targets(work_dir).items():
        earlier = done.get(tracker)
        if earlier is not None and earlier.ok and _same_target(tracker, earlier.target, where):
            results.append(_registered_later(earlier, record, config))
            continue
        opened = (live or {}).get(tracker)
        if opened is not None and (opened.closed or opened.target != where):
            opened = None  # complete, or at another target: this send is a run of its own
        try:
            results.append(_send_one(tracker, record, config, work_dir, opened).model_copy(update={"target": where}))
        except Exception as err:  # noqa: BLE001 -- a tracker's failure must never fail the training run
            message = f"{type(err).__name__}: {err}".splitlines()[0]
            stage_logger("sftflow.track").warning("track: %s at %s did not get this run: %s", tracker, where, message)
            results.append(TrackedRun(tracker=tracker, ok=False, error=message, target=where))
    return results


def _same_target(tracker: str, held: str | None, where: str) -> bool:
    """Whether a run recorded at `held` is at `where`. TensorBoard runs were once recorded by their own folder
    under the tensorboard folder, not by the folder itself: those count as there, so nothing is sent twice."""
    if held == where:
        return True
    return tracker == "tensorboard" and held is not None and Path(held).parent == Path(where)


def _send_one(tracker: str, record: RunRecord, config: TrackConfig, work_dir: Path, opened: LiveRun | None):
    run_id = None
    if opened is not None:  # the live run: only the steps it does not hold yet
        record = replace(record, steps=[row for row in record.steps if row["step"] > opened.sent_through])
        run_id = opened.run_id
    if tracker == "mlflow":
        return to_mlflow(record, config.mlflow, run_id)
    if tracker == "tensorboard":
        return to_tensorboard(record, work_dir / "tensorboard" / (run_id or record.name))
    return to_wandb(record, config.wandb, work_dir / "wandb", run_id)


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
    bench: BenchReport | None = None,
) -> list[TrackedRun]:
    work_dir = Path(work_dir)
    # Keyed by what is sent, not by where: turning another tracker on sends to that one alone.
    sent = {"model": train.hf_sha256 or train.run_dir, "eval": report.sha256}
    key = sha256_json(sent if bench is None else {**sent, "bench": bench.sha256})[:24]
    out = work_dir / "track" / key
    state = out / "track.json"
    done = {}
    if state.is_file():
        done = {r["tracker"]: TrackedRun(**r) for r in json.loads(state.read_text())}
    name = f"sftflow-{Path(train.run_dir).name}-{key[:8]}"
    record = run_record(run_config, train, report, name, prefect_tags(), promotion, bench)
    live = read_live_runs(train.run_dir)
    tracked = send(record, config, work_dir, done, live)
    # A live run this send completed holds the whole training run now: a later send (another eval) is a run of its
    # own, as it would be without live tracking.
    completed = {
        t.tracker: live[t.tracker].model_copy(
            update={"closed": True, "sent_through": max(train.steps, live[t.tracker].sent_through)}
        )
        for t in tracked
        if t.ok and t.tracker in live and not live[t.tracker].closed and t.run_id == live[t.tracker].run_id
    }
    if completed:
        write_live_runs(train.run_dir, {**live, **completed})
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
    bench: BenchReport | None = None,
) -> list[TrackedRun]:
    from prefect.artifacts import create_markdown_artifact

    tracked = track_run(config, run_config, train, report, work_dir, promotion, bench)
    lines = ["# Tracked", ""]
    for t in tracked:
        where = f"[{t.url}]({t.url})" if t.url and t.url.startswith("http") else f"`{t.url}`"
        lines.append(f"- {t.tracker}: {where}" if t.ok else f"- {t.tracker}: not tracked ({t.error})")
        if t.model_version:
            lines.append(f"  - registered model version {t.model_version}, alias `champion`")
    create_markdown_artifact("\n".join(lines), key="sft-tracking", description="where this run is tracked")
    return tracked
