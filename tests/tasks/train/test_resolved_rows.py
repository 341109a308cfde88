"""`plan.tokens_per_rank: auto`: the longest row the training GPUs fit, chosen once by the resolved run's rules
(`resolve_rows`) on a `Hardware` (a fake GPU here: no GPU needed), recorded by the plan and shown by the launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sftflow.flows.config import SFTConfig, plan_config, plan_inputs
from sftflow.tasks.train.activations import fits, max_row_tokens, state_bytes
from sftflow.tasks.train.config import LoraSettings, TrainConfig, TrainOptions
from sftflow.tasks.train.resolved import (
    Choice,
    Hardware,
    meta_model,
    model_state_bytes,
    plan_hardware,
    planned_memory,
    resolve_rows,
)
from tests.tasks.train_helpers import merged_fields

LLAMA8B = str(Path(__file__).resolve().parents[3] / "benchmarks" / "workloads" / "llama-3.1-8b.json")
GIB = 2**30
H200 = 139.3


def gpu(gib: float, name: str = "NVIDIA H200") -> Hardware:
    """A fake GPU with `gib` free, as `detect_hardware` would describe it."""
    return Hardware(
        kind="cuda", name=name, memory=int(gib * GIB), total_memory=int(gib * GIB), capability=(9, 0),
        host_bytes=400 * GIB,
    )  # fmt: skip


H100 = gpu(79, "NVIDIA H100 80GB HBM3")


def rows(options: TrainOptions, num_ranks: int = 1, gib: float = H200, accumulating: bool = False) -> Choice:
    return resolve_rows(
        options, gpu(gib), setting="auto", num_ranks=num_ranks, vocab_size=None, accumulating=accumulating
    )


def state(options: TrainOptions, num_ranks: int = 1, accumulating: bool = False) -> float:
    """The weights and optimizer state `resolve_rows` sizes rows beside."""
    lm = meta_model(options, None)
    parallel = planned_memory(options, num_ranks).parallel
    released, offload = options.optimizer.in_backward, options.optimizer.offload
    return model_state_bytes(lm, options.quantize, parallel, num_ranks, accumulating, released, offload)


def updated(options: TrainOptions, **sections) -> TrainOptions:
    """`options` with some fields of its sections changed, validated again."""
    return TrainOptions.model_validate(merged_fields(options.model_dump(), sections))


FULL = TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full"), optimizer=dict(grad_clip=None))
RELEASED = TrainOptions(model=LLAMA8B, optimizer=dict(in_backward=True, grad_clip=None))
# The rows `plan.tokens_per_rank: auto` planned before the choice moved into the resolved run (the plan's own
# `row_capacity`, on the same settings and free memory): moving it changed no row length.
BEFORE = {
    "off": (TrainOptions(model=LLAMA8B), 1, H200, False, 4096),
    "full": (TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full")), 1, H200, False, 49152),
    "two": (TrainOptions(model=LLAMA8B, nproc=2), 2, H200, False, 14336),
    "lora": (TrainOptions(model=LLAMA8B, lora=LoraSettings(rank=16)), 1, H200, False, 24576),
    "lora accumulating": (TrainOptions(model=LLAMA8B, lora=LoraSettings(rank=16)), 1, H200, True, 24576),
    "offload": (
        TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full", activation_offload=True)),
        1,
        H200,
        False,
        131072,
    ),  # fmt: skip
    "half": (TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing=16)), 1, H200, False, 7168),
    "accumulating": (TrainOptions(model=LLAMA8B, memory=dict(activation_checkpointing="full")), 1, H200, True, 9216),
    "in backward": (updated(FULL, optimizer=dict(in_backward=True)), 1, H200, False, 86016),
    "16 layers' moments": (updated(FULL, optimizer=dict(offload=16)), 1, H200, False, 109568),
    "all moments, 80 GiB": (
        updated(FULL, optimizer=dict(in_backward=True, offload="all")),
        1,
        80,
        False,
        82944,
    ),  # fmt: skip
    "in backward, off": (RELEASED, 1, H200, False, 7168),
    "budget 0.7": (updated(RELEASED, memory=dict(activation_memory_budget=0.7)), 1, H200, False, 10240),
    "budget 0.7, eager": (
        updated(RELEASED, memory=dict(activation_memory_budget=0.7, compile="off")),
        1,
        H200,
        False,
        7168,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(BEFORE))
def test_the_rows_are_the_ones_planned_before(name):
    options, num_ranks, gib, accumulating, tokens = BEFORE[name]
    choice = rows(options, num_ranks, gib, accumulating)
    assert (choice.value, choice.setting) == (tokens, "auto")


def test_a_data_vocabulary_larger_than_the_models_is_sized_as_the_worker_grows_it():
    """The worker grows the embeddings and the head to the data's vocabulary where it is larger than the model's
    (`meta_model`), so the rows are sized beside those bigger matrices: shorter than for the model's own vocabulary
    (row sizing before it moved into the resolved run counted the model's own for every model but a preset)."""
    own = resolve_rows(
        TrainOptions(model=LLAMA8B), gpu(H200), setting="auto", num_ranks=1, vocab_size=128_256, accumulating=False
    )
    grown = resolve_rows(
        TrainOptions(model=LLAMA8B), gpu(H200), setting="auto", num_ranks=1, vocab_size=160_000, accumulating=False
    )
    assert own.value == BEFORE["off"][4] and grown.value < own.value
    assert meta_model(TrainOptions(model=LLAMA8B), 160_000).get_input_embeddings().num_embeddings == 160_000


def test_rows_grow_with_checkpointing_ranks_and_lora_and_match_the_estimate():
    off, full, two, lora, half, offload = (
        rows(BEFORE[name][0], BEFORE[name][1]).value for name in ("off", "full", "two", "lora", "half", "offload")
    )
    assert offload > 2 * full  # the 32 layer inputs go to the host: one layer's activations stay
    # `full` above left offload at its default, auto, which the launch may still turn on; rows are planned without it
    assert TrainOptions().memory.activation_offload == "auto"
    parsed = [
        TrainOptions(memory=dict(activation_offload=v)).memory.activation_offload for v in ("true", "false", True)
    ]
    assert parsed == [True, False, True] and all(isinstance(v, bool) for v in parsed)  # `--set` gives strings
    assert 0 < off < half < full and off < two < lora
    # one GPU, full fine-tuning: 14 bytes a parameter (bf16 weight, int16 master bits, fp32 moments, bf16 gradient)
    assert state(TrainOptions(model=LLAMA8B)) == pytest.approx(14 * 8_030_261_248)
    # fp32 gradients once micro-batches add up: 16 bytes a parameter, and rows only with checkpointing
    assert state(FULL, accumulating=True) == pytest.approx(16 * 8_030_261_248)
    assert rows(BEFORE["full"][0], accumulating=True).value < full
    with pytest.raises(ValueError, match="no room"):
        rows(TrainOptions(model=LLAMA8B), accumulating=True)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(LLAMA8B)
    free = int(H200 * GIB)
    for name, tokens, mode in (("off", off, "off"), ("full", full, "full")):
        held = state(BEFORE[name][0])
        assert tokens == max_row_tokens(config, mode, held, free)
        assert fits(config, mode, tokens, held, free) and not fits(config, mode, tokens + 1024, held, free)
    assert state(BEFORE["two"][0], 2) == pytest.approx(state_bytes(8_030_261_248, 0.0, "fsdp", 2, 8_030_261_248, 32))


def test_stepping_in_the_backward_frees_the_gradients_for_rows():
    released = updated(FULL, optimizer=dict(in_backward=True))
    embedding = 128_256 * 4096  # the largest tensor: the one gradient alive at a time
    assert state(released) == pytest.approx(12 * 8_030_261_248 + 2 * embedding)
    assert state(FULL) - state(released) > 13.9 * GIB and rows(released).value > rows(FULL).value


def test_moments_on_the_host_free_8_bytes_a_parameter_less_two_slots():
    layer = 218_112_000  # a Llama-3.1-8B decoder layer's parameters
    assert state(FULL) - state(updated(FULL, optimizer=dict(offload=16))) == pytest.approx(8 * 16 * layer - 16 * layer)
    released = updated(FULL, optimizer=dict(in_backward=True))
    everything = updated(released, optimizer=dict(offload="all"))
    embedding = 128_256 * 4096  # the largest unit: two slots of its moments
    assert state(everything) == pytest.approx(4 * 8_030_261_248 + 2 * embedding + 16 * embedding)
    assert rows(everything, gib=80).value > 0  # an 8B full fine-tune on one 80 GiB GPU
    with pytest.raises(ValueError, match="no room"):
        rows(released, gib=80)
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
    plain = rows(RELEASED).value
    assert rows(BEFORE["budget 0.7"][0]).value / plain == pytest.approx(1 / 0.7, rel=0.05)
    assert rows(BEFORE["budget 0.7, eager"][0]).value == plain


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


def test_the_reason_says_why_the_rows_have_their_length():
    """Like the launch's other choices: `set`, or `auto:` with the rule and the numbers it was decided on."""
    assert resolve_rows(
        TrainOptions(model=LLAMA8B), None, setting=512, num_ranks=1, vocab_size=None, accumulating=False
    ) == Choice(512, 512, "set")  # no GPU asked, no model read
    assert rows(TrainOptions(model=LLAMA8B)).reason == (
        "auto: the longest row that fits without checkpointing: 104.7 GiB of weights and optimizer state in 139.3 "
        "GiB free (NVIDIA H200)"
    )
    assert rows(BEFORE["two"][0], 2).reason == (
        "auto: the longest row that fits without checkpointing: 60.8 GiB of weights and optimizer state per GPU on "
        "the fsdp path over 2 GPUs in 139.3 GiB free (NVIDIA H200)"
    )
    assert rows(BEFORE["offload"][0]).reason.startswith(
        "auto: the model's 131,072 positions, shorter than the longest row that fits with activation checkpointing "
        "full and activation offload: "
    )
    assert rows(BEFORE["half"][0]).reason.startswith(
        "auto: the longest row that fits with activation checkpointing 16 of 32 layers: "
    )
    assert "at an activation memory budget of 0.7: " in rows(BEFORE["budget 0.7"][0]).reason
    # A Llama-3.2-1B shape on a fake H100: the preset's 2,048 positions, not the memory, set the rows.
    one_b = dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    )
    capped = resolve_rows(
        TrainOptions(model_overrides=one_b), H100, setting="auto", num_ranks=1, vocab_size=128256, accumulating=False
    )
    assert capped == Choice(
        2048, "auto", "auto: the model's 2,048 positions, shorter than the longest row that fits without "
        "checkpointing: 19.5 GiB of weights and optimizer state in 79.0 GiB free (NVIDIA H100 80GB HBM3)",
    )  # fmt: skip
    longer = resolve_rows(
        TrainOptions(model_overrides={**one_b, "max_position_embeddings": 131072}), H100, setting="auto",
        num_ranks=1, vocab_size=128256, accumulating=False,
    )  # fmt: skip
    assert longer.value == 39936 and longer.reason.startswith("auto: the longest row that fits without checkpointing")


