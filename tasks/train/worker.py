"""The training worker: `torchrun ... -m sftflow.tasks.train.worker RUN_DIR`.

Reads `RUN_DIR/run.json` (written by `sftflow.tasks.train.launch`), trains the plan's steps with FSDP2 (or, on one
GPU, without sharding: `sftflow.tasks.train.single_device`), writes `metrics.jsonl`, DCP checkpoints and the Hugging
Face export. Same code on CPU (gloo, fp32) and CUDA (NCCL, bf16).

Loss normalisation. Step `s` of the plan trains `step_loss_tokens[s]` targets over all its micro-batches and ranks,
known before training. Each micro-batch backpropagates `sum of its token losses / step_loss_tokens[s]`, and FSDP
*sums* gradients over ranks (divide factor 1), so the update equals one big batch holding the whole step, whatever
the number of ranks and micro-batches.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from sftflow.tasks.core.disk_full import DiskFull, as_disk_full, report_line
from sftflow.tasks.core.locks import hold_as_writer
from sftflow.tasks.train import config as cfg
from sftflow.tasks.train.activations import apply_activation_checkpointing, apply_memory_budget, checkpointing_label
from sftflow.tasks.train.breakdown import Breakdown, add_cells, breakdown_of
from sftflow.tasks.train.checkpoint import (
    Checkpointer,
    ModelState,
    OptimizerState,
    Progress,
    SchedulerState,
    full_tensor,
    restores_model,
)
from sftflow.tasks.train.compile import compile_layers
from sftflow.tasks.train.data import (
    RankBatches,
    dataset_vocab_size,
    load_plan,
    open_dataset,
    plan_path,
    trained_tokens_by_source,
)
from sftflow.tasks.train.export import export_streamed, tokenizer_source
from sftflow.tasks.train.fsdp import DistEnv, init_distributed, shard_model
from sftflow.tasks.train.host_moments import describe_units
from sftflow.tasks.train.lifetime import TORCHRUN_PID_VAR, WRITERS_VAR, die_with_parent
from sftflow.tasks.train.lora import (
    apply_lora,
    compute_adapters_in_autocast,
    export_adapter,
    freeze_in_dtype,
    merged_tensor_of,
)
from sftflow.tasks.train.metrics import MetricsLogger, default_peak_flops
from sftflow.tasks.train.model import (
    CausalLMLoss,
    attention_width,
    build_training_model,
    count_params,
    decoder_layers,
    layer_windows,
    model_batch,
)
from sftflow.tasks.train.oom import MemoryPicture, MemoryWatch
from sftflow.tasks.train.quantize import base_tensor_of, quantize_base
from sftflow.tasks.train.resolved import read_resolved
from sftflow.tasks.train.single_device import MasterAdamW, MasterModelState, single_device_model
from sftflow.tasks.train.weights import CheckpointFiles, materialize

log = logging.getLogger("sftflow.train")


def param_groups(model: torch.nn.Module, c: cfg.OptimConfig) -> list[dict]:
    """The trained parameters (all, or a LoRA run's adapters), with weight decay on matrices only (not on norms and
    biases)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    return [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, c: cfg.OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW (one kernel for all parameters, CPU and CUDA) for the FSDP path. Fused, because `optimizer_step`
    hands it the clipping factor and the non-finite flag as device tensors, so clipping and skipping cost no extra
    pass over the gradients and no host sync."""
    return torch.optim.AdamW(param_groups(model, c), lr=c.lr, betas=c.betas, eps=c.eps, fused=True)


def parallelize(
    lm: torch.nn.Module,
    env: DistEnv,
    parallel: str,
    param_dtype: torch.dtype,
    c: cfg.OptimConfig,
    weights: CheckpointFiles | None = None,
    on_meta: bool = False,
    lora: bool = False,
    seed: int = 0,
    quantize: bool = False,
):
    """The training module (`CausalLMLoss` root), its optimizer and the `model` checkpoint component, for `parallel`
    (resolved): FSDP2 with fused AdamW, or one device with bf16 weights and `MasterAdamW`.

    A model `on_meta` gets its storage here, after sharding, and its weights from `weights` (each rank its rows);
    with `weights` None it is left for a checkpoint to fill. With `lora`, the frozen base is held in `param_dtype`,
    the adapters and their fused AdamW stay fp32, and checkpoints hold the adapters only; with `quantize` too (one
    device only), its linear layers in NF4 (`sftflow.tasks.train.quantize`)."""
    if quantize and (parallel != "single" or not lora):
        raise ValueError("train.quantize: nf4 trains LoRA adapters on one GPU without FSDP (parallel: single)")
    if lora:
        freeze_in_dtype(lm, param_dtype)
    if parallel == "single":
        if quantize:
            quantize_base(lm, env.device, weights, param_dtype, seed=seed)
        elif on_meta:
            materialize(lm, lm, env.device, weights, seed=seed)
        if lora:
            lm.to(env.device)
            mixed = param_dtype != torch.float32  # a bf16 base under fp32 adapters
            if mixed:
                compute_adapters_in_autocast(lm)
            model = CausalLMLoss(lm, autocast_dtype=param_dtype if mixed else None)
            return model, build_optimizer(model, c), ModelState(lm, trained_only=True)
        model, optimizer = single_device_model(
            lm, env.device, param_dtype, partial(param_groups, c=c), lr=c.lr, betas=c.betas, eps=c.eps,
            in_backward=c.in_backward, offload=c.offload,
        )  # fmt: skip
        return model, optimizer, MasterModelState(lm, optimizer)
    model = shard_model(lm, env, param_dtype)
    if on_meta:
        materialize(model, lm, env.device, weights, seed=seed)
    return model, build_optimizer(model, c), ModelState(lm, trained_only=lora)


def lr_factor(step: int, c: cfg.ScheduleConfig) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, then cosine/linear/constant."""
    if step < c.warmup_steps:
        return (step + 1) / c.warmup_steps
    if c.kind == "constant":
        return 1.0
    progress = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
    if c.kind == "cosine":
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - c.min_lr_ratio) * progress


