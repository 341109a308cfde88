"""Activation checkpointing: keep fewer activations for the backward and recompute them, so longer rows fit.

Each Hugging Face decoder layer is a `GradientCheckpointingLayer`: with its `gradient_checkpointing` flag set, its
call runs under `torch.utils.checkpoint` (non-reentrant), so only the layer's input is kept and the layer is run
again in the backward. That composes with what runs inside the layer (compiled forward, the Triton attention op,
FSDP2's hooks on the layer) because the checkpoint wraps the whole call. Modes:

- `full`: every decoder layer; activation memory drops to about one layer's input per layer, for ~1/3 more compute;
- `selective`: every `every`-th layer (default 2: half the layers), half the saving for half the cost;
- `off`;
- a number N: N decoder layers, spread evenly over the stack;
- `activation_offload` (with selective or full): the inputs the checkpointed layers keep wait in pinned host memory,
  so full checkpointing keeps only the layer being recomputed (and the next one's input) on the device, for two
  copies of each layer's input over the host link per step, on a side stream that overlaps the compute; its `auto`
  turns it on where the rows would not fit without it and the host has the room (`resolve_activation_offload`);
- `auto`: off on a CPU; on a GPU, the fewest checkpointed layers (none, some, or all) whose estimated peak for a
  planned row fits in the memory the device has free (`choose_checkpointing`), so only as much of the step is
  recomputed as the memory asks for. The estimate is the weights, masters, moments and gradients of the run's
  training path (`state_bytes`) plus the activations a row keeps (`activation_bytes_per_token`, calibrated on peaks
  measured on an H100 and an H200), and it also gives the longest row each mode fits (`max_row_tokens`), which
  `sftflow plan --tokens-per-rank auto` uses.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("sftflow.train")


@functools.cache
def calibration() -> dict:
    """The activation estimate's measured constants, kept as data in `calibration.json` beside this module: each
    entry says why it exists, which benchmark measures it, and where its measurements are
    (`benchmarks/results/activation_memory.jsonl`). Rerun that benchmark and refit them when the compiler, the
    kernels or a family's layer change what a layer keeps."""
    return json.loads(Path(__file__).with_name("calibration.json").read_text(encoding="utf-8"))


# Bytes one token keeps for the backward in one decoder layer, as a fraction of `2 * (10 * hidden + 4 * intermediate)`
# (bf16 copies of ~10 hidden-sized tensors and ~4 intermediate-sized ones), by family (`model_type`): the count is a
# Llama layer's, and a compiled layer keeps more or less than it says, by family, so the fractions are measured
# (`calibration.json`). A family not measured takes the largest, so `auto` never leaves whole a layer that does not fit.
SAVED_FRACTION = dict(calibration()["activation_saved_fraction"]["by_model_type"])
SAVED_FRACTION_DEFAULT = calibration()["activation_saved_fraction"]["default"]
# `activation_memory_budget` that `auto` sets where rows do not fit as they are. Below 1, torch's partitioner first
# tries its "more aggressive" min-cut, which may recompute any elementwise op (no matmul, no attention: those are not
# on its list), and takes it if that keeps less than the budget's share; only a lower budget goes on to recompute
# matmuls and the attention. 0.99 so selects exactly the elementwise recompute: both RMSNorms' outputs and SwiGLU's
# product are no longer kept (measured on CPU with the layers' GPU graph, benchmarks/RESULTS.md), with the same
# gradients. (At 0.7, Gemma 3's layer already recomputes its attention.)
ELEMENTWISE_BUDGET = 0.99
# The share of a layer's bytes the elementwise recompute keeps, by family: what the partitioner still keeps at
# `ELEMENTWISE_BUDGET` depends on which elementwise outputs a family's layer has, so it is measured
# (`calibration.json`); a family not measured takes the largest but Gemma's.
ELEMENTWISE_KEPT = dict(calibration()["elementwise_kept"]["by_model_type"])
ELEMENTWISE_KEPT_DEFAULT = calibration()["elementwise_kept"]["default"]
# Allocator fragmentation, the loss's logits chunks, compile workspaces: on top of the estimate.
OVERHEAD_BYTES = 2 * 2**30
# The estimate may use this much of the memory the device has free when the model is built.
USABLE_FRACTION = 0.9


