"""The train task on Prefect's real engine: a worker is SIGKILLed after a checkpoint, Prefect retries the task, the
retry resumes from `latest`, and the final weights are bit-identical to an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from sftflow.tasks.core.manifests import TrainResult
from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.launch import train
from sftflow.tasks.train.stage import train_task
from tests.flows.conftest import run_counts
from tests.tasks.train_helpers import losses, metrics, planned_mock, read_safetensors

pytestmark = pytest.mark.slow


def _train_flow():
    from prefect import flow

    @flow(name="train-resume-test")
    def train_flow(config: TrainConfig) -> TrainResult:
        return train_task.with_options(retries=1, retry_delay_seconds=0)(config)

    return train_flow


def test_killed_worker_is_retried_and_resumes_bit_identically(
    tmp_path, tiny_tokenizer, tiny_tokenizer_dir, inject_crash
):
    config, _, arrays = planned_mock(
        tmp_path,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=2, tokens_per_rank=64, micro_batches_per_step=2),
        out=str(tmp_path / "reference"),
        nproc=2,
        export=True,
        checkpoint=dict(every=4),
    )
    train(config)

    crashed = tmp_path / "crashed"
    inject_crash("crash_after_step=6")  # rank 1 SIGKILLs itself after step 6, once
    state = _train_flow()(config.model_copy(update={"out": str(crashed)}), return_state=True)

    assert state.is_completed(), state
    assert (crashed / "fault-fired").is_file()
    assert sum(run_counts(state).values(), []) == [2]  # the one task run failed once and was retried once
    assert [r["step"] for r in metrics(crashed)] == list(range(1, arrays.num_steps + 1))
    assert losses(crashed) == losses(tmp_path / "reference")
    want = read_safetensors(tmp_path / "reference" / "hf" / "model.safetensors")
    got = read_safetensors(crashed / "hf" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert _artifact_keys(state) >= {"train-progress", "train-metrics"}


def _artifact_keys(flow_state) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_run_id = flow_state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key for a in artifacts if a.key}