@dataclass(frozen=True)
class AttentionSpan:
    """How much of causal attention's L**2 a document of L tokens costs, averaged over the layers: `windowed` of
    them see at most `window` keys per query, which is 2*L*W - W**2 in the same units once L > W (full causal
    attention's L*(L+1)/2 query-key pairs, doubled). Without windows it is L**2: the MFU's attention term."""

    windowed: float = 0.0  # the share of layers with a window
    window: int | None = None

    @classmethod
    def of(cls, windows: list[int | None]) -> AttentionSpan:
        sizes = {w for w in windows if w is not None}
        if not sizes:
            return cls()
        if len(sizes) > 1:  # one window size per model in every family here; the largest bounds the others
            sizes = {max(sizes)}
        return cls(windowed=sum(w is not None for w in windows) / len(windows), window=sizes.pop())

    def cost(self, lengths: torch.Tensor) -> torch.Tensor:
        """Sum over documents of their attention cost in L**2 units (`lengths` fp64)."""
        full = (lengths**2).sum()
        if self.window is None:
            return full
        w = float(self.window)
        windowed = torch.where(lengths > w, 2 * lengths * w - w * w, lengths**2).sum()
        return (1 - self.windowed) * full + self.windowed * windowed


def forward_backward(
    model,
    batches: list[dict],
    step_loss_tokens: int,
    device: torch.device,
    num_cells: int = 0,
    span: AttentionSpan = AttentionSpan(),
) -> torch.Tensor:
    """Accumulate the gradients of `sum(token losses) / step_loss_tokens` over this rank's micro-batches.

    Returns this rank's fp64 `[loss sum, trained targets, tokens, attention cost (span.cost: sum of doc_length**2
    without windows)]` for the step's metrics,
    followed, with `num_cells` (the batches carry `loss_row_cells`), by the flat `(3, num_cells)` breakdown table.
    A micro-batch without trained targets still runs forward and backward (the loss is a graph-connected zero), so
    FSDP's collectives stay in step across ranks.
    """
    loss_total = torch.zeros((), dtype=torch.float64, device=device)  # stays on the device: no sync per batch
    table = torch.zeros(3, num_cells, dtype=torch.float64, device=device)
    counts = torch.zeros(3, dtype=torch.float64)
    vocab_size = getattr(model, "vocab_size", None)
    for batch in batches:
        inputs = batch.get("device_inputs") or model_batch(batch, device, vocab_size)  # staged ahead by Prefetch
        cells = inputs.get("loss_row_cells")
        if cells is not None:
            inputs = {k: v for k, v in inputs.items() if k != "loss_row_cells"}
        loss_sum = model(**inputs)
        (loss_sum / step_loss_tokens).backward()
        loss_total += loss_sum.detach()
        if cells is not None:
            add_cells(table, cells, model.last_row_stats)
        lengths = batch["doc_lengths"].double()
        counts += torch.stack([torch.tensor(float(batch["num_loss_tokens"])), lengths.sum(), span.cost(lengths)])
    # Pinned and non-blocking: a plain copy to the GPU would wait for the whole backward before the optimizer is
    # queued, and the GPU would idle while the host queues it.
    counts = counts.pin_memory() if device.type == "cuda" else counts
    return torch.cat([loss_total.reshape(1), counts.to(device, non_blocking=True), table.reshape(-1)])


def gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This step's gradients: `param.grad` (FSDP), or held by `MasterAdamW` (one device; fp32 once accumulated)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.gradients()
    return [p.grad for p in model.parameters() if p.grad is not None]


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global gradient L2 norm over all shards, as a 0-d fp32 tensor on the device (no host sync)."""
    if grads and isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).full_tensor().float()
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # fp32 per-tensor norms, also for bf16 gradients (a bf16 norm would keep ~3 significant digits)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Clip to `max_norm` by the global norm and step, skipping the update when the norm is not finite.

    Both go into the fused AdamW (or `MasterAdamW`) kernel as device tensors: it divides every gradient by `grad_scale`
    (= max(1, norm / max_norm), which is `clip_grad_norm_`'s factor) and leaves parameters, moments and step
    counters untouched when `found_inf` is set. Returns the (unclipped) norm tensor.

    A `MasterAdamW` stepping in the backward has stepped every parameter already: only the norm of what it stepped
    is left to report.
    """
    if isinstance(optimizer, MasterAdamW) and optimizer.in_backward:
        if max_norm is not None:
            raise ValueError("an optimizer that steps in the backward cannot clip: max_norm must be None")
        return optimizer.released_norm()
    norm = grad_norm(gradients(model, optimizer))
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.grad_scale = None if max_norm is None else torch.clamp(norm / max_norm, min=1.0)
    optimizer.step()
    return norm


@dataclass(frozen=True, kw_only=True)
class StepTotals:
    """One optimizer step, summed over ranks."""

    loss_sum: float
    targets: int
    tokens: int
    sum_sq_doc_lengths: float
    grad_norm: float
    cells: list[float] = field(default_factory=list)  # the flat (3, cells) breakdown table, summed over ranks


class PendingTotals:
    """A step's totals on their way to the host. On CUDA they are copied into pinned memory behind the step's last
    kernel and `result()` waits for that copy alone, so the loop can queue the next step before it reads them: the
    device then never drains between steps. Elsewhere they are read at once."""

    def __init__(self, totals: torch.Tensor):
        self.event = None
        if totals.device.type == "cuda":
            self.values = torch.empty(totals.shape, dtype=totals.dtype, pin_memory=True)
            self.values.copy_(totals, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(totals.device))
        else:
            self.values = totals

    def result(self) -> StepTotals:
        with record_function("sftflow.step_totals"):
            if self.event is not None:
                self.event.synchronize()
            loss_sum, targets, tokens, sum_sq, *cells, norm_value = self.values.tolist()
        return StepTotals(
            loss_sum=loss_sum,
            targets=int(targets),
            tokens=int(tokens),
            sum_sq_doc_lengths=sum_sq,
            grad_norm=norm_value,
            cells=cells,
        )


def queue_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict],
    step_loss_tokens: int,
    max_norm: float | None,
    device: torch.device,
    after_backward=None,
    host_work=None,
    num_cells: int = 0,
    span: AttentionSpan = AttentionSpan(),
) -> PendingTotals:
    """The training step, as the worker runs it: forward and backward over this rank's micro-batches, clip + AdamW,
    everything queued on the device and nothing waited for; the step's totals come back as `PendingTotals`.

    `host_work()`, if given, runs once everything is queued, so host work such as collating the next step's
    micro-batches overlaps the device's backward and optimizer instead of leaving the device idle."""
    # The labelled ranges show where the host spends each step in a profiler trace (~1 us each when not profiling).
    with record_function("sftflow.forward_backward"):
        local = forward_backward(model, batches, step_loss_tokens, device, num_cells, span)
    if after_backward is not None:
        after_backward()
    with record_function("sftflow.optimizer"):
        norm = optimizer_step(model, optimizer, max_norm)
        optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(local)
    pending = PendingTotals(torch.cat([local, norm.double().reshape(1)]))  # queued before the host work
    if host_work is not None:
        with record_function("sftflow.host_work"):
            host_work()
    return pending


