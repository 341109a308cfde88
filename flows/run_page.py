"""What the `sft` run's page in Prefect's UI shows, where `prefect deployment run sft/full` sends people.

The stage flows (`sft-data`, `sft-plan`, `sft-train`, `sft-eval`) are subflow runs with pages, logs and artifacts of
their own, which the parent's page does not show. So the parent run gets:

- its training progress: `progress_in_parent_log()` copies the train task's step lines into the parent's log (the
  task logs them at a bounded rate: `sftflow.tasks.train.progress_log`), so `--watch` and the parent's Logs tab
  show them;
- the loss curve as an image artifact (`loss_curve_artifact`);
- links from its summary to every stage run and to each artifact those runs made (`stage_links_markdown`).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from sftflow.tasks.train.progress_log import PROGRESS_LINE


class _ProgressToParent(logging.Handler):
    """Re-sends the train task's progress lines, logged on the thread that runs the parent flow, as the parent run's
    logs. They go to the API only: the terminal already shows the task's own line."""

    def __init__(self, flow_run_id: UUID):
        from prefect.logging.handlers import APILogHandler

        super().__init__()
        self.flow_run_id = flow_run_id
        self.thread = threading.get_ident()
        self.api = APILogHandler()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:  # another flow run of the same process
            return
        if PROGRESS_LINE.match(record.getMessage()) is None:
            return
        copy = logging.makeLogRecord(record.__dict__)
        copy.name, copy.flow_run_id, copy.task_run_id = "prefect.flow_runs", self.flow_run_id, None
        # Named after the stage; and `prefect ... --watch` prints through rich, which would eat "[train]" as markup.
        copy.msg, copy.args = "sft-train " + record.getMessage().removeprefix("[train] "), None
        self.api.handle(copy)


@contextmanager
def progress_in_parent_log() -> Iterator[None]:
    """Inside a flow run: copy the training progress that runs below it log into its own log."""
    flow_run_id = current_flow_run_id()
    if flow_run_id is None:
        yield
        return
    handler = _ProgressToParent(flow_run_id)
    task_logs = logging.getLogger("prefect.task_runs")
    task_logs.addHandler(handler)
    try:
        yield
    finally:
        task_logs.removeHandler(handler)


def loss_curve_artifact(plot_path: str | None) -> UUID | None:
    """The loss-curve PNG as an image artifact. The UI shows an image artifact as `<img src=URL>`, and the PNG lies
    on the machine that ran the flow, which the browser cannot reach: a `data:` URL carries the image itself."""
    if plot_path is None or not Path(plot_path).is_file():
        return None
    from prefect.artifacts import create_image_artifact

    encoded = base64.b64encode(Path(plot_path).read_bytes()).decode()
    return create_image_artifact(
        image_url=f"data:image/png;base64,{encoded}", key="sft-loss-curve", description="training and held-out loss"
    )


def current_flow_run_id():
    """The id of the flow run this code runs in, or None outside one."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return None if context is None or context.flow_run is None else context.flow_run.id


def record_cancelled_tasks() -> None:
    """When this flow run is being cancelled, record its Crashed task runs as Cancelled.

    Prefect's task engine reports a task that a termination signal interrupted as Crashed, whatever sent the signal;
    the flow engine tells a cancel from a crash afterwards, but only for the flow run. A training run stopped by a
    cancel was not a crash, and its page should say so."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    flow_run_id = current_flow_run_id()
    if flow_run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            if not _being_cancelled(client, flow_run_id):
                return  # a crash, or the machine shutting down: Crashed is the truth
            crashed = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.CRASHED]))
                ),
            )
            for run in crashed:
                client.set_task_run_state(run.id, Cancelled(message="cancelled with its flow run"), force=True)
    except Exception as err:  # noqa: BLE001 -- the cancel goes on; only the task's recorded state is at stake
        logging.getLogger("sftflow.train").warning(
            "sft-train: could not record the cancelled task runs as Cancelled: %s", err
        )


def _being_cancelled(client, flow_run_id) -> bool:
    """Whether this flow run or one of its parents (a cancel lands on the run a user cancelled) is Cancelling."""
    from prefect.client.schemas.objects import StateType

    while flow_run_id is not None:
        run = client.read_flow_run(flow_run_id)
        if run.state_type in (StateType.CANCELLING, StateType.CANCELLED):
            return True
        parent_task = run.parent_task_run_id
        flow_run_id = client.read_task_run(parent_task).flow_run_id if parent_task is not None else None
    return False


def stage_links_markdown() -> list[str]:
    """Markdown lines linking to each subflow run of the current flow run and to the artifacts each one made
    (its tasks' included); empty outside a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.settings import PREFECT_UI_URL

    flow_run_id = current_flow_run_id()
    if flow_run_id is None:
        return []
    ui = (PREFECT_UI_URL.value() or "").rstrip("/")
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])),
            sort=FlowRunSort.START_TIME_ASC,
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id for run in children]))
        )
        flow_names = {flow_id: client.read_flow(flow_id).name for flow_id in {run.flow_id for run in children}}
    by_run: dict[UUID, list] = {}
    for artifact in artifacts:
        by_run.setdefault(artifact.flow_run_id, []).append(artifact)
    lines = []
    for run in children:
        state = run.state.name if run.state else "unknown"
        made = [
            _link(artifact.key or artifact.type or "artifact", ui, f"artifacts/artifact/{artifact.id}")
            for artifact in sorted(by_run.get(run.id, []), key=lambda a: a.key or "")
        ]
        line = f"- {_link(flow_names[run.flow_id], ui, f'runs/flow-run/{run.id}')} ({state})"
        lines.append(line + (": " + ", ".join(made) if made else ""))
    return lines


def _link(text: str, ui: str, path: str) -> str:
    return f"[{text}]({ui}/{path})" if ui else f"`{text}`"