def test_a_model_that_leaves_no_room_a_machine_without_a_gpu_and_no_model_config_say_what_to_do(tmp_path):
    """One line each."""
    errors = []
    with pytest.raises(ValueError, match=r"no room for a row of 1,024 tokens in 80\.0 GiB.*checkpointing: full") as e:
        rows(TrainOptions(model=LLAMA8B), gib=80.0)
    errors.append(str(e.value))
    for cpu in (None, Hardware(kind="cpu", name="cpu")):
        with pytest.raises(ValueError, match="no GPU to ask; set plan.device_memory_gib") as e:
            resolve_rows(TrainOptions(), cpu, setting="auto", num_ranks=1, vocab_size=512, accumulating=False)
        errors.append(str(e.value))
    with pytest.raises(ValueError, match="reads the model's config, and train.model .* has none here") as e:
        rows(TrainOptions(model=str(tmp_path / "missing")))
    errors.append(str(e.value))
    assert all("\n" not in message for message in errors), errors
    import torch

    if not torch.cuda.is_available():
        assert plan_hardware(None) is None
        cfg = SFTConfig.model_validate({"plan": {"tokens_per_rank": "auto"}, "train": {"model": LLAMA8B}})
        with pytest.raises(ValueError, match="plan.device_memory_gib"):
            plan_config(cfg)