def kept_share(config, budget: float) -> float:
    """The share of a layer's saved bytes the compiled layers keep at `activation_memory_budget` `budget`: all at 1,
    the elementwise recompute's (or less, for a budget under it) below."""
    if budget >= 1:
        return 1.0
    return min(budget, ELEMENTWISE_KEPT.get(getattr(config, "model_type", ""), ELEMENTWISE_KEPT_DEFAULT))


def layer_bytes_per_token(config, budget: float = 1.0) -> float:
    """Bytes one token keeps for the backward in one decoder layer without checkpointing (`budget`: the compiled
    layers' `activation_memory_budget`)."""
    hidden, inter = config.hidden_size, getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    saved = SAVED_FRACTION.get(getattr(config, "model_type", ""), SAVED_FRACTION_DEFAULT)
    return kept_share(config, budget) * saved * 2 * (10 * hidden + 4 * inter)


def input_bytes_per_token(config) -> int:
    """Bytes of one token of a decoder layer's bf16 input: what a checkpointed layer keeps, and what offload moves."""
    return 2 * config.hidden_size


def checkpointed_layers(mode: str | int, num_layers: int) -> int:
    """How many of `num_layers` decoder layers checkpointing `mode` recomputes: none (off), all (full), every second
    one (selective), or a count of them."""
    if isinstance(mode, int):
        return min(max(mode, 0), num_layers)
    return {"off": 0, "full": num_layers, "selective": (num_layers + 1) // 2}[mode]


def spread(count: int, total: int) -> list[int]:
    """`count` of `total` indices spread evenly over them (the layers a count of checkpointed layers picks)."""
    count = min(max(count, 0), total)
    return [i * total // count for i in range(count)] if count else []


def checkpointing_label(mode: str | int, num_layers: int) -> str:
    """`off`, `full`, `selective`, or "N of L layers" for a count in between."""
    if isinstance(mode, str):
        return mode
    count = checkpointed_layers(mode, num_layers)
    return "off" if count == 0 else "full" if count == num_layers else f"{count} of {num_layers} layers"


def activation_bytes_per_token(config, mode: str | int, offload: bool = False, budget: float = 1.0) -> float:
    """Bytes one row token keeps on the device for the backward, model-wide, with checkpointing `mode` (or that many
    checkpointed layers) and the compiled layers' memory `budget`. A checkpointed layer keeps its bf16 input (in host
    memory with `offload`); a layer left out of checkpointing keeps its activations; and the layer whose backward runs
    holds up to one layer's bytes more (at budget 1)."""
    layers, one = config.num_hidden_layers, layer_bytes_per_token(config, budget)
    # With offload, the kept inputs wait on the host; the one copied back ahead of its layer's recompute is on the
    # device next to the layer being recomputed.
    kept_input = 0 if offload else input_bytes_per_token(config)
    checkpointed = checkpointed_layers(mode, layers)
    prefetched = input_bytes_per_token(config) if offload and checkpointed else 0
    # A layer's backward needs more than the layer kept, whatever the budget: the gradients of its intermediates, and
    # a checkpointed layer's recomputed activations; below budget 1 also the elementwise outputs its forward dropped.
    # The peaks measured with some layers left whole hold up to about one layer's bytes more than the layers keep; with
    # every layer checkpointed the recomputed layer's own bytes and a little more (the activation estimate's
    # calibration in benchmarks/RESULTS.md). One layer's bytes at budget 1 stand for it; the state's gradients, mostly
    # not yet made at that peak, cover the rest.
    in_backward = layer_bytes_per_token(config)
    return checkpointed * kept_input + (layers - checkpointed) * one + in_backward + prefetched


def state_bytes(trained_params: int, frozen_bytes: float, parallel: str, world_size: int, total_params: int,
                num_layers: int, accumulating: bool = False, largest_trained: int | None = None,
                offloaded: tuple[int, int] = (0, 0)) -> float:  # fmt: skip
    """Device bytes of the weights, master weights, optimizer moments and gradients while activations are live.

    - `single` (one GPU): bf16 weight + int16 low bits of the fp32 master + two fp32 moments + the gradient, bf16
      with one micro-batch a step and fp32 once several add up (`accumulating`): 14 or 16 bytes a trained parameter;
      with the optimizer stepping in the backward (`largest_trained`: the biggest trained tensor's elements), 12,
      plus the one bf16 gradient being stepped; moments kept on the host (`offloaded`: their parameters, and the
      largest unit's, two of which have device slots) take 8 bytes a parameter less, plus the slots;
    - `fsdp`: fp32 parameter + fp32 gradient + two fp32 moments, sharded over the ranks: 16 / world bytes, plus the
      bf16 copies of the two layers unsharded at a time (the one computing and the one prefetched).
    Frozen weights (LoRA's base) count as held: `frozen_bytes`, sharded under FSDP."""
    if parallel == "single":
        host, largest_unit = offloaded
        moments = -8.0 * host + 2 * 8.0 * largest_unit
        if largest_trained is not None:
            return 12.0 * trained_params + 2.0 * largest_trained + frozen_bytes + moments
        return (16.0 if accumulating else 14.0) * trained_params + frozen_bytes + moments
    unsharded = 2 * 2 * total_params / max(num_layers, 1)
    return (16.0 * trained_params + frozen_bytes) / world_size + unsharded


def peak_bytes(
    config, mode: str | int, row_tokens: int, state: float, offload: bool = False, budget: float = 1.0
) -> float:
    """The estimated device peak of a step on a `row_tokens` row: `state`, the activations it keeps with
    checkpointing `mode` (and the compiled layers' memory `budget`), and the overhead."""
    return state + row_tokens * activation_bytes_per_token(config, mode, offload, budget) + OVERHEAD_BYTES


def fits(
    config, mode: str | int, row_tokens: int, state: float, free_bytes: int, offload: bool = False, budget: float = 1.0
) -> bool:
    """Whether a `row_tokens` row likely fits in `free_bytes` beside `state` (`peak_bytes`)."""
    return peak_bytes(config, mode, row_tokens, state, offload, budget) <= USABLE_FRACTION * free_bytes


def max_row_tokens(
    config, mode: str | int, state: float, free_bytes: int, multiple: int = 1024, offload: bool = False,
    budget: float = 1.0,
) -> int:  # fmt: skip
    """The longest row (a multiple of `multiple` tokens) that likely fits beside `state` with checkpointing `mode`;
    0 when even the state does not fit."""
    room = USABLE_FRACTION * free_bytes - state - OVERHEAD_BYTES
    tokens = int(room // activation_bytes_per_token(config, mode, offload, budget)) if room > 0 else 0
    return tokens // multiple * multiple


def choose_checkpointing(
    config, row_tokens: int, state: float, free_bytes: int, offload: bool = False, budget: float = 1.0
) -> int:
    """`auto`'s choice: the fewest decoder layers to checkpoint for the estimate to fit, so no more of the step is
    recomputed than the memory asks for (all of them also when nothing fits: the run then fails with the device's own
    out-of-memory error). Each layer left out of checkpointing keeps one layer's activations instead of its input."""
    layers = config.num_hidden_layers
    for count in range(layers):
        if fits(config, count, row_tokens, state, free_bytes, offload, budget):
            return count
    return layers


def offloaded_bytes(config, checkpointed: int, row_tokens: int) -> int:
    """Pinned host bytes `activation_offload` holds on one rank: each checkpointed layer's bf16 input of a row, in
    blocks of a power of two (torch's pinned-memory cache rounds each allocation up to one)."""
    one = row_tokens * input_bytes_per_token(config)
    return checkpointed * (1 << max(one - 1, 0).bit_length())


def resolve_activation_offload(
    setting: str | bool,
    mode: str | int,
    device: torch.device,
    config,
    row_tokens: int,
    state: float,
    free: int | None = None,
    budget: float = 1.0,
    host_bytes: int | None = None,
    ranks_on_host: int = 1,
) -> bool:
    """Whether the checkpointed layers' inputs wait in host memory: never off a GPU or without checkpointing; the
    setting where it is true or false; for `auto`, on only where the rows would not fit without it by the estimate
    (checkpointing `auto` with every layer recomputed, or the mode set), and the host has the memory for what this
    host's ranks move (`host_bytes`: what it has available, less what else the run will pin; None: not known,
    assumed enough). Where rows fit without it, it stays off even when it would let a layer or two fewer be
    recomputed: its cost was measured only with every layer checkpointed, where it cost nothing measurable
    (benchmarks/results/training.jsonl)."""
    if device.type != "cuda" or setting is False or mode == "off":
        return False
    if setting is True:
        return True
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    without = choose_checkpointing(config, row_tokens, state, free, False, budget) if mode == "auto" else mode
    if fits(config, without, row_tokens, state, free, False, budget):
        return False
    if mode == "auto":
        count = choose_checkpointing(config, row_tokens, state, free, True, budget)
    else:
        count = checkpointed_layers(mode, config.num_hidden_layers)
    if count == 0:
        return False
    moved = ranks_on_host * offloaded_bytes(config, count, row_tokens)
    if host_bytes is not None and moved > host_bytes:
        log.info(
            "activation offload auto: off; the rows need it, but the checkpointed inputs take %.1f GiB of host "
            "memory on this host and %.1f GiB are available",
            moved / 2**30,
            host_bytes / 2**30,
        )
        return False
    return True


def resolve_memory_budget(
    budget: str | float,
    compiled: bool,
    device: torch.device,
    config,
    row_tokens: int,
    state: float,
    free: int | None = None,
) -> float:
    """The compiled layers' `activation_memory_budget`: `budget` itself, or for `auto` 1 (keep what the compiler
    keeps) where the row fits without checkpointing or off a GPU, else `ELEMENTWISE_BUDGET`, which recomputes no
    matmul and so comes before checkpointing any layer. Without compiled layers there is no budget to set: 1."""
    if not compiled:
        if budget != "auto" and budget < 1:
            log.info("activation memory budget %s: no compiled layers to apply it to; ignored", budget)
        return 1.0
    if budget != "auto":
        return float(budget)
    if device.type != "cuda":
        return 1.0
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    return 1.0 if fits(config, "off", row_tokens, state, free) else ELEMENTWISE_BUDGET


def settle_memory_budget(setting: str | float, budget: float, checkpointing: str | int, num_layers: int) -> float:
    """`auto`'s budget once the checkpointing is known: 1 where every layer is checkpointed. There no layer keeps its
    activations to the backward, so dropping elementwise outputs saves nothing, and recomputing them in the backward of
    the layer being recomputed holds them beside its other tensors at the peak, for the same speed (measured with
    `full` at both budgets: benchmarks/results/training.jsonl). A budget that was set is kept."""
    if setting == "auto" and checkpointed_layers(checkpointing, num_layers) == num_layers:
        return 1.0
    return budget


def apply_memory_budget(budget: float) -> None:
    """Set the compiler's `activation_memory_budget` (read when a layer first compiles: before the first step)."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget


def apply_activation_checkpointing(
    layers: list[nn.Module], mode: str | int, every: int = 2, offload: bool = False
) -> int:
    """Turn checkpointing on for the decoder `layers` (all for `full`, every `every`-th for `selective`, or a count of
    them spread evenly over the stack); returns how many. The layers' `gradient_checkpointing` flag is what
    transformers' `gradient_checkpointing_enable` sets. With `offload`, the input each checkpointed layer keeps waits
    for the backward in host memory (`HostOffload`)."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    if isinstance(mode, int):
        chosen = [layers[i] for i in spread(mode, len(layers))]
    elif mode == "off":
        chosen = []
    else:
        chosen = layers if mode == "full" else layers[::every]
    if not chosen:
        return 0
    func = partial(checkpoint, use_reentrant=False)
    if offload:
        func = partial(_offloaded, HostOffload(), func)
    for layer in chosen:
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(
                f"{type(layer).__name__} cannot checkpoint its activations (not a transformers "
                "GradientCheckpointingLayer); set train.memory.activation_checkpointing: off"
            )
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = func
    return len(chosen)


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of at least `min_bytes` on a `device_type` device go to pinned host memory when saved and come
    back when the backward needs them; smaller ones, and tensors on other devices, stay.

    On a GPU both copies run on a side stream, so they overlap the layers' compute:
    - saving: the side stream waits for the tensor to be written, copies it out, and the device memory is reused only
      after that copy (`record_stream`);
    - the backward takes saved tensors in the reverse order of the forward (layer by layer), so when one comes back
      the copy back of the one saved just before it starts at once, and is ready by the time the backward reaches it.
      At most one such copy is in flight: one layer input more on the device.

    One object serves every checkpointed layer of a model (it keeps the order they saved in, as weak references: a
    forward whose graph is dropped leaves nothing behind). Around a non-reentrant checkpoint it catches exactly the
    inputs the checkpoint keeps for its recompute: inside the checkpointed region the checkpoint's own hooks take
    precedence and keep nothing."""

    def __init__(self, min_bytes: int = 1 << 20, device_type: str = "cuda"):
        self.min_bytes, self.device_type = min_bytes, device_type
        self.moved = 0  # tensors sent to the host so far
        self.prefetched = 0  # tensors whose copy back had started before the backward asked for them
        self._saved: list[weakref.ref[_Offloaded]] = []  # forward order
        self._stream: torch.cuda.Stream | None = None
        super().__init__(self._pack, self._unpack)

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, tensor: torch.Tensor):
        if tensor.device.type != self.device_type or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        self.moved += 1
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        stream = self._side_stream(tensor.device)
        if stream is None:
            host.copy_(tensor)
            saved = _Offloaded(tensor.device, host)
        else:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)
            # The copy back is queued on the same stream, so it follows this one without an event.
            saved = _Offloaded(tensor.device, host)
        self._saved.append(weakref.ref(saved))
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _Offloaded):
            return saved
        if saved.back is None:
            self._copy_back(saved)
        else:
            self.prefetched += 1
        back, ready = saved.back, saved.ready
        saved.back = saved.ready = None
        if ready is not None:
            torch.cuda.current_stream(back.device).wait_event(ready)
            back.record_stream(torch.cuda.current_stream(back.device))
        self._forget(saved)
        following = self._last_alive()
        if following is not None and following.back is None:
            self._copy_back(following)
        return back

    def _copy_back(self, saved: _Offloaded) -> None:
        """Start copying `saved` back to its device: on the side stream after its copy out, on a GPU."""
        stream = self._side_stream(saved.device)
        if stream is None:
            saved.back = saved.host.clone()
            return
        with torch.cuda.stream(stream):
            saved.back = saved.host.to(saved.device, non_blocking=True)
            saved.ready = stream.record_event()

    def _forget(self, saved: _Offloaded) -> None:
        for i in range(len(self._saved) - 1, -1, -1):
            if self._saved[i]() is saved:
                del self._saved[i]
                return

    def _last_alive(self) -> _Offloaded | None:
        while self._saved:
            saved = self._saved[-1]()
            if saved is not None:
                return saved
            self._saved.pop()
        return None


@dataclass(eq=False)
class _Offloaded:
    """A saved tensor in host memory, and its copy back once started (`ready`: the side stream's event for it)."""

    device: torch.device
    host: torch.Tensor
    back: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


def _offloaded(offload: HostOffload, checkpoint_fn, fn, *args, **kwargs):
    with offload:
        return checkpoint_fn(fn, *args, **kwargs)


def resolve_activation_checkpointing(
    mode: str | int,
    device: torch.device,
    config,
    row_tokens: int,
    state: float,
    offload: bool = False,
    free: int | None = None,
    budget: float = 1.0,
) -> str | int:
    """The checkpointing to apply: `mode` itself, or for `auto`, off on a CPU and on a GPU `choose_checkpointing`'s
    count of layers against the device's free memory (`state`: `state_bytes` of this run; `free`: the free bytes
    before the model was built, when it is already on the device, else what the device has free now; `budget`: the
    compiled layers' activation memory budget)."""
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "off"
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    chosen = choose_checkpointing(config, row_tokens, state, free, offload, budget)
    modes = ("off", "selective", "full")
    longest = {m: max_row_tokens(config, m, state, free, offload=offload, budget=budget) for m in modes}
    log.info(
        "activation checkpointing auto: %s%s for rows of %d tokens at activation memory budget %s (longest rows "
        "that fit: %s)",
        checkpointing_label(chosen, config.num_hidden_layers),
        ", their inputs in host memory" if offload and chosen else "",
        row_tokens,
        budget,
        ", ".join(f"{m} {n:,}" for m, n in longest.items()),
    )
    return chosen
