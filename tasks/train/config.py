"""Training configuration: pydantic models at the edge (`TrainOptions`, the user's options; `TrainConfig`, one run:
the options plus its data, plan and run folder, as the CLI, the flows and `run.json` carry it), and small frozen
dataclasses the worker's components take.

`TrainConfig` is validated once, when it is built; the worker reads it back from `RUN_DIR/run.json` and hands each
component only its own slice (its `optimizer` section, `ScheduleConfig`, `CheckpointConfig`, `MetricsConfig`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.manifests import TemplateChoice

RUN_FORMAT_VERSION = 2  # 2: the train options in sections (optimizer, schedule, memory, checkpoint, metrics)
# Everything a checkpoint holds; `init_from` may load any subset.
COMPONENTS = ("model", "optimizer", "lr_scheduler", "progress")


class LoraSettings(BaseModel):
    """`train.lora`: the adapters. `alpha` defaults to twice the rank (a scale of 2, as common recipes use)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(16, ge=1, description="adapter rank")
    alpha: float | None = Field(None, gt=0, description="adapter scale numerator (default: twice the rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: str | tuple[str, ...] = Field("all-linear", description="'all-linear' or module names (q_proj, ...)")
    merge: bool = Field(True, description="also export the merged full model in hf/")

    @field_validator("targets", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str) and value != "all-linear":
            value = tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, list):
            value = tuple(value)
        if value == ():
            raise ValueError("lora.targets is empty; give 'all-linear' or module names such as q_proj,v_proj")
        return value

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class OptimConfig(BaseModel):
    """`train.optimizer`: AdamW, and how its step runs; the worker's optimizer takes this section as it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lr: float = Field(2e-5, gt=0, description="peak learning rate (AdamW)")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.95), description="AdamW beta1 and beta2"
    )
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm (null: no clipping)")
    max_nonfinite_steps: int = Field(3, ge=0, description="fail after this many consecutive skipped NaN/inf steps")
    in_backward: bool = Field(
        False,
        description="one device (parallel: single), full fine-tuning: step each parameter as soon as its gradient is "
        "made and free the gradient (2 bytes a parameter less, for activations); needs grad_clip: null and one "
        "micro-batch a step, and a tensor whose gradient is not finite keeps its values while the others step",
    )
    offload: Literal["off", "all"] | Annotated[int, Field(ge=0)] = Field(
        "off",
        description="one device (parallel: single), full fine-tuning: keep AdamW moments in pinned host memory and "
        "bring them through the GPU for their step (8 bytes a parameter less on the device, 16 over the host link a "
        "step): a number N of decoder layers spread evenly over the stack, or all (every parameter)",
    )

    @field_validator("offload")
    @classmethod
    def _no_layers_is_off(cls, value):
        return "off" if value == 0 else value  # one spelling of "nothing offloaded" for every reader


class ScheduleOptions(BaseModel):
    """`train.schedule`: the learning rate over the steps."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after the warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a share of the peak lr")
    steps: int | None = Field(None, ge=1, description="steps the schedule spans (default: the plan's steps)")


