"""The training stage on a GPU through its real launcher: train, crash, resume, export.

A Llama-shaped random-init model (`llama-1024x8` of `sftflow.tasks.shapes`: 8 layers, hidden 1024, 16 heads / 8 KV
heads, vocab 32k), bf16 compute with fp32 master weights, mock documents (lognormal lengths, median 600), packed
rows of 16,384 tokens per rank. The first launch is killed after step 20 (the `inject_crash` fixture: one worker
SIGKILLs itself; the checkpoint of step 20 is written); the second launch resumes from `latest` and finishes. Every
step is logged once, the loss stays finite, the export reloads with the model's parameters, and a launch that is
never killed logs the same loss and gradient norm at every step. The run's tokens/s (median of the steps after
warm-up), the worker's MFU estimate and peak memory are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from sftflow.tasks.shapes import SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS, CRASH_AFTER, ROW = 30, 20, 16384


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_gpu_run_crashes_resumes_and_exports(tmp_path, inject_crash, nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from sftflow.tasks.plan.planner import PlanConfig, plan, save_plan
    from sftflow.tasks.train.config import TrainConfig
    from sftflow.tasks.train.launch import TrainingFailed, train
    from sftflow.tasks.train.metrics import read_metrics
    from sftflow.tasks.train.mock import MockConfig, MockDataset, write_mock_index

    shape = SHAPES["llama-1024x8"]
    mock = MockConfig(
        num_docs=2000 * nproc,
        vocab_size=shape.vocab,
        median_length=600,
        sigma=1.0,
        min_length=16,
        max_length=ROW // 4,
        loss_spans=True,
    )
    dataset = MockDataset(mock)
    arrays, _ = plan(
        dataset.lengths,
        dataset.loss_token_counts,
        PlanConfig(num_ranks=nproc, tokens_per_rank=ROW, micro_batches_per_step=1),
    )
    (tmp_path / "plan").mkdir()
    save_plan(arrays, tmp_path / "plan" / "plan.npz")
    LlamaConfig(**shape.fields()).to_json_file(str(tmp_path / "model.json"))
    config = TrainConfig(
        data=str(write_mock_index(mock, tmp_path / "data")),
        plan=str(tmp_path / "plan"),
        model=str(tmp_path / "model.json"),
        out=str(tmp_path / "run"),
        nproc=nproc,
        max_steps=STEPS,
        device="cuda",
        timeout_s=600,
        checkpoint=dict(every=10, keep_last=2),
        schedule=dict(warmup_steps=3),
        optimizer=dict(lr=3e-4),
    )

    inject_crash(f"crash_after_step={CRASH_AFTER}")
    with pytest.raises(TrainingFailed):
        train(config)
    inject_crash(None)
    result = train(config, resume=True)

    assert result.steps == STEPS
    # Every `auto` was resolved once, at launch, for this GPU: the worker ran what run.json says.
    from sftflow.kernels.attention_fa4 import unavailable_reason
    from sftflow.tasks.train.resolved import read_resolved

    resolved = read_resolved(tmp_path / "run")
    print("[resolved] " + " | ".join(resolved.table()), flush=True)
    assert resolved.device == "cuda" and resolved.hardware.count == nproc
    assert resolved.parallel.value == ("single" if nproc == 1 else "fsdp")
    assert resolved.compile.value is True and resolved.dtype.value == "bf16"
    assert resolved.tokens_per_rank.value == ROW
    fa4 = unavailable_reason(torch.device("cuda"), torch.bfloat16) is None  # head dim 64 is one it takes
    assert resolved.attention.value == ("flash_attn_4" if fa4 else "triton"), resolved.attention
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    reloaded = AutoModelForCausalLM.from_pretrained(result.hf_dir)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(LlamaConfig(**shape.fields()))
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in expected.parameters())
    # Bit-exact: a launch that is never killed logs the same loss and gradient norm at every step. Steps are queued
    # ahead of their totals on a GPU, so this holds only if the checkpoint of step 20 held step 20's weights alone.
    unbroken = train(config.model_copy(update={"out": str(tmp_path / "unbroken"), "export": False}))
    assert unbroken.steps == STEPS
    reference = read_metrics(tmp_path / "unbroken" / "metrics.jsonl")
    for field in ("loss", "grad_norm", "lr", "tokens", "trained_tokens"):
        assert [r[field] for r in records] == [r[field] for r in reference], field
    timed = [r for r in records if r["step"] > 3 and r["step"] != CRASH_AFTER + 1]
    summary = {
        "gpu": torch.cuda.get_device_name(0),
        "nproc": nproc,
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in timed)),
        "mfu_median": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
        "peak_memory_gib": max(r["peak_memory_gib"] or 0 for r in records),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
    }
    print("[train-crash-resume] " + json.dumps(summary), flush=True)
