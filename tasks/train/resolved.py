"""One resolved run: every `auto` of a training run made concrete once, at launch, with the reason it was chosen.

`resolve(config, hardware, ...)` takes the run's options (`TrainConfig`), the hardware it trains on (`Hardware`,
detected once by `detect_hardware`, or made by hand: a test's fake H100) and what the plan and data stages fixed
(the row length, micro-batches a step, the vocabulary, the chat template), and returns a frozen `ResolvedRun`: the
parallel path, compiled layers, compute dtype, the activation memory budget, activation offload and checkpointing
(the memory policy of `sftflow.tasks.train.activations`, on the model built on the meta device), the optimizer
offload, the attention and loss kernels (`sftflow.kernels.dispatch`'s choice and why), the row length and the
template. The launcher writes it into `RUN_DIR/run.json` (`resolved`); the worker reads it and applies it, deciding
nothing again, and prints `table()` as its first lines.

One choice comes before the rest: `plan.tokens_per_rank: auto`, the packed row length, which the plan fixes before a
run exists. `resolve_rows` makes it on the same `Hardware` (`plan_hardware`: the planning machine's GPU, or one with
`plan.device_memory_gib` free), the same meta model (`meta_model`) and state estimate (`model_state_bytes`) as
`resolve`, under the planning rules of `planned_memory`; the flow hands the plan stage that `Choice` as data, the plan
folder records it (`sftflow.tasks.plan.row_length`), and `resolve_run` reads it back, so the run's `tokens per rank`
line says why its rows have that length.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from sftflow.tasks.train.hardware import Hardware, detect_hardware

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "Choice", "Hardware", "ResolvedRun", "detect_hardware", "plan_hardware", "resolve", "resolve_rows", "resolve_run",
]  # fmt: skip

log = logging.getLogger("sftflow.train")
plan_log = logging.getLogger("sftflow.plan")  # the row length is chosen as the plan is made
GIB = 2**30


@dataclass(frozen=True)
class Choice:
    """A resolved setting: its concrete `value`, what was asked (`setting`), and why."""

    value: Any
    setting: Any
    reason: str


@dataclass(frozen=True)
class ResolvedRun:
    """Every choice of one training run (see the module docstring). `table()` is what the run logs first."""

    hardware: Hardware
    device: str  # cpu or cuda
    parallel: Choice  # single or fsdp
    compile: Choice  # bool: compiled decoder layers
    dtype: Choice  # bf16 or fp32
    tokens_per_rank: Choice  # the planned row length
    micro_batches: int  # per process and step
    state_bytes: float  # weights, masters, moments and gradients per device
    activation_memory_budget: Choice  # float
    activation_offload: Choice  # bool
    activation_checkpointing: Choice  # off, selective, full or a number of layers
    num_layers: int
    optimizer_offload: Choice
    attention: Choice  # the attention backend
    loss: Choice  # the cross-entropy backend
    queue_steps: Choice  # bool: step s + 1 queued before step s's totals are read
    template: Choice | None = None  # the chat template the data was rendered with, where the data stage says

    def choices(self) -> dict[str, Any]:
        """The concrete values alone (no measurements, no reasons): what the trained model depends on, and so what
        the train stage's cache key holds."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Choice) and f.name not in ("attention", "loss", "queue_steps"):
                out[f.name] = value.value
        return out

    def cache_key(self) -> dict[str, Any]:
        """What the train stage's cache key holds of the run (`sftflow.tasks.core.caching`): `choices()`."""
        return self.choices()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ResolvedRun:
        hw = dict(data["hardware"])
        if hw.get("capability") is not None:
            hw["capability"] = tuple(hw["capability"])
        values = {k: Choice(**v) if isinstance(v, dict) else v for k, v in data.items() if k != "hardware"}
        return cls(hardware=Hardware(**hw), **values)

    def table(self) -> list[str]:
        """The resolved run as short lines: `setting: value (why)`."""
        from sftflow.tasks.train.activations import checkpointing_label

        ckpt = self.activation_checkpointing.value
        label = checkpointing_label(ckpt, self.num_layers)
        layers = label if label in ("off",) else _layers_label(ckpt, self.num_layers)
        rows = [
            ("hardware", self.hardware.describe(), None),
            ("parallel", self.parallel.value, self.parallel.reason),
            ("dtype", self.dtype.value, self.dtype.reason),
            ("compile", "layers" if self.compile.value else "off", self.compile.reason),
            ("attention", self.attention.value, self.attention.reason),
            ("loss", self.loss.value, self.loss.reason),
            ("tokens per rank", f"{self.tokens_per_rank.value:,}", self.tokens_per_rank.reason),
            ("activation checkpointing", layers, self.activation_checkpointing.reason),
            ("activation offload", "on" if self.activation_offload.value else "off", self.activation_offload.reason),
            ("activation memory budget", self.activation_memory_budget.value, self.activation_memory_budget.reason),
            ("optimizer offload", self.optimizer_offload.value, self.optimizer_offload.reason),
            ("steps queued ahead", "on" if self.queue_steps.value else "off", self.queue_steps.reason),
        ]
        if self.template is not None:
            rows.append(("template", self.template.value, self.template.reason))
        return [f"{name}: {value}" + (f" ({why})" if why else "") for name, value, why in rows]


