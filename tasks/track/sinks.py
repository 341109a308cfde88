"""One function per tracker: send a `RunRecord`, return where it went. Each imports its client only when used (the
`track` extra: `pip install 'sftflow[track]'`), and an unreachable server is found in seconds, not after the
clients' own minutes of retries. Given the run a live sender opened while training ran (`run_id`, or TensorBoard's
log dir), each adds to that run instead of making another; the `*_steps` helpers are what both write per step."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sftflow.tasks.track.config import CREDENTIAL_VARS, MLflowTarget, WandbTarget
from sftflow.tasks.track.record import RunRecord, table_markdown

REACH_TIMEOUT_S = 5.0


class TrackedRun(BaseModel):
    """Where one tracker holds the run: an id and a link (a URL, or a local folder), or why it could not."""

    model_config = ConfigDict(frozen=True)
    tracker: str
    ok: bool
    run_id: str | None = None
    url: str | None = None
    error: str | None = None
    model_version: str | None = None  # MLflow: the registered model version made of a promoted model
    target: str | None = None  # where it went (URI and experiment, project, folder): another target is sent anew


def _missing(package: str, tracker: str) -> ImportError:
    return ImportError(f"{tracker} tracking needs `{package}`: pip install 'sftflow[track]' (or {package})")


@contextlib.contextmanager
def scoped_env(**values: str) -> Iterator[None]:
    """Client settings read from the environment, for the calls inside: process-wide, so for one sender at a time
    (the live sender has stopped before the end-of-run send starts)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_key(key: str) -> str:
    """A step metric under `train/` in TensorBoard and W&B; the per-source and per-tag ones already are."""
    return key if key.startswith("train/") else f"train/{key}"


def check_reachable(uri: str) -> None:
    """An HTTP tracking server answers its health check within a few seconds, or `ConnectionError` says so."""
    if not uri.startswith(("http://", "https://")):
        return
    request = urllib.request.Request(f"{uri.rstrip('/')}/health")
    user, password = (os.environ.get(var) for var in CREDENTIAL_VARS)
    if user is not None:  # basic auth, as MLflow's client sends it
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=REACH_TIMEOUT_S) as response:
            response.read()
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConnectionError(f"MLflow at {uri} is not reachable ({reason})") from None


def mlflow_client(uri: str):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise _missing("mlflow", "MLflow") from None
    return MlflowClient(tracking_uri=uri)


def mlflow_experiment(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def mlflow_url(target: MLflowTarget, experiment_id: str, run_id: str) -> str:
    return f"{target.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_steps(
    client, run_id: str, rows: list[dict[str, float]], extra: dict[str, float] | None = None, extra_step: int = 0
) -> None:
    """One MLflow metric per key of each step row (and `extra` at `extra_step`), stamped with the time sent."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, row["step"]) for row in rows for key, value in row.items() if key != "step"]
    metrics += [Metric(key, value, now, extra_step) for key, value in (extra or {}).items()]
    for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run_id, metrics=metrics[i : i + 1000])


def to_mlflow(record: RunRecord, target: MLflowTarget, run_id: str | None = None) -> TrackedRun:
    check_reachable(target.uri)
    client = mlflow_client(target.uri)
    from mlflow.entities import Param, RunTag

    # The client's defaults retry a failing request for minutes; the run is over, a tracker must not hold it.
    with scoped_env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="2", MLFLOW_HTTP_REQUEST_TIMEOUT="60"):
        if run_id is None:
            experiment_id = mlflow_experiment(client, target.experiment)
            run_id = client.create_run(experiment_id, run_name=record.name, tags=record.tags).info.run_id
        else:  # the run the live sender opened: its tags are set, its steps so far logged
            experiment_id = client.get_run(run_id).info.experiment_id
        params = [Param(k, v[:6000]) for k, v in record.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id, params=params[i : i + 100])
        mlflow_steps(client, run_id, record.steps, record.eval_scalars(), extra_step=record.final_step)
        client.log_dict(run_id, record.eval_rows(), "eval/metrics.json")
        for image in record.images:
            client.log_artifact(run_id, str(image), "plots")
        if target.log_model and record.model_dir is not None:
            client.log_artifacts(run_id, str(record.model_dir), "model")
            client.log_batch(run_id, tags=[RunTag("sftflow.model", "model")])
        client.set_terminated(run_id)
        version = None
        if target.registered_model and record.promoted_as and record.model_dir is not None:
            try:
                version = _register_champion(client, target.registered_model, run_id, record.promoted_as)
            except Exception as err:  # noqa: BLE001 -- the run is sent; the next run retries the registration
                logging.getLogger("sftflow.track").warning(
                    "track: mlflow holds the run but could not register its model: %s", err
                )
    url = mlflow_url(target, experiment_id, run_id)
    return TrackedRun(tracker="mlflow", ok=True, run_id=run_id, url=url, model_version=version)


def register_in_mlflow(target: MLflowTarget, run_id: str, promoted_as: str) -> str:
    """Register the model of an MLflow run sent earlier (see `_register_champion`)."""
    check_reachable(target.uri)
    from mlflow.tracking import MlflowClient

    with scoped_env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="2", MLFLOW_HTTP_REQUEST_TIMEOUT="60"):
        return _register_champion(MlflowClient(tracking_uri=target.uri), target.registered_model, run_id, promoted_as)


def _register_champion(client, name: str, run_id: str, promoted_as: str) -> str:
    """A new version of registered model `name` from the run's uploaded model, with the alias `champion`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="sftflow models the promotion gate promoted")
    except MlflowException as err:
        if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    version = client.create_model_version(name, source, run_id=run_id, tags={"sftflow.registry_version": promoted_as})
    client.set_registered_model_alias(name, "champion", version.version)
    return str(version.version)


