"""Which trackers a run is sent to (`track:` in the run config)."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def without_credentials(uri: str) -> tuple[str, tuple[str, str] | None]:
    """`uri` without a `user:password@` part, and that part (unquoted), or None."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return bare, (urllib.parse.unquote(user), urllib.parse.unquote(password))


class MLflowTarget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    uri: str = Field(
        description="tracking server URI (http://host:5000) or a local store (file:, sqlite:); credentials go in "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (a URI's user:password@ is moved there)"
    )
    experiment: str = Field("sftflow", description="MLflow experiment name")
    log_model: bool = Field(False, description="also upload the exported Hugging Face folder as the run's model")
    registered_model: str | None = Field(
        None,
        description="MLflow model registry name: a model the promotion gate promotes becomes a new version of it, "
        "with the alias `champion` (needs log_model)",
    )

    @field_validator("uri")
    @classmethod
    def _credentials_to_the_environment(cls, uri: str) -> str:
        # A password in the URI would be written wherever the config is: logs, track.json, TensorBoard's text, the
        # Prefect database (flow-run parameters, events). MLflow reads basic-auth credentials from these variables,
        # so they move there, for this process and the ones it starts, and the URI keeps only the server.
        bare, credentials = without_credentials(uri)
        if credentials is not None:
            for var, value in zip(CREDENTIAL_VARS, credentials, strict=True):
                os.environ[var] = value
        return bare

    @model_validator(mode="after")
    def _registry_needs_the_model(self):
        if self.registered_model and not self.log_model:
            raise ValueError("track.mlflow.registered_model needs log_model: true (the registry versions the upload)")
        return self


class WandbTarget(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    project: str = Field("sftflow", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user)")
    mode: Literal["online", "offline"] = Field("online", description="offline: write locally, `wandb sync` later")


class TrackConfig(BaseModel):
    """`track: {mlflow: {uri, experiment}, tensorboard: true, wandb: {project, mode}}`; none set means no tracking."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    mlflow: MLflowTarget | None = Field(None, description="log to an MLflow server")
    tensorboard: bool = Field(False, description="event files under WORK_DIR/tensorboard/<run>")
    wandb: WandbTarget | None = Field(None, description="log to Weights & Biases")
    live: bool = Field(True, description="send step metrics while training runs, not only when the run ends")
    live_every_s: float = Field(15.0, gt=0, description="seconds between two live sends of the new steps")

    @property
    def enabled(self) -> bool:
        return self.mlflow is not None or self.tensorboard or self.wandb is not None

    def targets(self, work_dir: Path) -> dict[str, str]:
        """Where each configured tracker sends, spelled as `track.json` and `live_track.json` record it: a run held
        at another target is not the one this config would continue."""
        targets = {}
        if self.mlflow is not None:
            targets["mlflow"] = f"{self.mlflow.uri} (experiment {self.mlflow.experiment})"
        if self.tensorboard:
            targets["tensorboard"] = str(work_dir / "tensorboard")
        if self.wandb is not None:
            targets["wandb"] = f"project {self.wandb.entity or ''}/{self.wandb.project} ({self.wandb.mode})"
        return targets