def _layers_label(mode: str | int, num_layers: int) -> str:
    from sftflow.tasks.train.activations import checkpointed_layers

    count = checkpointed_layers(mode, num_layers)
    return f"{count} of {num_layers} layers" + (f" ({mode})" if isinstance(mode, str) else "")


def _kernel_reason(reason: str) -> str:
    """`dispatch`'s reason, short: why the backends before it were skipped, or that it comes first."""
    if "; skipped " in reason:
        return reason.split("; skipped ", 1)[1]
    if reason.startswith("first available for "):
        return "first choice for " + reason.removeprefix("first available for ").split(" in order ")[0]
    return reason


def memory_policy(
    *,
    checkpointing: str | int,
    budget: str | float,
    offload: str | bool,
    compiled: bool,
    kind: str,
    model_config,
    row_tokens: int,
    state: float,
    free: int | None,
    host_room: int | None,
    ranks_on_host: int,
    num_layers: int,
) -> tuple[Choice, Choice, Choice]:
    """The activation memory budget, activation offload and checkpointing of one run: the rules of
    `sftflow.tasks.train.activations` (`resolve_memory_budget`, `resolve_activation_offload`,
    `resolve_activation_checkpointing`, `settle_memory_budget`), in the order they depend on each other, against
    `free` bytes on one device (CUDA) and `state` bytes of weights and optimizer state."""
    import torch

    from sftflow.tasks.train.activations import (
        checkpointed_layers,
        resolve_activation_checkpointing,
        resolve_activation_offload,
        resolve_memory_budget,
        settle_memory_budget,
    )

    device = torch.device(kind)
    b = resolve_memory_budget(budget, compiled, device, model_config, row_tokens, state, free)
    off = resolve_activation_offload(
        offload, checkpointing, device, model_config, row_tokens, state, free, b, host_room, ranks_on_host
    )
    ckpt = resolve_activation_checkpointing(checkpointing, device, model_config, row_tokens, state, off, free, b)
    settled = settle_memory_budget(budget, b, ckpt, num_layers)
    where = (
        f"rows of {row_tokens:,} tokens, {state / GIB:.1f} GiB of weights and optimizer state in {free / GIB:.1f} "
        "GiB free"
        if free is not None and kind == "cuda"
        else "not on a GPU"
    )
    if checkpointing != "auto":
        ckpt_why = "set"
    elif kind != "cuda":
        ckpt_why = "auto: off on a CPU"
    else:
        count = checkpointed_layers(ckpt, num_layers)
        ckpt_why = f"auto: the fewest whose estimated peak fits; {where}" if count else f"auto: fits without; {where}"
    if not compiled:
        budget_why = "no compiled layers to apply it to" if budget != "auto" else "auto: no compiled layers"
    elif budget != "auto":
        budget_why = "set"
    elif settled != b:
        budget_why = "auto: every layer is checkpointed"
    else:
        budget_why = f"auto: {'the rows fit without recomputing' if b == 1 else 'recompute elementwise ops first'}"
    if offload is not True and offload is not False:
        off_why = (
            "auto: needs checkpointing on a GPU"
            if kind != "cuda" or checkpointing == "off"
            else f"auto: {'the rows need it' if off else 'the rows fit without it'}"
        )
    else:
        off_why = "set" if kind == "cuda" and checkpointing != "off" else "set, but off without checkpointing on a GPU"
    return (
        Choice(settled, budget, budget_why),
        Choice(off, offload, off_why),
        Choice(ckpt, checkpointing, ckpt_why),
    )


