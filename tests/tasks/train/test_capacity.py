"""`plan.tokens_per_rank: auto`: the longest row the training GPUs fit, from the run's own settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sftflow.flows.config import SFTConfig, plan_config
from sftflow.tasks.train.activations import fits, max_row_tokens, state_bytes
from sftflow.tasks.train.capacity import GIB, row_capacity
from sftflow.tasks.train.config import LoraSettings, TrainOptions
from tests.tasks.train_helpers import merged_fields

LLAMA8B = str(Path(__file__).resolve().parents[3] / "benchmarks" / "workloads" / "llama-3.1-8b.json")
H200 = 139.3


def updated(options: TrainOptions, **sections) -> TrainOptions:
    """`options` with some fields of its sections changed, validated again."""
    return TrainOptions.model_validate(merged_fields(options.model_dump(), sections))


def test_rows_grow_with_checkpointing_ranks_and_lora_and_match_the_estimate():
    off = row_capacity(TrainOptions(model=LLAMA8B), 1, H200)
    full = row_capacity(TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full")), 1, H200)
    two = row_capacity(TrainOptions(model=LLAMA8B, nproc=2), 2, H200)
    lora = row_capacity(TrainOptions(model=LLAMA8B, lora=LoraSettings(rank=16)), 1, H200)
    offload = row_capacity(
        TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full", activation_offload=True)), 1, H200
    )
    assert offload.tokens > 2 * full.tokens  # the 32 layer inputs go to the host: one layer's activations stay
    # `full` above left offload at its default, auto, which the worker may turn on; rows are planned without it
    assert TrainOptions().memory.activation_offload == "auto"
    parsed = [
        TrainOptions(memory=dict(activation_offload=v)).memory.activation_offload for v in ("true", "false", True)
    ]
    assert parsed == [True, False, True] and all(isinstance(v, bool) for v in parsed)  # `--set` gives strings
    assert (off.parallel, off.mode, two.parallel, full.mode) == ("single", "off", "fsdp", "full")
    assert 0 < off.tokens < full.tokens and off.tokens < two.tokens < lora.tokens
    half = row_capacity(TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing=16)), 1, H200)
    assert half.mode == "16 of 32 layers" and off.tokens < half.tokens < full.tokens
    # one GPU, full fine-tuning: 14 bytes a parameter (bf16 weight, int16 master bits, fp32 moments, bf16 gradient)
    assert off.state_bytes == pytest.approx(14 * 8_030_261_248)
    # fp32 gradients once micro-batches add up: 16 bytes a parameter, and rows only with checkpointing
    accumulating = row_capacity(
        TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full")), 1, H200, None, True
    )
    assert accumulating.state_bytes == pytest.approx(16 * 8_030_261_248) and accumulating.tokens < full.tokens
    with pytest.raises(ValueError, match="no room"):
        row_capacity(TrainOptions(model=LLAMA8B), 1, H200, accumulating=True)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(LLAMA8B)
    free = int(H200 * GIB)
    for capacity in (off, full):
        assert capacity.tokens == max_row_tokens(config, capacity.mode, capacity.state_bytes, free)
        assert fits(config, capacity.mode, capacity.tokens, capacity.state_bytes, free)
        assert not fits(config, capacity.mode, capacity.tokens + 1024, capacity.state_bytes, free)
    assert two.state_bytes == pytest.approx(state_bytes(8_030_261_248, 0.0, "fsdp", 2, 8_030_261_248, 32))


def test_stepping_in_the_backward_frees_the_gradients_for_rows():
    full = TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full"), optimizer=dict(grad_clip=None))
    held = row_capacity(full, 1, H200)
    released = row_capacity(updated(full, optimizer=dict(in_backward=True)), 1, H200)
    embedding = 128_256 * 4096  # the largest tensor: the one gradient alive at a time
    assert released.state_bytes == pytest.approx(12 * 8_030_261_248 + 2 * embedding)
    assert held.state_bytes - released.state_bytes > 13.9 * GIB and released.tokens > held.tokens


def test_moments_on_the_host_free_8_bytes_a_parameter_less_two_slots():
    full = TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full"), optimizer=dict(grad_clip=None))
    held = row_capacity(full, 1, H200)
    layer = 218_112_000  # a Llama-3.1-8B decoder layer's parameters
    half = row_capacity(updated(full, optimizer=dict(offload=16)), 1, H200)
    assert held.state_bytes - half.state_bytes == pytest.approx(8 * 16 * layer - 16 * layer)
    released = updated(full, optimizer=dict(in_backward=True))
    everything = row_capacity(updated(released, optimizer=dict(offload="all")), 1, 80)
    embedding = 128_256 * 4096  # the largest unit: two slots of its moments
    assert everything.state_bytes == pytest.approx(4 * 8_030_261_248 + 2 * embedding + 16 * embedding)
    assert everything.tokens > 0  # an 8B full fine-tune on one 80 GiB GPU
    with pytest.raises(ValueError, match="no room"):
        row_capacity(released, 1, 80)
    for bad in ({"parallel": "fsdp"}, {"nproc": 2}, {"lora": {"rank": 8}}):
        with pytest.raises(ValueError, match="optimizer.offload=2 streams the moments"):
            TrainOptions(**bad, optimizer=dict(offload=2))


def test_a_host_without_room_for_the_offloaded_moments_is_refused_before_launch():
    """An 8B's moments take 59.8 GiB of host memory with `all`: refused by the launcher (from a meta model, before
    torchrun and the weights load) on a host that has less available; one layer's 1.6 GiB passes."""
    from sftflow.tasks.train.host_moments import HOST_HEADROOM, available_host_bytes
    from sftflow.tasks.train.launch import check_one_device_options

    available = available_host_bytes()
    if available is None or available >= 8 * 8_030_261_248 + HOST_HEADROOM:
        pytest.skip("this host has room for an 8B's moments")
    everything = TrainOptions(model=LLAMA8B, parallel="single", optimizer=dict(offload="all"))
    with pytest.raises(MemoryError, match=r"the offloaded AdamW moments take 59\.8 GiB of host memory"):
        check_one_device_options(everything)
    check_one_device_options(updated(everything, optimizer=dict(offload=1)))