class MemoryOptions(BaseModel):
    """`train.memory`: precision, compilation and what the backward recomputes or keeps on the host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="compute dtype; auto = bf16 on CUDA, fp32 on CPU"
    )
    compile: Literal["auto", "off", "layers"] = Field(
        "auto", description="torch.compile each decoder layer (regional); auto = on CUDA only"
    )
    activation_checkpointing: Literal["auto", "off", "selective", "full"] | Annotated[int, Field(ge=0)] = Field(
        "auto",
        description="recompute decoder layers' activations in the backward: full (every layer), selective (every "
        "other layer), a number of layers (spread evenly), off; auto = on a GPU, the fewest checkpointed layers "
        "whose estimated peak fits",
    )
    activation_memory_budget: Literal["auto"] | Annotated[float, Field(gt=0, le=1)] = Field(
        "auto",
        description="compiled layers: the share of a layer's saved activations the compiler may keep, recomputing "
        "the cheapest of the rest in the backward (torch's activation_memory_budget); 0.99 recomputes only the "
        "elementwise ops (norms, SwiGLU's product: a Llama layer keeps 32% less), lower values matmuls and attention "
        "too; auto = 1 when rows fit without checkpointing, else 0.99 before any layer is checkpointed",
    )
    activation_offload: Literal["auto"] | bool = Field(
        "auto",
        description="with checkpointing: keep the checkpointed layers' inputs in pinned host memory until the "
        "backward (GPU memory for longer rows, two host copies of each layer's input a step, overlapped with "
        "compute); auto = on a GPU, only where the estimate says the planned rows would not fit without it and the "
        "host has the memory",
    )


class CheckpointOptions(BaseModel):
    """`train.checkpoint`: when to save, how many to keep, and what to start from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    every: int = Field(0, ge=0, description="save every K steps (0: only at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept")
    save: bool = Field(
        True,
        description="false: no DCP checkpoint at all, not even at the end (the run cannot resume; the export is "
        "still written): throughput runs of models whose optimizer state outgrows the disk",
    )
    resume: bool = Field(False, description="continue from the run folder's latest checkpoint")
    init_from: str | None = Field(None, description="checkpoint folder (step-N) or run dir to initialise from")
    load_components: tuple[str, ...] = Field(
        ("model",), description="what init_from loads (model, optimizer, lr_scheduler, progress)"
    )
    trust: bool = Field(
        False,
        description="load a checkpoint that has no CHECKSUMS (an older sftflow's, or one made by hand): it cannot be "
        "checked, and loading unpickles its .metadata, so only one you trust",
    )

    @field_validator("load_components", mode="before")
    @classmethod
    def _split_components(cls, value):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("load_components")
    @classmethod
    def _known_components(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [c for c in value if c not in COMPONENTS]
        if unknown:
            raise ValueError(
                f"load_components: unknown component(s) {unknown}; expected a subset of {list(COMPONENTS)}"
            )
        if not value:
            raise ValueError(f"load_components is empty; expected a subset of {list(COMPONENTS)}")
        return tuple(dict.fromkeys(value))


class MetricsOptions(BaseModel):
    """`train.metrics`: what `metrics.jsonl` and the console report, and how often."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    log_every: int = Field(1, ge=1, description="log (and write to metrics.jsonl) every this many steps")
    ema_alpha: float = Field(0.9, ge=0, lt=1, description="smoothing of the step-time EMA behind the ETA")
    peak_tflops: float | None = Field(None, gt=0, description="per-device peak for MFU (default: known GPUs)")


# The flat keys the sections replaced: a run config or `--set` that still names one is told the new key.
_MOVED = {
    "train.optimizer": ("lr", "eps", "weight_decay", "grad_clip", "max_nonfinite_steps"),
    "train.schedule": ("warmup_steps", "min_lr_ratio"),
    "train.memory": ("dtype", "compile", "activation_checkpointing", "activation_memory_budget", "activation_offload"),
    "train.checkpoint": ("keep_last", "init_from", "load_components", "resume"),
    "train.metrics": ("log_every", "ema_alpha", "peak_tflops"),
}
MOVED_KEYS = {key: f"{section}.{key}" for section, keys in _MOVED.items() for key in keys} | {
    "beta1": "train.optimizer.betas",
    "beta2": "train.optimizer.betas",
    "optimizer_in_backward": "train.optimizer.in_backward",
    "optimizer_offload": "train.optimizer.offload",
    "schedule_steps": "train.schedule.steps",
    "checkpoint_every": "train.checkpoint.every",
    "save_checkpoints": "train.checkpoint.save",
    "trust_checkpoint": "train.checkpoint.trust",
}


class TrainOptions(BaseModel):
    """How to train: every option a user sets, and what the cached train stage keys on. It is the `train` section of
    a run config (`SFTConfig.train`) and of `sftflow train`; `TrainConfig` adds where one run reads and writes.
    Its components are sections of their own: `optimizer`, `schedule`, `memory`, `checkpoint`, `lora`, `metrics`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS

    model: str = Field(
        "tiny-llama", description="local folder, hub id, config.json path, or a preset such as 'tiny-llama'"
    )
    model_overrides: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="config overrides for presets and config.json models (e.g. num_hidden_layers)"
    )

    # launch
    nproc: int = Field(1, ge=1, description="worker processes per node (GPUs per node)")
    nnodes: int = Field(1, ge=1, description="torchrun nodes")
    node_rank: int = Field(0, ge=0, description="this node's rank among the nodes")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous (multi-node)")
    rdzv_id: str | None = Field(None, description="rendezvous id shared by all nodes of one run (multi-node)")
    timeout_s: float | None = Field(None, gt=0, description="kill the training process group after this long")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when there is a GPU")
    num_threads: int | None = Field(None, ge=1, description="CPU threads per worker (default: cores / nproc)")
    parallel: Literal["auto", "fsdp", "single"] = Field(
        "auto",
        description="fsdp: FSDP2 over all ranks; single: one process, no sharding (compute-dtype weights, fp32 "
        "masters in the optimizer); auto = single on one CUDA device, fsdp otherwise",
    )

    max_steps: int | None = Field(
        None, ge=0, description="stop after this many optimizer steps (default: the plan's); the schedule is unchanged"
    )
    seed: int = Field(0, description="torch seed of the workers (random initialisation, dropout)")
    optimizer: OptimConfig = Field(OptimConfig(), description="AdamW and how its step runs")
    schedule: ScheduleOptions = Field(ScheduleOptions(), description="the learning rate over the steps")
    memory: MemoryOptions = Field(MemoryOptions(), description="precision, compilation, recomputation, offload")
    checkpoint: CheckpointOptions = Field(CheckpointOptions(), description="saving, resuming, initialising")
    metrics: MetricsOptions = Field(MetricsOptions(), description="metrics.jsonl and the console")

    # parameter-efficient fine-tuning
    lora: LoraSettings | None = Field(None, description="train LoRA adapters on a frozen base (peft)")
    quantize: Literal["none", "nf4"] = Field("none", description="nf4: QLoRA, the frozen base in 4 bits")

    # export and debugging
    export: bool = Field(True, description="write the Hugging Face folder hf/ at the end")
    export_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="dtype of the exported weights")
    save_grads_at_steps: tuple[int, ...] = Field((), description="debug: write full gradients of these steps")

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_is_a_section(cls, value):
        if isinstance(value, str):
            raise ValueError(f"the schedule's kind is now train.schedule.kind (schedule: {{kind: {value}}})")
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainOptions:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        check_single_is_one_process(
            self.parallel, self.nproc * self.nnodes, f"nproc={self.nproc} x nnodes={self.nnodes}"
        )
        if self.quantize != "none" and self.lora is None:
            raise ValueError(f"quantize={self.quantize!r} quantizes a frozen base: it needs train.lora")
        if self.optimizer.in_backward:
            self._check_optimizer_in_backward()
        if self.optimizer.offload != "off" and self.lora is not None:
            raise ValueError(
                f"optimizer.offload={self.optimizer.offload!r} streams the moments of full fine-tuning; LoRA trains "
                "adapters, whose moments are a few MB: drop one"
            )
        check_one_device_path(self)
        if self.nnodes > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            raise ValueError(f"nnodes={self.nnodes} needs rdzv_endpoint (host:port) and rdzv_id, the same on all nodes")
        return self

    def _check_optimizer_in_backward(self) -> None:
        why = "optimizer.in_backward: true steps each parameter as its gradient is made, on one device"
        if self.optimizer.grad_clip is not None:
            raise ValueError(
                f"{why}, before the global gradient norm is known, so it cannot clip: set optimizer.grad_clip: null "
                f"(got {self.optimizer.grad_clip})"
            )
        if self.lora is not None:
            raise ValueError(f"{why}; LoRA's gradients are the adapters', a few MB, with nothing to gain: drop one")
        if self.save_grads_at_steps:
            raise ValueError(f"{why} and frees its gradient, so save_grads_at_steps has none to save")