def train_step(*args, **kwargs) -> StepTotals:
    """`queue_step` and then its totals: one step with one host sync at its end (what `benchmarks/` times)."""
    return queue_step(*args, **kwargs).result()


class Prefetch:
    """One step's collated micro-batches, made ahead: `train_step` collates step s + 1 (`collate`, as its host work)
    while the device runs step s, and the loop `take`s them. A step not collated ahead (the first, or one after a
    skipped step) is collated when taken. An error while collating ahead is raised when that step is taken, so it
    belongs to its own step (step s still finishes, logs and checkpoints).

    With `stage` (`stage_inputs`), each micro-batch also gets its model inputs as `device_inputs`: found, pinned and
    copied to the device while step s still runs there (the copies queue behind its optimizer), so step s + 1's
    forward is launched without host work before it."""

    def __init__(self, batches, plan, total_steps: int, stage=None):
        self.batches, self.plan, self.total_steps, self.stage = batches, plan, total_steps, stage
        self.ready: tuple[int, list[dict] | Exception] | None = None

    def _make(self, step: int) -> list[dict]:
        made = self.batches(step)
        return made if self.stage is None else self.stage(made)

    def collate(self, step: int) -> None:
        if step < self.total_steps and int(self.plan.step_loss_tokens[step]) > 0:
            try:
                self.ready = (step, self._make(step))
            except Exception as err:  # noqa: BLE001 - kept for its own step, see the class docstring
                self.ready = (step, err)

    def take(self, step: int) -> list[dict]:
        ready, self.ready = self.ready, None
        if ready is None or ready[0] != step:
            return self._make(step)
        if isinstance(ready[1], Exception):
            raise ready[1]
        return ready[1]


def stage_inputs(batches: list[dict], device: torch.device, vocab_size: int | None) -> list[dict]:
    """`batches` with each micro-batch's model inputs on `device` (`model_batch`) as `device_inputs`."""
    return [{**batch, "device_inputs": model_batch(batch, device, vocab_size)} for batch in batches]


def save_full_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, env: DistEnv) -> None:
    """Debug: gather every gradient in full and write them (rank 0) as fp32 safetensors, keyed by parameter name."""
    from safetensors.torch import save_file

    grads = {}
    for name, p in model.named_parameters():
        g = optimizer.grad(p) if isinstance(optimizer, MasterAdamW) else p.grad
        g = g.full_tensor() if isinstance(g, DTensor) else g
        grads[name] = g.detach().float().cpu().contiguous()
    if env.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(grads, str(path))


@dataclass
class Run:
    """A training run as built from its folder by `build_run`: what `train`'s loop steps, checkpoints and logs."""

    run_dir: Path
    config: cfg.TrainConfig
    env: DistEnv
    plan: object  # `PlanArrays`
    lm: torch.nn.Module  # the Hugging Face model, whose weights are checkpointed and exported
    model: torch.nn.Module  # the training module (`CausalLMLoss`), sharded or on one device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    model_state: object
    progress: Progress
    checkpointer: Checkpointer
    metrics: MetricsLogger
    prefetch: Prefetch
    optim_c: cfg.OptimConfig
    total_steps: int
    tokenizer_path: str | None
    source_tokens: tuple[list[str], object] | None = None  # per-step trained targets by data source, if several
    breakdown: Breakdown | None = None  # the training loss by source and tag, when the data has either
    span: AttentionSpan = AttentionSpan()  # the layers' sliding windows, for the MFU's attention FLOPs
    memory: MemoryPicture | None = None  # what was chosen for the memory, for a report should it run out anyway
    overlap_steps: bool = False  # queue step s + 1 before reading step s's totals (the resolved `queue_steps`)