def test_a_set_memory_budget_plans_longer_rows():
    """`activation_memory_budget: 0.7` keeps 0.7 of each layer's bytes: the row that fits grows by ~1/0.7 (`auto`
    plans at 1, as for rows that fit as they are; without compiled layers there is no budget)."""
    released = TrainOptions(model=LLAMA8B, optimizer=dict(in_backward=True, grad_clip=None))
    plain = row_capacity(released, 1, H200)
    budget = row_capacity(updated(released, memory=dict(activation_memory_budget=0.7)), 1, H200)
    assert budget.tokens / plain.tokens == pytest.approx(1 / 0.7, rel=0.05)
    eager = updated(released, memory=dict(activation_memory_budget=0.7, compile="off"))
    assert row_capacity(eager, 1, H200).tokens == plain.tokens


def test_stepping_in_the_backward_says_what_it_cannot_do():
    with pytest.raises(ValueError, match="cannot clip: set optimizer.grad_clip: null"):
        TrainOptions(optimizer=dict(in_backward=True))
    ok = {"optimizer": {"in_backward": True, "grad_clip": None}}
    for bad, match in [
        ({"lora": {"rank": 8}}, "LoRA"),
        ({"parallel": "fsdp"}, "parallel: single"),
        ({"nproc": 2}, "nproc=2"),
        ({"save_grads_at_steps": [1]}, "save_grads_at_steps"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainOptions(**ok, **bad)
    for plan in ({"micro_batches_per_step": 2}, {"target_tokens_per_step": 4096}, {"num_ranks": 2}):
        with pytest.raises(ValueError, match="plan one a step"):
            SFTConfig.model_validate({"plan": plan, "train": ok})
    assert SFTConfig.model_validate({"plan": {"micro_batches_per_step": 1}, "train": ok}).train.optimizer.in_backward


def test_a_model_that_leaves_no_room_and_a_machine_without_a_gpu_say_what_to_do():
    message = r"no room for a row of 1,024 tokens in 80\.0 GiB.*activation_checkpointing: full"
    with pytest.raises(ValueError, match=message):
        row_capacity(TrainOptions(model=LLAMA8B), 1, 80.0)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="plan.device_memory_gib"):
            row_capacity(TrainOptions(model=LLAMA8B), 1, None)


def test_the_plan_config_holds_the_number_auto_became():
    cfg = SFTConfig.model_validate(
        {"plan": {"tokens_per_rank": "auto", "device_memory_gib": H200}, "train": {"model": LLAMA8B}}
    )
    assert plan_config(cfg).tokens_per_rank == row_capacity(cfg.train, 1, H200).tokens
    lora = SFTConfig.model_validate(
        {"plan": {"tokens_per_rank": "auto", "device_memory_gib": H200, "micro_batches_per_step": 4},
         "train": {"model": LLAMA8B, "lora": {"rank": 16}}}
    )  # fmt: skip
    assert plan_config(lora).tokens_per_rank == row_capacity(lora.train, 1, H200, accumulating=True).tokens
    tiny = SFTConfig.model_validate({"plan": {"tokens_per_rank": "auto", "device_memory_gib": 8}})
    assert plan_config(tiny, vocab_size=512).tokens_per_rank == 2048  # the preset's max_position_embeddings
    with pytest.raises(ValueError):
        SFTConfig.model_validate({"plan": {"tokens_per_rank": "most"}})


def test_sftflow_plan_prints_the_row_it_chose(tmp_path):
    from sftflow.flows.cli import app
    from sftflow.tasks.train.mock import MockConfig, write_mock_index

    write_mock_index(MockConfig(num_docs=64, vocab_size=512, max_length=1024, seed=1), tmp_path / "data")
    args = ["plan", "--data", str(tmp_path / "data"), "--tokens-per-rank", "auto", "--set", "train.model=" + LLAMA8B]
    args += ["--set", f"plan.device_memory_gib={H200}", "--out", str(tmp_path / "plan"), "--stats-json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])
    assert stats["tokens_per_rank"] == row_capacity(TrainOptions(model=LLAMA8B), 1, H200).tokens