def tensorboard_writer(log_dir: Path):
    """A writer of one more event file in `log_dir`: TensorBoard reads all of a folder's files as one run."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise _missing("tensorboard", "TensorBoard") from None
    log_dir.mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir))


def tensorboard_steps(writer, rows: list[dict[str, float]]) -> None:
    for row in rows:
        for key, value in row.items():
            if key != "step":
                writer.add_scalar(train_key(key), value, row["step"])


def to_tensorboard(record: RunRecord, log_dir: Path) -> TrackedRun:
    writer = tensorboard_writer(log_dir)
    import matplotlib.image

    try:
        writer.add_text("config", table_markdown([{"key": k, "value": v} for k, v in record.params.items()]), 0)
        tensorboard_steps(writer, record.steps)
        for key, value in record.eval_scalars().items():
            writer.add_scalar(key, value, record.final_step)
        writer.add_text("eval", table_markdown(record.eval_rows()), record.final_step)
        for image in record.images:
            pixels = matplotlib.image.imread(str(image))[..., :3]  # RGBA floats in [0, 1] -> RGB
            writer.add_image(image.stem, pixels, record.final_step, dataformats="HWC")
    finally:
        writer.close()
    return TrackedRun(tracker="tensorboard", ok=True, run_id=log_dir.name, url=str(log_dir))


def wandb_init(
    target: WandbTarget,
    folder: Path,
    name: str,
    tags: dict[str, str],
    run_id: str | None = None,
    config: dict[str, str] | None = None,
):
    """A W&B run, or (`run_id`) the one the live sender opened, resumed. Offline, a resumed run is another local
    folder with the same id, which `wandb sync` uploads into that one run."""
    try:
        import wandb
    except ImportError:
        raise _missing("wandb", "Weights & Biases") from None
    folder.mkdir(parents=True, exist_ok=True)
    with scoped_env(WANDB_SILENT="true", WANDB_CONSOLE="off"):
        return wandb.init(
            project=target.project,
            entity=target.entity,
            mode=target.mode,
            dir=str(folder),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            tags=[f"{k}={v}"[:64] for k, v in tags.items() if k == "prefect.flow_run_id"],
            notes=tags.get("prefect.flow_run_url"),
        )


def wandb_url(run, target: WandbTarget) -> str:
    return run.url if target.mode == "online" else str(Path(run.dir).parent)


def wandb_steps(run, rows: list[dict[str, float]]) -> None:
    for row in rows:
        run.log({train_key(k): v for k, v in row.items() if k != "step"}, step=row["step"])


def to_wandb(record: RunRecord, target: WandbTarget, folder: Path, run_id: str | None = None) -> TrackedRun:
    run = wandb_init(target, folder, record.name, record.tags, run_id, config=record.params)
    import wandb  # present: wandb_init said otherwise

    with scoped_env(WANDB_SILENT="true", WANDB_CONSOLE="off"):
        try:
            wandb_steps(run, record.steps)
            run.summary.update(record.eval_scalars())
            rows = record.eval_rows()
            if rows:
                columns = list(rows[0])
                run.log({"eval/table": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])})
            for image in record.images:
                run.log({f"plots/{image.stem}": wandb.Image(str(image))})
            url = wandb_url(run, target)
            run_id = run.id
        finally:
            run.finish()
    return TrackedRun(tracker="wandb", ok=True, run_id=run_id, url=url)