# The rules below are checked twice, each by one function: when the config is validated, on what it says, and again
# at launch (`sftflow.tasks.train.launch`, `sftflow.tasks.train.resolved`), on what only the launch knows (the
# device, the plan's real micro-batch counts); one definition keeps the two checks and their messages the same.


def check_single_is_one_process(parallel: str, world: int, counted: str) -> None:
    """`parallel: single` trains in one process: refused for a `world` of several (`counted` says how it was
    counted: the config's nproc x nnodes, or the ranks of the launched world)."""
    if parallel == "single" and world > 1:
        raise ValueError(f"parallel='single' trains in one process; got {counted} (use parallel='fsdp' or 'auto')")


def check_one_device_path(options: TrainOptions, device: str | None = None) -> None:
    """`optimizer.in_backward` and `optimizer.offload` run on the one-device path only (one process, parallel:
    single, or auto where that resolves to it). When the config is validated (`device` None) a run that is FSDP
    whatever the device is refused (parallel: fsdp, or several processes); at launch, where the device is known
    (`sftflow.tasks.train.launch.check_one_device_options`), also `auto` on a CPU, which is FSDP there."""
    opt = options.optimizer
    if opt.in_backward:
        asked = "optimizer.in_backward: true steps each parameter as its gradient is made"
    elif opt.offload != "off":
        asked = f"optimizer.offload={opt.offload!r} streams the moments of full fine-tuning"
    else:
        return
    world = options.nproc * options.nnodes
    if device is None:
        fsdp = options.parallel == "fsdp" or world > 1
    else:
        fsdp = parallel_path(options.parallel, world, device) != "single"
    if fsdp:
        on = f" on {device}" if device is not None else ""
        raise ValueError(
            f"{asked}, on one device (one process; parallel: single, or auto on one CUDA device); "
            f"parallel={options.parallel!r} with "
            f"nproc={options.nproc} x nnodes={options.nnodes}{on} is FSDP: set train.parallel: single (one process)"
        )