def build_run(run_dir: Path) -> Run:
    """Everything before the first step: the process group, plan and data, the model (with LoRA, compiled layers and
    activation checkpointing as configured), its parallel form and optimizer, the schedule, a restored checkpoint,
    and the metrics logger."""
    config = cfg.read_run_json(run_dir)
    resolved = read_resolved(run_dir)
    env = init_distributed(config.device)
    if (env.device.type, env.world_size) != (resolved.device, resolved.hardware.count):
        raise ValueError(
            f"{run_dir}/run.json was resolved for {resolved.hardware.count} process(es) on {resolved.device}; this "
            f"run has {env.world_size} on {env.device.type}"
        )
    if config.num_threads is not None and env.device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)

    plan = load_plan(config.plan)
    dataset = open_dataset(config.data, config.data_split)
    tokenizer_path = tokenizer_source(config.model, config.tokenizer)
    vocab_size, pad_id = dataset_vocab_size(dataset), 0
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        vocab_size = max(vocab_size or 0, len(tokenizer))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    breakdown = breakdown_of(dataset)
    batches = RankBatches(plan, dataset, rank=env.rank, world_size=env.world_size, pad_id=pad_id, breakdown=breakdown)
    total_steps = plan.num_steps if config.max_steps is None else min(config.max_steps, plan.num_steps)

    lm, weights = build_training_model(
        config.model, vocab_size=vocab_size, packed=batches.packed, overrides=config.model_overrides, device=env.device
    )
    if config.lora is not None:
        apply_lora(lm, config.lora, config.model)
    # Everything `auto` was resolved once, at launch (`resolved.resolve_run`): applied here, decided nowhere else.
    compiled, parallel = resolved.compile.value, resolved.parallel.value
    param_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[resolved.dtype.value]
    if compiled:
        compile_layers(
            decoder_layers(lm), strict=config.memory.compile == "layers", device=env.device, dtype=param_dtype
        )
    layers = decoder_layers(lm)
    budget = resolved.activation_memory_budget.value
    offload = resolved.activation_offload.value
    checkpointing = resolved.activation_checkpointing.value
    state, free = resolved.state_bytes, resolved.hardware.memory
    apply_memory_budget(budget)
    apply_activation_checkpointing(layers, checkpointing, offload=offload)
    optim_c = cfg.optim_config(config)
    checkpoint_c = cfg.checkpoint_config(config)
    # Weights a checkpoint is about to replace are not read (a LoRA checkpoint holds only the adapters).
    weights = None if restores_model(checkpoint_c) and config.lora is None else weights
    on_meta = any(p.is_meta for p in lm.parameters())
    n_params, n_dense = count_params(lm)  # before a 4-bit base packs two weights into each byte
    n_trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    model, optimizer, model_state = parallelize(
        lm, env, parallel, param_dtype, optim_c, weights, on_meta, lora=config.lora is not None, seed=config.seed,
        quantize=config.quantize == "nf4",
    )  # fmt: skip
    # The learning-rate curve spans the whole plan (or `schedule.steps`), whatever `max_steps` stops at: stopping early
    # and resuming with another `max_steps` never bends it.
    schedule_c = cfg.schedule_config(config, config.schedule.steps or plan.num_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, schedule_c))
    progress = Progress()
    states = {
        "model": model_state,
        "optimizer": OptimizerState(lm, optimizer),
        "lr_scheduler": SchedulerState(scheduler),
        "progress": progress,
    }
    checkpointer = Checkpointer(checkpoint_c, states, is_main=env.is_main)
    how = checkpointer.restore()
    metrics = MetricsLogger(
        cfg.metrics_config(config, default_peak_flops(env.device, config.metrics.peak_tflops)),
        is_main=env.is_main,
        total_steps=total_steps,
        steps_per_epoch=plan.steps_per_epoch,
        num_devices=env.world_size,
        # Frozen weights need no weight gradients: 4 FLOPs per parameter and token, not 6 (adapters are negligible).
        flops_per_token=(6 if config.lora is None else 4) * n_dense,
        attn_flops_per_sq_token=6 * lm.config.num_hidden_layers * attention_width(lm.config),
        resume_step=progress.step,
    )
    label = checkpointing_label(checkpointing, len(layers))
    offloaded = offload and label != "off"  # checkpointed layers' inputs kept in host memory
    overlap = resolved.queue_steps.value
    if env.is_main and config.lora is not None:  # the resolved run's last line: only known once the model is built
        print(f"[train] {lora_summary(lm, config, n_trainable, n_params)}", flush=True)
    if env.is_main:
        print(
            f"[train] {how}; {n_params / 1e6:.2f}M params, world {env.world_size} on {env.device.type}, "
            f"plan {plan.num_steps} steps x {plan.micro_batches_per_step} micro-batches x {plan.num_ranks} ranks "
            f"({plan.mode}), {parallel}, training steps {progress.step}..{total_steps}"
            + (lora_label(config, n_trainable) if config.lora is not None else "")
            + (", compiled layers" if compiled else "")
            + (f", activation checkpointing {label}" if label != "off" else "")
            + (" (inputs in host memory)" if offloaded else "")
            + (f", activation memory budget {budget}" if budget < 1 else "")
            + (", steps queued ahead" if overlap else "")
            + (", optimizer in the backward" if config.optimizer.in_backward else "")
            + (
                f", AdamW moments in host memory ({describe_units(optimizer.host_moments.units)})"
                if getattr(optimizer, "host_moments", None) is not None
                else ""
            ),
            flush=True,
        )
    stage = partial(stage_inputs, device=env.device, vocab_size=getattr(model, "vocab_size", None))
    model.keep_row_stats = breakdown is not None
    return Run(
        run_dir=Path(run_dir), config=config, env=env, plan=plan, lm=lm, model=model, optimizer=optimizer,
        scheduler=scheduler, model_state=model_state, progress=progress, checkpointer=checkpointer, metrics=metrics,
        prefetch=Prefetch(batches, plan, total_steps, stage=stage), optim_c=optim_c, total_steps=total_steps,
        tokenizer_path=tokenizer_path, source_tokens=trained_tokens_by_source(plan, dataset), breakdown=breakdown,
        span=AttentionSpan.of(layer_windows(lm.config)),
        overlap_steps=overlap,
        memory=MemoryPicture(
            model_config=lm.config, tokens_per_rank=plan.tokens_per_rank, parallel=parallel,
            world_size=env.world_size, checkpointing=checkpointing, offload=offload, compiled=compiled, budget=budget,
            state_bytes=state, free_bytes=free, optimizer_in_backward=config.optimizer.in_backward,
            optimizer_offload=config.optimizer.offload, lora=config.lora is not None,
        ),
    )  # fmt: skip


