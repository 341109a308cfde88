"""`resolve`: every `auto` of a run made concrete once, with the same values the worker's chained resolvers chose
before the resolution moved to launch (`worker_choices` below is that chain, kept as the rules' reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sftflow.tasks.train import config as cfg
from sftflow.tasks.train.activations import (
    resolve_activation_checkpointing,
    resolve_activation_offload,
    resolve_memory_budget,
    settle_memory_budget,
)
from sftflow.tasks.train.compile import resolve_compile
from sftflow.tasks.train.host_moments import HOST_HEADROOM, offloaded_numel
from sftflow.tasks.train.model import decoder_layers
from sftflow.tasks.train.resolved import Choice, Hardware, ResolvedRun, meta_model, model_state_bytes, resolve

GIB = 2**30
# A Llama-3.2-1B-shaped preset: 16 layers, built on the meta device only.
ONE_B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
)
H100 = Hardware(
    kind="cuda", name="NVIDIA H100 80GB HBM3", count=1, memory=79 * GIB, total_memory=80 * GIB, capability=(9, 0),
    host_bytes=400 * GIB,
)  # fmt: skip
CPU = Hardware(kind="cpu", name="cpu", count=2, host_bytes=8 * GIB, ranks_on_host=2)


def train_config(**options) -> cfg.TrainConfig:
    return cfg.TrainConfig(
        model="tiny-llama", model_overrides=ONE_B, data="d", plan="p", out="o", **options
    )  # fmt: skip


def worker_choices(config: cfg.TrainConfig, hw: Hardware, lm, tokens: int, micro_batches: int) -> dict:
    """The worker's resolution as it was (`build_run`): compile, dtype, parallel path, then the memory budget,
    activation offload and checkpointing against the device's free memory and the host's room."""
    device = torch.device(hw.kind)
    compiled = resolve_compile(config.memory.compile, device)
    dtype = config.memory.dtype if config.memory.dtype != "auto" else "bf16" if device.type == "cuda" else "fp32"
    parallel = cfg.parallel_path(config.parallel, hw.count, device.type)
    layers = decoder_layers(lm)
    state = model_state_bytes(
        lm, config.quantize, parallel, hw.count, micro_batches > 1, config.optimizer.in_backward,
        config.optimizer.offload,
    )  # fmt: skip
    free = hw.memory if device.type == "cuda" else None
    moments = 8 * offloaded_numel(lm, config.optimizer.offload)[0] if config.optimizer.offload != "off" else 0
    room = None if hw.host_bytes is None else max(hw.host_bytes - HOST_HEADROOM - moments, 0)
    budget = resolve_memory_budget(
        config.memory.activation_memory_budget, compiled, device, lm.config, tokens, state, free
    )
    offload = resolve_activation_offload(
        config.memory.activation_offload, config.memory.activation_checkpointing, device, lm.config, tokens, state,
        free, budget,
        room, hw.ranks_on_host,
    )  # fmt: skip
    checkpointing = resolve_activation_checkpointing(
        config.memory.activation_checkpointing, device, lm.config, tokens, state, offload, free, budget
    )
    budget = settle_memory_budget(config.memory.activation_memory_budget, budget, checkpointing, len(layers))
    return dict(
        compile=compiled, dtype=dtype, parallel=parallel, activation_memory_budget=budget,
        activation_offload=offload, activation_checkpointing=checkpointing,
    )  # fmt: skip


CASES = [
    ("h100 4k rows", H100, {}, 4096, 1),
    ("h100 64k rows", H100, {}, 65536, 1),
    ("h100 128k rows", H100, {}, 131072, 1),
    ("h100 256k rows", H100, {}, 262144, 1),
    ("h100 accumulating", H100, {}, 65536, 4),
    ("h100 not compiled", H100, {"memory": {"compile": "off"}}, 65536, 1),
    ("h100 budget set", H100, {"memory": {"activation_memory_budget": 0.5}}, 65536, 1),
    ("h100 full", H100, {"memory": {"activation_checkpointing": "full"}}, 131072, 1),
    ("h100 offload on", H100, {"memory": {"activation_checkpointing": 4, "activation_offload": True}}, 65536, 1),
    ("h100 small host", H100.__class__(**{**H100.__dict__, "host_bytes": 20 * GIB}), {}, 262144, 1),
    ("h100 optimizer offload", H100, {"optimizer": {"offload": "all"}}, 131072, 1),
    ("h100 lora", H100, {"lora": {"rank": 16}}, 131072, 1),
    ("2 x h100 fsdp", H100.__class__(**{**H100.__dict__, "count": 2, "ranks_on_host": 2}), {"nproc": 2}, 131072, 1),
    ("cpu", CPU, {"nproc": 2}, 2048, 1),
    ("cpu fp32 set", CPU, {"nproc": 2, "memory": {"dtype": "fp32", "compile": "off"}}, 2048, 2),
]


@pytest.mark.parametrize(("name", "hw", "options", "tokens", "micro_batches"), CASES, ids=[c[0] for c in CASES])
def test_resolve_chooses_what_the_worker_chose(name, hw, options, tokens, micro_batches):
    config = train_config(**options)
    lm = meta_model(config, vocab_size=128256)
    run = resolve(config, hw, tokens_per_rank=tokens, micro_batches=micro_batches, vocab_size=128256, lm=lm)
    old = worker_choices(config, hw, lm, tokens, micro_batches)
    new = {k: getattr(run, k).value for k in old}
    assert new == old
    assert run.num_layers == 16 and run.tokens_per_rank.value == tokens
    assert all(line.count(":") >= 1 for line in run.table())


def test_the_rules_change_with_the_rows():
    """The cases above are not all alike: longer rows checkpoint more layers, and CPU runs none."""
    config = train_config()
    lm = meta_model(config, vocab_size=128256)
    picks = {
        tokens: resolve(config, H100, tokens_per_rank=tokens, micro_batches=1, vocab_size=128256, lm=lm)
        for tokens in (4096, 131072, 262144)
    }
    counts = [picks[t].activation_checkpointing.value for t in (4096, 131072, 262144)]
    assert counts[0] in ("off", 0) and counts[-1] not in ("off", 0)
    assert picks[4096].activation_memory_budget.value == 1.0
    assert picks[4096].parallel.value == "single" and picks[4096].dtype.value == "bf16"
    assert picks[4096].compile.value is True
    cpu = resolve(train_config(nproc=2), CPU, tokens_per_rank=2048, micro_batches=1, vocab_size=128256, lm=lm)
    assert (cpu.parallel.value, cpu.dtype.value, cpu.compile.value) == ("fsdp", "fp32", False)
    assert cpu.activation_checkpointing.value == "off" and "CPU" in cpu.activation_checkpointing.reason


def test_steps_are_queued_ahead_on_gpus_unless_told_otherwise(monkeypatch):
    """The loop queues step s + 1 before reading step s's totals on a GPU, not on a CPU nor with activations in host
    memory; `SFTFLOW_QUEUE_STEPS` forces it, a bad value is refused; run.json and the table say which and why."""
    config = train_config()
    lm = meta_model(config, vocab_size=1024)

    def queued(hw, config=config, tokens=4096):
        run = resolve(config, hw, tokens_per_rank=tokens, micro_batches=1, vocab_size=1024, lm=lm)
        assert ResolvedRun.from_json(json.loads(json.dumps(run.to_json()))).queue_steps == run.queue_steps
        assert "queue_steps" not in run.choices()  # how steps are queued does not change the trained model
        return run.queue_steps

    monkeypatch.delenv("SFTFLOW_QUEUE_STEPS", raising=False)
    assert queued(H100) == Choice(True, "auto", "auto: on a GPU, so it never waits for the host")
    assert not queued(CPU).value and "off on cpu" in queued(CPU).reason
    offloaded = train_config(memory={"activation_checkpointing": 4, "activation_offload": True})
    assert not queued(H100, offloaded).value  # each step pins fresh host buffers for its activations
    monkeypatch.setenv("SFTFLOW_QUEUE_STEPS", "0")
    assert queued(H100) == Choice(False, "0", "set by SFTFLOW_QUEUE_STEPS=0")
    monkeypatch.setenv("SFTFLOW_QUEUE_STEPS", "1")
    assert queued(CPU).value and not queued(H100, offloaded).value
    run = resolve(config, CPU, tokens_per_rank=4096, micro_batches=1, vocab_size=1024, lm=lm)
    assert "steps queued ahead: on (set by SFTFLOW_QUEUE_STEPS=1)" in run.table()
    monkeypatch.setenv("SFTFLOW_QUEUE_STEPS", "yes")
    with pytest.raises(ValueError, match="SFTFLOW_QUEUE_STEPS='yes': expected auto, 0 or 1"):
        queued(CPU)


def test_kernel_choices_are_dispatch_s(monkeypatch):
    """Attention and loss: what `kernels.dispatch` picks on the run's device, with its reason; on a fake H100 without
    flash-attn-4 the Triton kernels, saying why."""
    from sftflow.kernels import attention, cross_entropy

    config = train_config()
    lm = meta_model(config, vocab_size=1024)
    cpu = resolve(config, CPU, tokens_per_rank=2048, micro_batches=1, vocab_size=1024, lm=lm)
    assert cpu.attention.value == attention.select_backend("cpu", torch.float32, 64).name
    assert cpu.loss.value == cross_entropy.select_backend("cpu", torch.float32).name
    monkeypatch.setattr(
        "sftflow.kernels.attention_fa4.unavailable_reason",
        lambda device, dtype, capability=None: "flash-attn-4 is not installed (pip install flash-attn-4)",
    )
    monkeypatch.setattr("sftflow.kernels.dispatch.triton_unavailable_reason", lambda device: None)
    gpu = resolve(config, H100, tokens_per_rank=2048, micro_batches=1, vocab_size=1024, lm=lm)
    assert gpu.attention.value == "triton"
    assert "flash-attn-4 is not installed" in gpu.attention.reason
    assert gpu.loss.value == "triton"


def test_resolved_run_round_trips_through_json_and_prints_a_table():
    config = train_config(lora={"rank": 8})
    lm = meta_model(config, vocab_size=128256)
    run = resolve(
        config, H100, tokens_per_rank=131072, micro_batches=1, vocab_size=128256, lm=lm,
        template=Choice("chatml", "auto", "the template the data was rendered with"),
    )  # fmt: skip
    back = ResolvedRun.from_json(json.loads(json.dumps(run.to_json())))
    assert back == run
    table = "\n".join(run.table())
    assert "parallel: single (auto: one CUDA device)" in table
    assert "activation checkpointing: " in table and "template: chatml" in table
    assert set(run.choices()) >= {"parallel", "activation_checkpointing", "dtype", "compile"}
    assert "attention" not in run.choices()


def test_the_train_stage_key_holds_the_choices_not_the_measurements():
    """The train stage's cache key holds the resolved values: a GPU with a little less free memory that chooses the
    same keeps the key (the run stays Cached); one with so much less that it checkpoints more layers changes it."""
    import dataclasses

    from sftflow.tasks.core.caching import stage_key

    config = train_config()
    lm = meta_model(config, vocab_size=128256)

    def key(hw, tokens):
        resolved = resolve(config, hw, tokens_per_rank=tokens, micro_batches=1, vocab_size=128256, lm=lm)
        return stage_key("train", "1", (), {"options": config, "resolved": resolved})

    busier = dataclasses.replace(H100, memory=78 * GIB)
    assert key(H100, 4096) == key(busier, 4096)
    assert key(H100, 131072) != key(dataclasses.replace(H100, memory=50 * GIB), 131072)


def test_rows_are_planned_without_the_choices_the_launch_may_still_make():
    """`plan.tokens_per_rank: auto` sizes rows before the launch resolves: for `auto` settings, no checkpointing, a
    budget of 1 and no offload; settings that were made, as they are."""
    from sftflow.tasks.train.config import TrainOptions
    from sftflow.tasks.train.resolved import PlannedMemory, planned_memory

    assert planned_memory(TrainOptions(), 1) == PlannedMemory("single", "off", 1.0, False)
    assert planned_memory(TrainOptions(), 2) == PlannedMemory("fsdp", "off", 1.0, False)
    full = TrainOptions(
        memory=dict(activation_checkpointing="full", activation_offload=True, activation_memory_budget=0.5)
    )
    assert planned_memory(full, 1) == PlannedMemory("single", "full", 0.5, True)
    eager = TrainOptions(memory=dict(activation_checkpointing=4, activation_memory_budget=0.5, compile="off"))
    assert planned_memory(eager, 1) == PlannedMemory("single", 4, 1.0, False)
    offload_alone = TrainOptions(memory=dict(activation_offload=True))  # nothing to offload without checkpointing
    assert planned_memory(offload_alone, 1) == PlannedMemory("single", "off", 1.0, False)


def test_the_template_line_says_how_the_data_stage_chose_the_template(tmp_path, shared_data, tiny_tokenizer_dir):
    """`template: auto` on a real tokenizer: the data stage records the built-in template it chose and on how many
    probes it renders as the tokenizer's own; the run prints both. A run given only the template's file (a result
    from before it was recorded) prints the file's name as before, and a bare index no template line."""
    from sftflow.tasks.core.manifests import TokenizerRef
    from sftflow.tasks.data.render import RenderConfig
    from sftflow.tasks.data.stage import training_template
    from sftflow.tasks.plan.config import PlanConfig
    from sftflow.tasks.train.resolved import resolve_run
    from tests.tasks.train_helpers import planned_mock

    folder = shared_data / "tokenizers" / "smollm2-135m-chatml"
    _, template_file, _, chosen = training_template(
        RenderConfig(template="auto"), TokenizerRef(path=str(folder), sha256=""), tmp_path / "work"
    )
    assert (chosen.name, chosen.how, chosen.probes, chosen.equal) == ("chatml", "auto", 4, 4)
    base, _, _ = planned_mock(tmp_path, 400, tiny_tokenizer_dir, PlanConfig(num_ranks=1, tokens_per_rank=64))
    # As `sftflow train` and the train stage hand it over: the data result's template and how it was chosen.
    config = cfg.TrainConfig.model_validate(
        {**base.model_dump(), "chat_template": template_file, "template_choice": chosen.model_dump()}
    )
    back = cfg.TrainConfig.model_validate_json(config.model_dump_json())  # as run.json carries it to the workers
    assert back.template_choice == chosen
    table = resolve_run(config, hardware=CPU).table()
    assert "template: chatml (auto, equal to the tokenizer's own on 4/4 probes)" in table

    unrecorded = resolve_run(config.model_copy(update={"template_choice": None}), hardware=CPU).table()
    stem = Path(template_file).name.removesuffix(".jinja")
    assert f"template: {stem} (the template the data was rendered with)" in unrecorded
    bare = resolve_run(config.model_copy(update={"template_choice": None, "chat_template": None}), hardware=CPU)
    assert not any(line.startswith("template:") for line in bare.table())