def check_one_micro_batch(optimizer: OptimConfig, accumulating: bool, facts: str) -> None:
    """`optimizer.in_backward` steps each parameter in the backward of one micro-batch, so a step that adds up
    several on a process cannot: refused where `accumulating`, known from the config when it is validated
    (`SFTConfig.accumulates`) and from the plan's counts at launch (`resolve_run`); `facts` says which."""
    if optimizer.in_backward and accumulating:
        raise ValueError(
            f"train.optimizer.in_backward steps each parameter in the backward of one micro-batch; {facts}: plan one "
            "a step"
        )


class TrainConfig(TrainOptions):
    """One training run: the options, plus the data, plan and run folder it reads and writes (the flow or the
    `sftflow train` command fills these in). The launcher writes it to `RUN_DIR/run.json` for the workers."""

    data: str = Field(description="dataset index folder (sft-data output, or `mock.write_mock_index`)")
    data_split: str = "train"
    plan: str = Field(description="folder holding plan.npz (sft-plan output)")
    tokenizer: str | None = Field(None, description="tokenizer folder copied into hf/ (default: the model's)")
    chat_template: str | None = Field(None, description="the training data's chat template (.jinja), for hf/")
    template_choice: TemplateChoice | None = Field(
        None, description="how the data stage chose that template (None: not recorded), for the run's first lines"
    )
    out: str = Field(description="run directory")

    @property
    def run_dir(self) -> Path:
        return Path(self.out)


def run_config(
    options: TrainOptions,
    *,
    data: str,
    plan: str,
    tokenizer: str | None,
    chat_template: str | None,
    out: str,
    template_choice: TemplateChoice | None = None,
) -> TrainConfig:
    """One run's `TrainConfig`: the options, and the data index, plan, tokenizer and template it reads and the folder
    it writes (`out`); the one place the train stage and the `sftflow train` command build it."""
    return TrainConfig(
        **dict(options), data=data, plan=plan, tokenizer=tokenizer, chat_template=chat_template, out=out,
        template_choice=template_choice,
    )  # fmt: skip


def write_run_json(config: TrainConfig, manifests: dict, path: Path, resolved: dict | None = None) -> None:
    """`run.json`: the frozen config (without the node-specific `node_rank`), the input manifests, and the run's
    resolved choices (`sftflow.tasks.train.resolved.ResolvedRun.to_json`), which the workers apply. Written
    atomically."""
    payload = {
        "format_version": RUN_FORMAT_VERSION,
        "config": config.model_dump(mode="json", exclude={"node_rank"}),
        "manifests": manifests,
    }
    if resolved is not None:
        payload["resolved"] = resolved
    write_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_run_json(run_dir: str | Path) -> TrainConfig:
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the launcher writes it before starting the workers")
    payload = json.loads(path.read_text())
    if payload.get("format_version") != RUN_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {payload.get('format_version')}; expected {RUN_FORMAT_VERSION}")
    return TrainConfig.model_validate(payload["config"])


# ---------------------------------------------------------------------------------------------------------------------
# runtime slices
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant"]
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    folder: Path
    every: int
    keep_last: int
    resume: bool
    enabled: bool
    init_from: Path | None
    load_components: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    path: Path
    ema_alpha: float
    log_every: int
    peak_flops: float | None


def optim_config(c: TrainConfig) -> OptimConfig:
    return c.optimizer


def schedule_config(c: TrainConfig, total_steps: int) -> ScheduleConfig:
    s = c.schedule
    return ScheduleConfig(
        kind=s.kind, warmup_steps=s.warmup_steps, total_steps=total_steps, min_lr_ratio=s.min_lr_ratio
    )


def checkpoint_config(c: TrainConfig) -> CheckpointConfig:
    return CheckpointConfig(
        folder=c.run_dir / "checkpoints",
        every=c.checkpoint.every,
        enabled=c.checkpoint.save,
        keep_last=c.checkpoint.keep_last,
        resume=c.checkpoint.resume,
        init_from=Path(c.checkpoint.init_from) if c.checkpoint.init_from else None,
        load_components=c.checkpoint.load_components,
    )


def metrics_config(c: TrainConfig, peak_flops: float | None) -> MetricsConfig:
    return MetricsConfig(
        path=c.run_dir / "metrics.jsonl",
        ema_alpha=c.metrics.ema_alpha,
        log_every=c.metrics.log_every,
        peak_flops=peak_flops,
    )


def parallel_path(parallel: str, world_size: int, device_type: str) -> str:
    """The training path `parallel` resolves to: `auto` is `single` on one CUDA device (where FSDP only adds copies),
    `fsdp` otherwise."""
    check_single_is_one_process(parallel, world_size, f"a world of {world_size} ranks")
    if parallel == "auto":
        return "single" if world_size == 1 and device_type == "cuda" else "fsdp"
    return parallel