def test_the_plan_config_holds_the_number_auto_became_and_the_choice_why():
    """`plan.device_memory_gib` stands for the GPU: no GPU is asked, on a machine with or without one."""
    assert plan_hardware(H200) == Hardware(
        kind="cuda", name="plan.device_memory_gib", memory=int(H200 * GIB), total_memory=int(H200 * GIB)
    )
    cfg = SFTConfig.model_validate(
        {"plan": {"tokens_per_rank": "auto", "device_memory_gib": H200}, "train": {"model": LLAMA8B}}
    )
    config, row_length = plan_inputs(cfg)
    assert config.tokens_per_rank == row_length.value == 4096 and config.device_memory_gib is None
    assert (row_length.setting, row_length.reason) == (
        "auto", rows(TrainOptions(model=LLAMA8B)).reason.replace("NVIDIA H200", "plan.device_memory_gib")
    )  # fmt: skip
    lora = SFTConfig.model_validate(
        {"plan": {"tokens_per_rank": "auto", "device_memory_gib": H200, "micro_batches_per_step": 4},
         "train": {"model": LLAMA8B, "lora": {"rank": 16}}}
    )  # fmt: skip
    assert plan_config(lora).tokens_per_rank == BEFORE["lora accumulating"][4]
    tiny = SFTConfig.model_validate({"plan": {"tokens_per_rank": "auto", "device_memory_gib": 8}})
    assert plan_config(tiny, vocab_size=512).tokens_per_rank == 2048  # the preset's max_position_embeddings
    assert plan_config(tiny).tokens_per_rank == 2048  # no data yet: a stand-in vocabulary
    set_rows = SFTConfig.model_validate({"plan": {"tokens_per_rank": 512}, "train": {"model": LLAMA8B}})
    config, row_length = plan_inputs(set_rows)
    assert config.tokens_per_rank == 512 and row_length.model_dump() == {"value": 512, "setting": 512, "reason": "set"}
    with pytest.raises(ValueError):
        SFTConfig.model_validate({"plan": {"tokens_per_rank": "most"}})