def meta_model(config, vocab_size: int | None):
    """The run's model on the meta device (no weights read) with its LoRA adapters, as the worker builds it: the
    vocabulary grown to `vocab_size` where the data's tokenizer has more tokens than the model's config."""
    import torch
    from transformers import AutoModelForCausalLM

    from sftflow.tasks.train.lora import apply_lora
    from sftflow.tasks.train.model import model_config

    mc = model_config(config.model, vocab_size=vocab_size, overrides=config.model_overrides)
    if vocab_size is not None and mc.vocab_size < vocab_size:
        mc.vocab_size = vocab_size
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(mc)
        if config.lora is not None:
            apply_lora(lm, config.lora, config.model)
    return lm


def host_room(host_bytes: int | None, lm, optimizer_offload: str | int) -> int | None:
    """Host memory the checkpointed inputs may take: what the host has available, less the headroom the process
    keeps and the AdamW moments `optimizer.offload` is about to pin (None where the host does not say)."""
    from sftflow.tasks.train.host_moments import HOST_HEADROOM, offloaded_numel

    if host_bytes is None:
        return None
    moments = 8 * offloaded_numel(lm, optimizer_offload)[0] if optimizer_offload != "off" else 0
    return max(host_bytes - HOST_HEADROOM - moments, 0)


def model_state_bytes(
    lm: nn.Module,
    quantize: str,
    parallel: str,
    world_size: int,
    accumulating: bool,
    released: bool = False,
    offload: str | int = "off",
) -> float:
    """`state_bytes` of `lm` as built for training (a meta model will do): its trained and frozen parameters, the
    frozen ones at the size `quantize` holds them in, on `parallel` over `world_size` ranks (`released`: stepped in
    the backward; `offload`: `train.optimizer.offload`)."""
    from sftflow.tasks.train.activations import state_bytes
    from sftflow.tasks.train.host_moments import offloaded_numel
    from sftflow.tasks.train.model import decoder_layers
    from sftflow.tasks.train.quantize import frozen_weight_bytes

    return state_bytes(
        trained_params=sum(p.numel() for p in lm.parameters() if p.requires_grad),
        frozen_bytes=frozen_weight_bytes(lm, quantize),
        parallel=parallel,
        world_size=world_size,
        total_params=sum(p.numel() for p in lm.parameters()),
        num_layers=len(decoder_layers(lm)),
        accumulating=accumulating,
        largest_trained=max((p.numel() for p in lm.parameters() if p.requires_grad), default=0) if released else None,
        offloaded=offloaded_numel(lm, offload) if parallel == "single" else (0, 0),
    )


@dataclass(frozen=True)
class PlannedMemory:
    """What `plan.tokens_per_rank: auto` sizes rows for (`planned_memory`)."""

    parallel: str  # single or fsdp: the training path on the plan's ranks
    checkpointing: str | int  # off, selective, full or a number of layers
    budget: float  # the activation memory budget of compiled layers
    offload: bool  # the checkpointed layers' inputs in host memory


def planned_memory(config, num_ranks: int) -> PlannedMemory:
    """The rules the row length is planned under, before the rows (and so the launch's memory choices) exist; a
    setting that was made is planned with as it is, and for `auto` settings:

    - parallel: the path `num_ranks` GPUs take (`parallel_path` on CUDA: rows are sized for the GPUs that train);
    - activation checkpointing `auto`: off, the rows that fit without it (the fastest per token; `full` plans the
      longest rows a GPU holds);
    - activation memory budget `auto`: 1, all of each layer's activations kept (the launch may still lower it); a set
      budget counts only with compiled layers (`compile: auto` compiles on GPUs, `off` has none to apply it to);
    - activation offload `auto`: none (the launch may still turn it on); `true` counts only with checkpointing.
    """
    from sftflow.tasks.train.config import parallel_path

    memory = config.memory
    parallel = parallel_path(config.parallel, num_ranks, "cuda")
    checkpointing = "off" if memory.activation_checkpointing == "auto" else memory.activation_checkpointing
    budget = (
        1.0 if memory.activation_memory_budget == "auto" or memory.compile == "off" else memory.activation_memory_budget
    )
    offload = memory.activation_offload is True and checkpointing != "off"
    return PlannedMemory(parallel=parallel, checkpointing=checkpointing, budget=budget, offload=offload)