def queue_run_step(run: Run, step: int, step_loss_tokens: int) -> PendingTotals | None:
    """Queue optimizer step `step` (0-based); None for a step without trained tokens, which every rank skips
    together (they all read the same plan) after one all-reduce that keeps them in step."""
    num_cells = run.breakdown.num_cells if run.breakdown is not None else 0
    if step_loss_tokens == 0:  # the same size as a trained step's all-reduce, which the other ranks make
        dist.all_reduce(torch.zeros(4 + 3 * num_cells, dtype=torch.float64, device=run.env.device))
        return None
    save_grads = None
    if step + 1 in run.config.save_grads_at_steps:
        grads_path = run.run_dir / "debug" / f"grads-step-{step + 1}.safetensors"
        save_grads = partial(save_full_grads, run.lm, run.optimizer, grads_path, run.env)
    return queue_step(
        run.model,
        run.optimizer,
        run.prefetch.take(step),
        step_loss_tokens,
        run.optim_c.grad_clip,
        run.env.device,
        save_grads,
        host_work=partial(run.prefetch.collate, step + 1),
        num_cells=num_cells,
        span=run.span,
    )


def step_source_tokens(run: Run, step: int) -> dict[str, int] | None:
    if run.source_tokens is None:
        return None
    names, counts = run.source_tokens
    return {name: int(n) for name, n in zip(names, counts[step], strict=True)}


def train(run_dir: Path) -> None:
    # An allocation that fails anywhere below is reported with where it happened and what would leave more room.
    watch = MemoryWatch(rank=int(os.environ.get("RANK", "0")))
    try:
        with watch:
            run = build_run(run_dir)
            watch.device, watch.picture = str(run.env.device), run.memory
            _train(run, watch)
    except BaseException as err:  # noqa: B036 - re-raised unless it is a full disk (DCP's errors are BaseExceptions)
        # ... and a write that fails for want of space, with what was being written
        where = watch.where if watch.where.startswith(("while ", "in ")) else f"while {watch.where}"
        full = as_disk_full(err, run_dir, doing=where)
        if full is None:
            raise
        raise full from err


