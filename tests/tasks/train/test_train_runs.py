"""Training end to end: real torchrun, 1 or 2 gloo processes, a tiny random-init Llama in fp32 on CPU.

Two reference runs on one plan (made by the real planner for 2 ranks, 2 micro-batches per step) are shared by most
tests: `run2` on 2 ranks, `run1` on 1 rank (which trains each step as 4 micro-batches: 2 micro-batches x 2 plan
ranks). Everything else (multi-node, resharding, selective loading) starts from them.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from sftflow.flows.local_api import free_port
from sftflow.tasks.plan.planner import PlanConfig
from sftflow.tasks.train.config import TrainConfig
from sftflow.tasks.train.launch import train
from sftflow.tasks.train.mock import MockDataset, write_mock_index
from tests.tasks.train_helpers import (
    losses,
    metrics,
    mock_config,
    planned_mock,
    read_dcp,
    read_safetensors,
    rel,
    resume_from,
    run,
    write_plan,
)

pytestmark = pytest.mark.slow


def _assert_grads_close(got: dict, want: dict, rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item() + 1e-12
        err = (got[name] - want[name]).abs().max().item() / scale
        assert err <= rtol, f"{name}: max error {err:.2e} of max |grad| {scale:.2e}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("train")
    base, dataset, arrays = planned_mock(
        root,
        len(tiny_tokenizer),
        tiny_tokenizer_dir,
        PlanConfig(num_ranks=2, tokens_per_rank=64, micro_batches_per_step=2, epochs=2, seed=0),
        save_grads_at_steps=(1,),
        schedule=dict(warmup_steps=2),
        checkpoint=dict(every=4, keep_last=10),
    )
    return root, base, dataset, arrays.num_steps


@pytest.fixture(scope="module")
def run2(setup):
    root, base, _, _ = setup
    run(base, root / "run2", nproc=2, export=True)
    return root / "run2"


@pytest.fixture(scope="module")
def run1(setup):
    root, base, _, _ = setup
    run(base, root / "run1", nproc=1)
    return root / "run1"


def test_loss_goes_down_and_metrics_are_complete(run2, setup):
    num_steps = setup[3]
    records = metrics(run2)
    assert [r["step"] for r in records] == list(range(1, num_steps + 1))
    for r in records:
        for key in ("loss", "grad_norm", "lr", "trained_tokens", "tokens_per_s", "ema_step_time_s", "eta_s"):
            assert r[key] is not None and math.isfinite(r[key]), (r["step"], key)
    loss = [r["loss"] for r in records]
    assert np.mean(loss[-4:]) < np.mean(loss[:4]) - 0.2, loss
    ckpts = sorted(p.name for p in (run2 / "checkpoints").iterdir())
    assert (run2 / "checkpoints" / "latest").read_text() == f"step-{num_steps}"
    assert "step-4" in ckpts and f"step-{num_steps}" in ckpts


def test_data_parallel_equals_single_rank_and_grad_accumulation(run1, run2):
    """2 ranks x 2 micro-batches == 1 rank x 4 micro-batches: same gradients at step 1, same losses after."""
    grads2 = read_safetensors(run2 / "debug" / "grads-step-1.safetensors")
    grads1 = read_safetensors(run1 / "debug" / "grads-step-1.safetensors")
    _assert_grads_close(grads2, grads1, rtol=1e-5)
    for step, (a, b) in enumerate(zip(losses(run2), losses(run1), strict=True), 1):
        assert rel(a, b) <= 1e-4, (step, a, b)


def test_grad_accumulation_equals_one_big_micro_batch(setup, run1):
    """Step 1 of the plan as one micro-batch holding all its documents == the same step as 4 micro-batches."""
    root, base, dataset, _ = setup
    from sftflow.tasks.plan.planner import load_plan

    arrays = load_plan(root / "plan" / "plan.npz")
    per_step = arrays.micro_batches_per_step * arrays.num_ranks
    docs = arrays.doc_ids[arrays.row_ptr[0] : arrays.row_ptr[per_step]]
    write_plan(root / "plan-one-row", dataset, [[list(docs)]], num_ranks=1)
    out = root / "one-row"
    run(base, out, plan=str(root / "plan-one-row"), nproc=1, max_steps=1)
    one_row = read_safetensors(out / "debug" / "grads-step-1.safetensors")
    _assert_grads_close(one_row, read_safetensors(run1 / "debug" / "grads-step-1.safetensors"), rtol=1e-5)


def test_export_reloads_with_the_trained_logits(run2, setup, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sftflow.tasks.train.checkpoint import load_model_weights
    from sftflow.tasks.train.model import build_model

    num_steps = setup[3]
    exported = AutoModelForCausalLM.from_pretrained(run2 / "hf")
    tokenizer = AutoTokenizer.from_pretrained(run2 / "hf")
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    trained = build_model("tiny-llama", vocab_size=len(tokenizer), packed=False)
    load_model_weights(run2 / "checkpoints" / f"step-{num_steps}", trained)
    ids = torch.tensor([[5, 9, 13, 17, 21, 25, 29, 33]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
        fresh = build_model("tiny-llama", vocab_size=len(tokenizer), packed=False)
        assert not torch.allclose(fresh(ids).logits, trained(ids).logits, atol=1e-3)


def test_activation_checkpointing_trains_bit_identically_on_fsdp(setup, run2):
    """`full` activation checkpointing recomputes each layer in the backward: on the 2-rank run, the same gradients
    at step 1 and the same losses, to the bit."""
    root, base, _, _ = setup
    out = root / "checkpointed"
    run(base, out, nproc=2, max_steps=4, memory=dict(activation_checkpointing="full"))
    assert losses(out) == losses(run2)[:4]
    got = read_safetensors(out / "debug" / "grads-step-1.safetensors")
    want = read_safetensors(run2 / "debug" / "grads-step-1.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_two_nodes_match_one_node_with_two_processes(setup, run2):
    root, base, _, _ = setup
    out, port, errors = root / "two-nodes", free_port(), []

    def node(rank: int) -> None:
        try:
            run(base, out, nnodes=2, node_rank=rank, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="two-nodes")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert losses(out) == losses(run2)


@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)])
def test_checkpoint_reshards_across_world_sizes(setup, run1, run2, saved_on, resumed_on):
    root, base, _, _ = setup
    source = {1: run1, 2: run2}[saved_on]
    out = root / f"reshard-{saved_on}-to-{resumed_on}"
    resume_from(source, 8, out)
    run(base, out, nproc=resumed_on, save_grads_at_steps=(), checkpoint=dict(resume=True))
    resumed, reference = losses(out), losses(source)
    assert [r["step"] for r in metrics(out)] == list(range(9, len(reference) + 1))
    for step, (a, b) in enumerate(zip(resumed, reference[8:], strict=True), 9):
        assert rel(a, b) <= 1e-4, (step, a, b)


def test_init_from_loads_only_the_model_by_default(setup, run2):
    root, base, _, _ = setup
    out = root / "init-model"
    run(
        base,
        out,
        nproc=1,
        max_steps=0,
        save_grads_at_steps=(),
        checkpoint=dict(init_from=str(run2 / "checkpoints" / "step-4")),
    )
    source, loaded = run2 / "checkpoints" / "step-4", out / "checkpoints" / "step-0"
    want, got = read_dcp(source, "model."), read_dcp(loaded, "model.")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # A fresh optimizer: DCP materialises AdamW's lazy state for the save, with all moments zero.
    moments = {k: v for k, v in read_dcp(loaded, "optimizer.state.").items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and all(not v.any() for v in moments.values())
    assert any(v.any() for k, v in read_dcp(source, "optimizer.state.").items() if k.endswith("exp_avg"))
    assert int(read_dcp(loaded, "progress.")["progress.step"]) == 0
    assert _scheduler_epoch(loaded) == 0


def test_init_from_can_restore_optimizer_and_scheduler(setup, run2):
    root, base, _, _ = setup
    out = root / "init-all"
    source = run2 / "checkpoints" / "step-4"
    run(
        base,
        out,
        nproc=1,
        max_steps=0,
        save_grads_at_steps=(),
        checkpoint=dict(init_from=str(source), load_components=["model", "optimizer", "lr_scheduler"]),
    )
    loaded = out / "checkpoints" / "step-0"
    for prefix in ("model.", "optimizer.state."):
        want, got = read_dcp(source, prefix), read_dcp(loaded, prefix)
        assert want and want.keys() == got.keys(), prefix
        assert all(torch.equal(want[k], got[k]) for k in want), prefix
    assert _scheduler_epoch(loaded) == 4
    assert int(read_dcp(loaded, "progress.")["progress.step"]) == 0


def _scheduler_epoch(path: Path) -> int:
    import torch.distributed.checkpoint as dcp

    state = {"lr_scheduler": {"last_epoch": -1}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return int(state["lr_scheduler"]["last_epoch"])


def test_all_masked_micro_batch_and_zero_token_step(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    """Step 1: one rank's micro-batch trains nothing, another rank's row is empty. Step 2 trains nothing at all:
    the update is skipped. Step 3 trains again. No NaN anywhere."""
    mock = mock_config(len(tiny_tokenizer), loss_spans=False, length_distribution="uniform", min_length=1, max_length=8)
    dataset = MockDataset(mock)
    untrained = [int(i) for i in np.flatnonzero(dataset.loss_token_counts == 0)]
    trained = [int(i) for i in np.flatnonzero(dataset.loss_token_counts > 0)]
    steps = [
        [trained[0:3], untrained[0:2], trained[3:6], []],  # (micro-batch 0: rank 0, rank 1), (micro-batch 1: ...)
        [untrained[2:4], untrained[4:5], [], untrained[5:7]],
        [trained[6:9], trained[9:12], trained[12:14], trained[14:16]],
    ]
    write_plan(tmp_path / "plan", dataset, steps, num_ranks=2)
    config = TrainConfig(
        data=str(write_mock_index(mock, tmp_path / "data")),
        plan=str(tmp_path / "plan"),
        model="tiny-llama",
        tokenizer=str(tiny_tokenizer_dir),
        out=str(tmp_path / "run"),
        nproc=2,
        export=False,
        optimizer=dict(lr=1e-2),
        checkpoint=dict(every=1, keep_last=5),
    )
    train(config)
    records = metrics(tmp_path / "run")
    assert records[0]["skipped"] is None and math.isfinite(records[0]["loss"])
    assert records[1]["skipped"] and records[1]["loss"] is None and records[1]["trained_tokens"] == 0
    assert records[2]["skipped"] is None and math.isfinite(records[2]["loss"])
    ckpt = tmp_path / "run" / "checkpoints"
    after1, after2, after3 = (read_dcp(ckpt / f"step-{s}", "model.") for s in (1, 2, 3))
    assert all(torch.equal(after1[k], after2[k]) for k in after1)  # the zero-token step changed nothing
    assert any(not torch.equal(after2[k], after3[k]) for k in after2)
    assert all(torch.isfinite(t).all() for t in after3.values())
    moments1, moments2 = read_dcp(ckpt / "step-1", "optimizer.state."), read_dcp(ckpt / "step-2", "optimizer.state.")
    assert all(torch.equal(moments1[k], moments2[k]) for k in moments1)


def test_a_run_logs_its_resolved_choices_first_and_writes_them_to_run_json(setup, caplog, monkeypatch):
    """The launcher resolves every `auto` once: the run's first lines are the table, and run.json holds it for the
    workers, which apply it (a CPU run: FSDP over its processes, fp32, no compiled layers, no checkpointing)."""
    import json
    import logging

    from sftflow.tasks.train.resolved import read_resolved

    root, base, _, _ = setup
    monkeypatch.delenv("SFTFLOW_QUEUE_STEPS", raising=False)
    with caplog.at_level(logging.INFO, logger="sftflow.train"):
        run(base, root / "resolved", nproc=1, max_steps=1, lora={"rank": 4}, save_grads_at_steps=())
    lines = [r.getMessage() for r in caplog.records if r.name == "sftflow.train"]
    table = [line for line in lines if line.startswith("[run] ")]
    assert lines[: len(table)] == table  # before `launching: ...` and every worker line
    text = "\n".join(table)
    assert "[run] parallel: fsdp (auto: 1 process(es) on cpu)" in text
    assert "[run] dtype: fp32 (auto: fp32 on cpu)" in text
    assert "[run] activation checkpointing: off (auto: off on a CPU)" in text
    assert "[run] attention: " in text and "[run] loss: " in text
    assert "[run] steps queued ahead: off (auto: off on cpu, each step's time its own)" in text
    assert any("LoRA r4 on 7 modules: " in line and "trainable of" in line for line in lines)
    payload = json.loads((root / "resolved" / "run.json").read_text())
    assert payload["resolved"]["parallel"]["value"] == "fsdp"
    resolved = read_resolved(root / "resolved")
    assert resolved.device == "cpu" and resolved.tokens_per_rank.value == 64 and resolved.micro_batches == 4