def plan_hardware(memory_gib: float | None) -> Hardware | None:
    """The GPU `plan.tokens_per_rank: auto` sizes rows for: one with `memory_gib` free where it is given
    (`plan.device_memory_gib`: no GPU needed), else this machine's first GPU as a launch detects it
    (`detect_hardware`), else None (no GPU to ask)."""
    if memory_gib is not None:
        memory = int(memory_gib * GIB)
        return Hardware(kind="cuda", name="plan.device_memory_gib", memory=memory, total_memory=memory)
    import torch

    return detect_hardware("cuda", 1) if torch.cuda.is_available() else None


def resolve_rows(
    config,
    hardware: Hardware | None,
    *,
    setting: int | str,
    num_ranks: int,
    vocab_size: int | None,
    accumulating: bool,
) -> Choice:
    """The plan's row length (`plan.tokens_per_rank`): a number as `set`; `auto` as the longest row (a multiple of
    1024, at most the model's `max_position_embeddings`) whose estimated peak fits in the free memory of `hardware`
    (`plan_hardware`) beside the weights and optimizer state of `config` (a run's `TrainOptions`) on each of
    `num_ranks` GPUs, under the rules of `planned_memory`. `vocab_size`: the data's (a preset's vocabulary comes from
    it); `accumulating`: a step adds up several micro-batches (fp32 gradients on one GPU)."""
    from sftflow.tasks.train.activations import checkpointing_label, max_row_tokens
    from sftflow.tasks.train.model import PRESETS

    if setting != "auto":
        return Choice(setting, setting, "set")
    if hardware is None or hardware.kind != "cuda" or hardware.memory is None:
        raise ValueError(
            "plan.tokens_per_rank: auto sizes rows for the training GPUs' memory, and this machine has no GPU to "
            "ask; set plan.device_memory_gib (free GiB on one training GPU: ~139 on an idle H200, ~79 on an 80 GB "
            "H100) or give plan.tokens_per_rank as a number"
        )
    free = hardware.memory
    # A preset's vocabulary comes from the data; without it, a stand-in that holds the config's BOS/EOS ids.
    stand_in = max(vocab_size or 0, 256) if config.model in PRESETS else vocab_size
    try:
        lm = meta_model(config, stand_in)
    except OSError as err:
        why = " ".join(str(err).split())  # one line: the hub's messages span several
        raise ValueError(
            f"plan.tokens_per_rank: auto reads the model's config, and train.model {config.model!r} has none here "
            f"({why}); give a local folder or config.json, or plan.tokens_per_rank as a number"
        ) from err
    mc = lm.config
    planned = planned_memory(config, num_ranks)
    mode = planned.checkpointing
    state = model_state_bytes(
        lm, config.quantize, planned.parallel, num_ranks, accumulating, config.optimizer.in_backward,
        config.optimizer.offload,
    )  # fmt: skip
    fits = max_row_tokens(mc, mode, state, free, offload=planned.offload, budget=planned.budget)
    limit = getattr(mc, "max_position_embeddings", None)
    tokens = min(fits, limit // 1024 * 1024 or limit) if limit else fits
    if tokens <= 0:
        more = "" if mode == "full" else "; train.memory.activation_checkpointing: full leaves more room, or "
        raise ValueError(
            f"plan.tokens_per_rank: auto: {config.model}'s weights and optimizer state (~{state / GIB:.1f} GiB a GPU "
            f"on the {planned.parallel} path) leave no room for a row of 1,024 tokens in {free / GIB:.1f} GiB"
            f"{more or '; '}train LoRA (train.lora) or on more GPUs (train.nproc)"
        )
    label = checkpointing_label(mode, mc.num_hidden_layers)
    how = "without checkpointing" if label == "off" else f"with activation checkpointing {label}"
    how += " and activation offload" if planned.offload else ""
    how += f" at an activation memory budget of {planned.budget:g}" if planned.budget != 1 else ""
    path = f" per GPU on the fsdp path over {num_ranks} GPUs" if planned.parallel == "fsdp" else ""
    where = f"{state / GIB:.1f} GiB of weights and optimizer state{path} in {free / GIB:.1f} GiB free ({hardware.name})"
    if tokens < fits:
        reason = f"auto: the model's {limit:,} positions, shorter than the longest row that fits {how}: {where}"
    else:
        reason = f"auto: the longest row that fits {how}: {where}"
    choice = Choice(tokens, "auto", reason)
    plan_log.info("tokens_per_rank: %s (%s)", f"{tokens:,}", reason)
    return choice


def resolve(
    config,
    hardware: Hardware,
    *,
    tokens_per_rank: int,
    micro_batches: int,
    vocab_size: int | None,
    rows: Choice | None = None,
    template: Choice | None = None,
    lm=None,
) -> ResolvedRun:
    """Every `auto` of `config` (a `TrainConfig`) on `hardware`, for rows of `tokens_per_rank` tokens and
    `micro_batches` a step on each process (see the module docstring). `rows`: how the plan chose that length
    (`resolve_rows`, as the plan recorded it; default: "the plan's rows"). `lm`: the run's model on the meta device
    (default: built from the config, `meta_model`)."""
    import torch

    from sftflow.kernels import attention, cross_entropy
    from sftflow.tasks.train.activations import checkpointed_layers
    from sftflow.tasks.train.config import parallel_path
    from sftflow.tasks.train.model import decoder_layers

    if rows is not None and rows.value != tokens_per_rank:
        raise ValueError(f"rows of {tokens_per_rank:,} tokens, and their choice says {rows.value:,}")
    kind, world = hardware.kind, hardware.count
    lm = meta_model(config, vocab_size) if lm is None else lm
    mc = lm.config
    num_layers = len(decoder_layers(lm))

    compiled = config.memory.compile == "layers" or config.memory.compile == "auto" and kind == "cuda"
    compile_why = "set" if config.memory.compile != "auto" else f"auto: {'on' if compiled else 'off'} on {kind}"
    dtype = config.memory.dtype if config.memory.dtype != "auto" else "bf16" if kind == "cuda" else "fp32"
    dtype_why = "set" if config.memory.dtype != "auto" else f"auto: {dtype} on {kind}"
    parallel = parallel_path(config.parallel, world, kind)
    if config.parallel != "auto":
        parallel_why = f"set, {world} process(es)"
    elif parallel == "single":
        parallel_why = "auto: one CUDA device"
    else:
        parallel_why = f"auto: {world} process(es) on {kind}"

    state = model_state_bytes(
        lm, config.quantize, parallel, world, micro_batches > 1, config.optimizer.in_backward, config.optimizer.offload
    )
    free = hardware.memory if kind == "cuda" else None
    budget, offload, checkpointing = memory_policy(
        checkpointing=config.memory.activation_checkpointing, budget=config.memory.activation_memory_budget,
        offload=config.memory.activation_offload, compiled=compiled, kind=kind, model_config=mc,
        row_tokens=tokens_per_rank, state=state, free=free,
        host_room=host_room(hardware.host_bytes, lm, config.optimizer.offload),
        ranks_on_host=hardware.ranks_on_host, num_layers=num_layers,
    )  # fmt: skip

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    att = attention.preview_backend(kind, torch_dtype, head_dim, hardware.capability)
    ce = cross_entropy.preview_backend(kind, torch_dtype)
    offload_why = (
        "off" if config.optimizer.offload == "off" else "set: AdamW moments in pinned host memory (one device)"
    )
    return ResolvedRun(
        hardware=hardware,
        device=kind,
        parallel=Choice(parallel, config.parallel, parallel_why),
        compile=Choice(compiled, config.memory.compile, compile_why),
        dtype=Choice(dtype, config.memory.dtype, dtype_why),
        tokens_per_rank=rows or Choice(tokens_per_rank, tokens_per_rank, "the plan's rows"),
        micro_batches=micro_batches,
        state_bytes=state,
        activation_memory_budget=budget,
        activation_offload=offload,
        activation_checkpointing=checkpointing,
        num_layers=num_layers,
        optimizer_offload=Choice(config.optimizer.offload, config.optimizer.offload, offload_why),
        attention=Choice(att.name, os.environ.get(attention.ENV_VAR, "auto") or "auto", _kernel_reason(att.reason)),
        loss=Choice(ce.name, os.environ.get(cross_entropy.ENV_VAR, "auto") or "auto", _kernel_reason(ce.reason)),
        queue_steps=queue_steps(kind, offload.value and checkpointed_layers(checkpointing.value, num_layers) > 0),
        template=template,
    )


QUEUE_STEPS_VAR = "SFTFLOW_QUEUE_STEPS"


def queue_steps(kind: str, offloaded: bool) -> Choice:
    """Whether the training loop queues step s + 1 before it reads step s's totals: on a GPU, where the device would
    otherwise wait for the host at every step boundary; not on the CPU, where nothing runs behind the host and a
    step's time would shift onto the next one. `SFTFLOW_QUEUE_STEPS=0` takes GPU steps one by one (each step's time
    its own), `=1` queues on the CPU too (the GPU's loop, tested on a CPU). Never with activations offloaded to host
    memory: each step pins fresh host buffers for them, which queueing ahead would double."""
    asked = os.environ.get(QUEUE_STEPS_VAR, "auto") or "auto"
    if asked not in ("auto", "0", "1"):
        raise ValueError(f"{QUEUE_STEPS_VAR}={asked!r}: expected auto, 0 or 1")
    if offloaded:
        return Choice(False, asked, "off while checkpointed activations are in host memory")
    if asked != "auto":
        return Choice(asked == "1", asked, f"set by {QUEUE_STEPS_VAR}={asked}")
    on = kind == "cuda"
    why = "auto: on a GPU, so it never waits for the host" if on else f"auto: off on {kind}, each step's time its own"
    return Choice(on, asked, why)


def run_vocab_size(dataset_vocab: int | None, tokenizer_path: str | None) -> int | None:
    """The vocabulary the run's model is built for: the data's, or the tokenizer's where it has more tokens."""
    if tokenizer_path is None:
        return dataset_vocab
    from transformers import AutoTokenizer

    return max(dataset_vocab or 0, len(AutoTokenizer.from_pretrained(tokenizer_path)))


def template_choice(chat_template: str | None, chosen=None) -> Choice | None:
    """The chat template the data stage rendered the data with, where the run was given it: its name and how the
    data stage chose it (`chosen`, a `TemplateChoice`), or, where that was not recorded (data from before it was,
    a bare index), the template file's name."""
    if chat_template is None:
        return None
    if chosen is not None:
        return Choice(chosen.name, chat_template, chosen.reason())
    from pathlib import Path

    name = Path(chat_template).name.removesuffix(".jinja")
    return Choice(name, chat_template, "the template the data was rendered with")


def resolve_run(config, *, dataset_vocab: int | None = None, hardware: Hardware | None = None) -> ResolvedRun:
    """`resolve` for `config` (a `TrainConfig`) as it launches: its plan's rows (and how the plan chose their length,
    where it recorded that) and micro-batches, the vocabulary of its data and tokenizer, and the hardware of this host
    (`detect_hardware`) unless given. Refuses a plan that adds up several micro-batches a step for
    `optimizer_in_backward`."""
    from sftflow.tasks.plan.row_length import read_row_length
    from sftflow.tasks.train.config import check_one_micro_batch
    from sftflow.tasks.train.data import dataset_vocab_size, load_plan, open_dataset, plan_path
    from sftflow.tasks.train.export import tokenizer_source

    plan = load_plan(config.plan)
    # A plan from before the choice was recorded, or whose plan.npz was replaced since: "the plan's rows".
    record = read_row_length(plan_path(config.plan).parent)
    rows = None
    if record is not None and record.value == plan.tokens_per_rank:
        rows = Choice(record.value, record.setting, record.reason)
    if dataset_vocab is None:
        dataset_vocab = dataset_vocab_size(open_dataset(config.data, config.data_split))
    vocab = run_vocab_size(dataset_vocab, tokenizer_source(config.model, config.tokenizer))
    hardware = hardware or detect_hardware(config.device, config.nproc, config.nnodes)
    world = hardware.count
    # a plan made for more ranks than train here gives each process several plan ranks' rows a step
    micro_batches = plan.micro_batches_per_step * plan.num_ranks // world
    facts = (
        f"{plan_path(config.plan)} has {micro_batches} a step on each of {world} process(es) "
        f"({plan.micro_batches_per_step} micro-batch(es) x {plan.num_ranks} planned ranks)"
    )
    check_one_micro_batch(config.optimizer, micro_batches > 1, facts)
    return resolve(
        config, hardware, tokens_per_rank=plan.tokens_per_rank, micro_batches=micro_batches, vocab_size=vocab,
        rows=rows, template=template_choice(config.chat_template, config.template_choice),
    )  # fmt: skip


def read_resolved(run_dir) -> ResolvedRun:
    """The run's resolved choices from `RUN_DIR/run.json` (`resolved`), as the launcher wrote them."""
    from pathlib import Path

    path = Path(run_dir) / "run.json"
    payload = json.loads(path.read_text())
    if "resolved" not in payload:
        raise ValueError(f"{path}: no `resolved` choices; the launcher (`resolve_run`) writes them before the workers")
    return ResolvedRun.from_json(payload["resolved"])