class Bookkeeping:
    """What the loop does with a step's totals once they are read: check them against the plan, count non-finite
    steps, advance the progress and log the step's metrics."""

    def __init__(self, run: Run, watch: MemoryWatch):
        self.run, self.watch = run, watch
        self.nonfinite_in_a_row = 0

    def finish(self, queued: QueuedStep) -> float:
        """Read `queued`'s totals and account for the step; returns the time it ended (the next step's start)."""
        run, step, step_loss_tokens = self.run, queued.step, queued.step_loss_tokens
        where, self.watch.where = self.watch.where, f"in step {step + 1}"
        totals = queued.totals.result() if queued.totals is not None else None
        skipped = "no trained tokens in this step" if totals is None else None
        if totals is not None and totals.targets != step_loss_tokens:
            raise ValueError(
                f"{plan_path(run.config.plan)}: step {step} plans {step_loss_tokens} trained tokens but its batches "
                f"hold {totals.targets}; the plan was made for different data"
            )
        if totals is not None and not math.isfinite(totals.grad_norm):
            # the fused AdamW skipped the update; stepping in the backward, only the non-finite tensors kept theirs
            skipped = f"non-finite gradient norm {totals.grad_norm}" + (
                " (optimizer in the backward: the tensors with finite gradients stepped)"
                if run.optim_c.in_backward
                else ""
            )
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row > run.optim_c.max_nonfinite_steps:
                raise RuntimeError(f"step {step + 1}: {self.nonfinite_in_a_row} non-finite steps in a row; stopping")
        elif totals is not None:
            self.nonfinite_in_a_row = 0
        progress, plan = run.progress, run.plan
        tokens = totals.tokens if totals is not None else 0
        progress.step, progress.epoch = step + 1, int(plan.epoch_of_step[step])
        progress.tokens_seen += tokens
        progress.trained_tokens_seen += step_loss_tokens
        ended = time.perf_counter()
        run.metrics.log(
            step=progress.step,
            epoch=progress.epoch,
            loss=totals.loss_sum / step_loss_tokens if totals is not None else None,
            grad_norm=totals.grad_norm if totals is not None else None,
            lr=queued.lr,
            trained_tokens=step_loss_tokens,
            tokens=tokens,
            sum_sq_doc_lengths=totals.sum_sq_doc_lengths if totals is not None else 0.0,
            seconds=ended - queued.started,
            skipped=skipped,
            peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if run.env.device.type == "cuda" else None,
            # What the caching allocator holds: above the allocated peak by what fragmentation strands.
            peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if run.env.device.type == "cuda" else None,
            trained_tokens_by_source=step_source_tokens(run, step),
            breakdown=run.breakdown.report(totals.cells) if run.breakdown is not None and totals is not None else None,
        )
        self.watch.where = where
        return ended


@dataclass
class QueuedStep:
    """A step queued on the device whose totals the loop has not read yet."""

    step: int  # 0-based
    step_loss_tokens: int
    lr: float
    started: float  # perf_counter when its wall time starts: its queueing, or the end of the step before it
    totals: PendingTotals | None  # None: a step without trained tokens


def _train(run: Run, watch: MemoryWatch) -> None:
    # Step s + 1 is queued before step s's totals are read and logged, so the device goes from one step to the next
    # without waiting for the host. A checkpoint needs its step's totals in the progress it saves, and the step
    # after it must not have touched the weights yet: a step due one is finished before the next is queued.
    # A step's `seconds` run from the end of the step before it to its own end: they add up to the run's time.
    progress = run.progress
    book = Bookkeeping(run, watch)
    queued: QueuedStep | None = None
    for step in range(progress.step, run.total_steps):
        watch.where = f"in step {step + 1}"
        started = time.perf_counter()
        step_loss_tokens = int(run.plan.step_loss_tokens[step])
        try:
            totals = queue_run_step(run, step, step_loss_tokens)
        except BaseException:
            if queued is not None:  # the step before still counts: logged, and its own error raised first
                book.finish(queued)
            raise
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        if queued is not None:
            started = book.finish(queued)
        queued = QueuedStep(step=step, step_loss_tokens=step_loss_tokens, lr=lr, started=started, totals=totals)
        if not run.overlap_steps or run.checkpointer.will_save(step + 1) or step + 1 == run.total_steps:
            book.finish(queued)
            queued = None
            if run.checkpointer.due(progress.step):
                watch.where = f"saving the checkpoint of step {progress.step}"
                run.checkpointer.save(progress.step)
    if run.checkpointer.due(progress.step, last=True):
        watch.where = f"saving the checkpoint of step {progress.step}"
        run.checkpointer.save(progress.step)
    if run.config.export:
        watch.where = "exporting the model"
        export_run(run)
    if run.env.device.type == "cuda" and run.env.is_main:
        allocated, reserved = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
        print(f"[train] peak memory {allocated:.2f} GiB ({reserved:.2f} GiB reserved)", flush=True)
    dist.destroy_process_group()