def test_sftflow_plan_records_the_row_it_chose_and_the_run_says_why(tmp_path):
    """`sftflow plan` prints the row length and records its choice beside `plan.npz`; the launch (`resolve_run`)
    shows it in the run's `[run]` lines. A set number says `set`; a plan without the record, `the plan's rows`."""
    from sftflow.flows.cli import app
    from sftflow.tasks.plan.row_length import ROW_LENGTH_FILE, read_row_length
    from sftflow.tasks.train.mock import MockConfig, write_mock_index
    from sftflow.tasks.train.resolved import resolve_run

    write_mock_index(MockConfig(num_docs=64, vocab_size=512, max_length=1024, seed=1), tmp_path / "data")

    def plan(out: str, *sets: str):
        args = ["plan", "--data", str(tmp_path / "data"), "--out", str(tmp_path / out)]
        for assignment in sets:
            args += ["--set", assignment]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return result.output

    output = plan("big", "plan.tokens_per_rank=auto", f"train.model={LLAMA8B}", f"plan.device_memory_gib={H200}")
    assert "steps of 4,096-token rows (auto: the longest row that fits without checkpointing: 104.7 GiB" in output
    assert read_row_length(tmp_path / "big").value == 4096

    plan("auto", "plan.tokens_per_rank=auto", "plan.device_memory_gib=8")
    plan("set", "plan.tokens_per_rank=1024")
    run = TrainConfig(data=str(tmp_path / "data"), plan=str(tmp_path / "auto"), out=str(tmp_path / "run"))
    cpu = Hardware(kind="cpu", name="cpu", count=1)

    def tokens_line(config: TrainConfig) -> str:
        table = resolve_run(config, hardware=cpu).table()
        return next(line for line in table if line.startswith("tokens per rank: "))

    recorded = json.loads((tmp_path / "auto" / ROW_LENGTH_FILE).read_text())
    assert recorded["value"] == 2048 and recorded["setting"] == "auto"
    assert tokens_line(run) == f"tokens per rank: 2,048 ({recorded['reason']})"
    assert recorded["reason"].startswith("auto: the model's 2,048 positions, shorter than the longest row that fits")
    choice = resolve_run(run, hardware=cpu).tokens_per_rank
    assert (choice.value, choice.setting) == (2048, "auto")
    set_run = run.model_copy(update={"plan": str(tmp_path / "set")})
    assert tokens_line(set_run) == "tokens per rank: 1,024 (set)"
    (tmp_path / "set" / ROW_LENGTH_FILE).unlink()  # a plan from before the choice was recorded
    assert tokens_line(set_run) == "tokens per rank: 1,024 (the plan's rows)"


def test_the_train_stage_key_holds_the_rows_not_why():
    """The run's cache key holds the row length, not the reason (which names the free memory)."""
    from sftflow.tasks.core.caching import stage_key
    from sftflow.tasks.train.resolved import resolve

    config = TrainConfig(model="tiny-llama", data="d", plan="p", out="o")
    lm = meta_model(config, vocab_size=512)
    cpu = Hardware(kind="cpu", name="cpu", count=1)

    def key(reason: str) -> str:
        run = resolve(
            config, cpu, tokens_per_rank=2048, micro_batches=1, vocab_size=512, lm=lm,
            rows=Choice(2048, "auto", reason),
        )  # fmt: skip
        return stage_key("train", "1", (), {"options": config, "resolved": run})

    assert key("auto: ... in 79.1 GiB free") == key("auto: ... in 78.9 GiB free")
    with pytest.raises(ValueError, match="rows of 2,048 tokens, and their choice says 1,024"):
        resolve(config, cpu, tokens_per_rank=2048, micro_batches=1, vocab_size=512, lm=lm, rows=Choice(1024, 1, "x"))
