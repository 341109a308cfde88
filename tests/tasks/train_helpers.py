"""Helpers for the training tests: a learnable mock dataset, hand-made plans, torchrun runs, checkpoint readers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from sftflow.tasks.core.manifests import TrainResult
from sftflow.tasks.plan.planner import PlanArrays, PlanConfig, plan, save_plan
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.launch import train
from sftflow.tasks.train.mock import MockConfig, MockDataset, write_mock_index


def mock_config(vocab_size: int, **overrides) -> MockConfig:
    """Short 'arithmetic' documents (a model can learn to continue them) with assistant-like loss spans."""
    kwargs = dict(
        num_docs=96,
        vocab_size=vocab_size,
        min_token_id=5,
        median_length=20,
        sigma=0.5,
        min_length=2,
        max_length=48,
        tokens="arithmetic",
        loss_spans=True,
        seed=1,
    )
    kwargs.update(overrides)
    return MockConfig(**kwargs)


def write_plan(path: Path, dataset: MockDataset, steps: list[list[list[int]]], num_ranks: int, mode="packed") -> Path:
    """A plan from explicit rows: `steps[s]` lists the rows of step s, micro-batch-major then rank."""
    rows = [np.asarray(r, dtype=np.int64) for step in steps for r in step]
    mbs = len(steps[0]) // num_ranks
    assert all(len(step) == mbs * num_ranks for step in steps)
    lengths = dataset.lengths.astype(np.int64)
    counts = np.asarray(dataset.loss_token_counts, dtype=np.int64)
    row_loss = np.array([counts[r].sum() for r in rows], dtype=np.int64)
    row_tokens = np.array([lengths[r].sum() for r in rows], dtype=np.int64)
    per_step = mbs * num_ranks
    arrays = PlanArrays(
        doc_ids=np.concatenate(rows) if rows else np.zeros(0, np.int64),
        row_ptr=np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64),
        row_tokens=row_tokens,
        row_loss_tokens=row_loss,
        row_max_seqlen=np.array([lengths[r].max() if len(r) else 0 for r in rows], dtype=np.int64),
        step_loss_tokens=row_loss.reshape(len(steps), per_step).sum(1),
        step_tokens=row_tokens.reshape(len(steps), per_step).sum(1),
        epoch_of_step=np.zeros(len(steps), dtype=np.int64),
        dropped_doc_ids=np.zeros(0, dtype=np.int64),
        num_ranks=num_ranks,
        steps_per_epoch=len(steps),
        micro_batches_per_step=mbs,
        tokens_per_rank=int(row_tokens.max()),
        mode=mode,
    )
    path.mkdir(parents=True, exist_ok=True)
    save_plan(arrays, path / "plan.npz")
    return path


def planned_mock(
    root: Path, vocab_size: int, tokenizer_dir: Path, plan_config: PlanConfig, mock: dict | None = None, **train_fields
) -> tuple[TrainConfig, MockDataset, PlanArrays]:
    """Mock documents written as a dataset index in `root/data`, the real planner's plan of them in `root/plan`, and a
    tiny-Llama `TrainConfig` on both.

    Defaults shared by the training tests: lr 1e-2 (a tiny model visibly learns in a few steps), seed 0, one CPU
    thread per process (the same float summation order whatever the launch shape), the CPU (gloo) even where a GPU
    is present (two ranks on one GPU cannot run NCCL), no export; `train_fields` override them.
    """
    config = mock_config(vocab_size, **(mock or {}))
    dataset = MockDataset(config)
    write_mock_index(config, root / "data")
    arrays, _ = plan(dataset.lengths, dataset.loss_token_counts, plan_config)
    (root / "plan").mkdir(parents=True, exist_ok=True)
    save_plan(arrays, root / "plan" / "plan.npz")
    fields = dict(
        data=str(root / "data"),
        plan=str(root / "plan"),
        model="tiny-llama",
        tokenizer=str(tokenizer_dir),
        out=str(root / "unused"),
        optimizer=dict(lr=1e-2),
        seed=0,
        num_threads=1,
        device="cpu",
        export=False,
    )
    return TrainConfig.model_validate(merged_fields(fields, train_fields)), dataset, arrays


def merged_fields(base: dict, updates: dict) -> dict:
    """`base` with `updates`, a section (`checkpoint=dict(resume=True)`) updated field by field."""
    out = dict(base)
    for key, value in updates.items():
        out[key] = (
            merged_fields(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def run(base: TrainConfig, out: Path, **updates) -> TrainResult:
    config = TrainConfig.model_validate(merged_fields(base.model_dump(), {"out": str(out), **updates}))
    return train(config)


def losses(run_dir: Path) -> list[float | None]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def rel(a: float, b: float) -> float:
    """Relative difference of `a` from `b` (losses of two runs)."""
    return abs(a - b) / max(abs(b), 1e-12)


def resume_from(source: Path, step: int, out: Path) -> None:
    """Make `out` a run whose only checkpoint is `source`'s step-`step` (so `resume` continues from there)."""
    import shutil

    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / f"step-{step}", out / "checkpoints" / f"step-{step}")
    (out / "checkpoints" / "latest").write_text(f"step-{step}")


def read_dcp(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose key starts with `prefix`, loaded in this (non-distributed) process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))