def export_run(run: Run) -> None:
    """`hf/`: the trained model (and, for LoRA, `hf/adapter/`), written by rank 0 a tensor group at a time
    (`export_streamed`): for LoRA with `merge`, each wrapped layer's base merged with its adapters as it is written."""
    config = run.config
    out = run.run_dir / "hf"
    options = dict(is_main=run.env.is_main, tokenizer=run.tokenizer_path, dtype=config.export_dtype,
                   source=config.model, chat_template=config.chat_template)  # fmt: skip
    if config.lora is None:
        export_streamed(run.model_state.full_tensor, run.lm.config, out, **options)
    else:
        trained = [name for name, p in run.lm.named_parameters() if p.requires_grad]
        # gathered on every rank (a collective under FSDP), kept by rank 0; adapters are small
        adapters = {name: full_tensor(run.lm, name).detach().float().cpu() for name in trained}
        if run.env.is_main:
            export_adapter(adapters, run.lm.config, config.lora, config.model, out / "adapter")
            if run.tokenizer_path is not None:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(run.tokenizer_path).save_pretrained(out / "adapter")
        if config.lora.merge:
            if config.quantize == "nf4":  # the base read again from its checkpoint, not the 4-bit weights
                base_of = base_tensor_of(run.lm, config.model, config.model_overrides)
            else:
                base_of = partial(full_tensor, run.lm)
            export_streamed(merged_tensor_of(run.lm, base_of, adapters), run.lm.config, out, **options)
    if run.env.is_main:
        print(f"[train] exported {out}", flush=True)
    dist.barrier()


def lora_label(config: cfg.TrainConfig, trainable: int) -> str:
    """What a LoRA run trains, for its start line: the adapters, not the frozen base the parameter count is of."""
    lora = config.lora
    targets = lora.targets if isinstance(lora.targets, str) else ", ".join(lora.targets)
    base = "NF4" if config.quantize == "nf4" else "frozen"
    return f", LoRA r{lora.rank} on {targets} ({trainable / 1e6:.2f}M trainable, {base} base)"


def lora_summary(lm: torch.nn.Module, config: cfg.TrainConfig, trainable: int, total: int) -> str:
    """`LoRA r16 on 7 modules: 4.2M trainable of 1.2B`: the adapted module kinds, the adapters' and the model's
    parameters."""
    kinds = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if hasattr(module, "lora_A")}
    size = f"{total / 1e9:.1f}B" if total >= 1e9 else f"{total / 1e6:.1f}M"
    return f"LoRA r{config.lora.rank} on {len(kinds)} modules: {trainable / 1e6:.1f}M trainable of {size}"


USER_ERROR = "worker-error.txt"


@record
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: torchrun ... -m sftflow.tasks.train.worker RUN_DIR")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(argv[0])
    # Die with torchrun, and hold the run's writers lock while alive: no worker outlives its launcher's run, and no
    # new launch starts while one does (`sftflow.tasks.train.lifetime`).
    torchrun_pid = os.environ.get(TORCHRUN_PID_VAR)
    die_with_parent(int(torchrun_pid) if torchrun_pid else None)
    if os.environ.get(WRITERS_VAR):
        hold_as_writer(os.environ[WRITERS_VAR])
    try:
        train(run_dir)
    except DiskFull as err:
        # Not in a file as USER_ERROR is: that write could fail the same way. Every line a worker prints reaches
        # the launcher, which reports this one.
        print(report_line(err), flush=True)
        raise SystemExit(2) from None  # the launcher's one line says it all: no worker traceback above it
    except ValueError as err:
        # Bad input found inside a worker (data that does not match its plan, ...), or rows that do not fit the
        # device (`OutOfMemory`): the launcher reports this one line instead of torchrun's traceback, and no retry
        # meets anything else. The first rank to fail writes it.
        try:
            with open(run_dir / USER_ERROR, "x") as f:
                f.write(str(err).splitlines()[0] if str(err) else type(err).__name__)
        except FileExistsError:
            pass
        raise


if __name__ == "__main__":
    main()
    # Everything is written and the process group is gone: leave without the interpreter's teardown, where torch
    # 2.13's CPU build has been seen to abort a finished rank ("terminate called without an active exception" from a
    # joinable C++ thread destroyed at exit), which torchrun then reports as a failed run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
