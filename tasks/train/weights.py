"""Loading a Hugging Face checkpoint shard by shard: no rank ever holds the whole model.

The model is built on the meta device (no memory, no random init). Its buffers (RoPE frequencies, Gemma's embedding
scale) are not in checkpoints; they are computed on the CPU by the model's own `_init_weights`, the code
`from_pretrained` runs for them. After sharding (FSDP2 turns each parameter into a DTensor holding this rank's rows),
`materialize` allocates the rank's storage on its device and fills each parameter from the safetensors files with
`safe_open(...).get_slice`, reading only this rank's rows of each tensor, one tensor at a time, and converting them
to the parameter's dtype as they are copied in. Peak host memory is one tensor's slice, in the checkpoint's dtype;
tied weights stay one parameter (they are tied on the meta model and FSDP keeps them so).

Some models hold tensors under other names than their checkpoints: transformers 5 renames some on load and fuses
others, e.g. Qwen3-MoE's experts, one `(num_experts, 2 * moe_intermediate_size, hidden_size)` parameter
`mlp.experts.gate_up_proj` in the model against `mlp.experts.{e}.gate_proj.weight` and `...up_proj.weight` per expert
in hub checkpoints (and in what `save_pretrained` writes, which undoes the fusion). Which checkpoint tensors make
which parameter, and how, is read from transformers' own conversion table for the model
(`transformers.conversion_mapping`), the one `from_pretrained` applies: a renaming is read like any tensor, and a
fusion that stacks one tensor per expert (`MergeModulelist(dim=0)`, then optionally `Concatenate` of the parts, gate
before up) is read expert by expert, only this rank's experts (FSDP2 shards the stacked parameter on its expert
dimension), each copied into its place in the parameter: peak host memory is one expert's tensor. A checkpoint
already fused (the model's own names) is read as it is.

```
checkpoint (per expert)                   model parameter, this rank's rows (experts 2..3 of 4)
mlp.experts.2.gate_proj.weight (I, H) ─▶ gate_up_proj[0, :I]     down_proj[0] ◀─ mlp.experts.2.down_proj.weight (H, I)
mlp.experts.2.up_proj.weight   (I, H) ─▶ gate_up_proj[0, I:]
mlp.experts.3.gate_proj.weight (I, H) ─▶ gate_up_proj[1, :I]     down_proj[1] ◀─ mlp.experts.3.down_proj.weight
mlp.experts.3.up_proj.weight   (I, H) ─▶ gate_up_proj[1, I:]
```

Checkpoints with a tensor no conversion accounts for, or with conversions other than these (transposes, permutes),
or not in safetensors, are loaded by `from_pretrained` instead, whole, on every rank (`shard_loadable` says which).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sftflow.tasks.train.lora import checkpoint_name, initial_adapter, is_adapter

log = logging.getLogger("sftflow.train")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each tensor of a safetensors checkpoint lives: tensor name -> file."""

    folder: Path
    files: dict[str, Path]

    @classmethod
    def find(cls, folder: str | Path) -> CheckpointFiles | None:
        """The checkpoint of a local Hugging Face folder, or None if it has no safetensors weights."""
        from safetensors import safe_open

        folder = Path(folder)
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
            return cls(folder, {name: folder / file for name, file in weight_map.items()})
        if (folder / SINGLE_FILE).is_file():
            with safe_open(folder / SINGLE_FILE, framework="pt") as f:
                return cls(folder, dict.fromkeys(f.keys(), folder / SINGLE_FILE))
        return None


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds for `model`: parameters (tied ones once) and persistent buffers."""
    tensors = dict(model.named_parameters())
    persistent = {name for name, _ in model.named_buffers() if name in model.state_dict(keep_vars=True)}
    tensors.update({name: model.get_buffer(name) for name in persistent})
    return tensors


@dataclass(frozen=True)
class StackedExperts:
    """A parameter transformers stacks on load from one checkpoint tensor per expert: expert `e` of the parameter is
    `parts[0][e]`, `parts[1][e]`, ... (checkpoint names, e.g. gate then up) concatenated along `dim` of the
    expert's tensor."""

    parts: tuple[tuple[str, ...], ...]
    dim: int


Source = str | StackedExperts  # a checkpoint tensor's name, or the per-expert tensors stacked into the parameter


def _checkpoint_tensor_names(model: nn.Module) -> list[str]:
    """The names under which a base checkpoint would hold `model`'s tensors (LoRA's `base_layer` removed, its
    adapters left out: no base checkpoint holds them)."""
    return [checkpoint_name(name) for name in _state_tensors(model) if not is_adapter(name)]


def _stacking_dim(converter) -> int | None:
    """The dim of an expert's tensor along which `converter` concatenates its parts, if it only stacks one tensor
    per expert and concatenates the parts (None for any other conversion)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 0 if len(converter.source_patterns) == 1 else None
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        return ops[1].dim - 1  # of the stacked tensor, whose dim 0 is the expert
    return None


def _converted_sources(model: nn.Module, files: CheckpointFiles, wanted: set[str]) -> dict[str, Source]:
    """Where the checkpoint holds each of the `wanted` tensors under transformers' load-time conversions for `model`
    (renamings, and experts stacked into one parameter), for those the conversions account for."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, dot_natural_key
    except ImportError:  # transformers 4 converts nothing on load: its models name tensors as checkpoints do
        return {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed: dict[str, list[str]] = {}
    stacked: dict[str, tuple[object, dict[str, list[str]]]] = {}
    # In dot-natural order (expert 10 after expert 9), the order in which `from_pretrained` stacks them.
    for key in sorted(files.files, key=dot_natural_key):
        target = apply_renamings(key, renamings)
        for converter in converters:  # at most one converter applies to a key, as in `from_pretrained`
            converted, pattern = converter.rename_source_key(target)
            if pattern is not None:
                if converted in wanted:
                    stacked.setdefault(converted, (converter, {}))[1].setdefault(pattern, []).append(key)
                break
        else:
            if target in wanted:
                renamed.setdefault(target, []).append(key)
    sources: dict[str, Source] = {target: keys[0] for target, keys in renamed.items() if len(keys) == 1}
    for target, (converter, by_pattern) in stacked.items():
        dim = _stacking_dim(converter)
        if dim is not None and set(by_pattern) == set(converter.source_patterns):
            sources[target] = StackedExperts(tuple(tuple(by_pattern[p]) for p in converter.source_patterns), dim)
    return sources


def checkpoint_sources(model: nn.Module, files: CheckpointFiles) -> tuple[dict[str, Source], list[str]]:
    """Where the checkpoint holds each of `model`'s tensors (by checkpoint name), and the sorted names of those it
    holds nowhere that sftflow can read by slices."""
    wanted = _checkpoint_tensor_names(model)
    sources: dict[str, Source] = {name: name for name in wanted if name in files.files}
    missing = {name for name in wanted if name not in sources}
    if missing:
        sources.update(_converted_sources(model, files, missing))
    return sources, sorted(missing - set(sources))


def shard_loadable(model: nn.Module, files: CheckpointFiles) -> list[str]:
    """The names of `model`'s tensors the checkpoint does not hold in a form read by slices (empty: loadable by
    slices, directly or through `checkpoint_sources`' conversions)."""
    return checkpoint_sources(model, files)[1]


def meta_model(config, attn_implementation: str) -> nn.Module:
    """`AutoModelForCausalLM` of `config` in fp32 with its parameters on the meta device and its buffers computed on
    the CPU."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    for module in lm.modules():
        own = [name for name, buffer in module._buffers.items() if buffer is not None]
        if own:
            for name in own:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            # The model's own initialisation of this module: it sets the buffers; on meta parameters it is a no-op.
            lm._init_weights(module)
    return lm


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that share their parameter with an earlier name (a tied LM head), mapped to that name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _grown_rows(f, name: str, rows: tuple[int, int]) -> torch.Tensor:
    """Rows [start, stop) of an embedding or head grown past the checkpoint's vocabulary (tokens a template needs were
    added): the checkpoint's rows, then the mean of all its rows for each new token, as a new token's starting point
    that predicts and embeds like an average token."""
    stored = f.get_slice(name)
    old = stored.get_shape()[0]
    start, stop = rows
    parts = []
    if start < old:
        parts.append(stored[start : min(stop, old)])
    if stop > old:
        mean = f.get_tensor(name).float().mean(0, keepdim=True)
        parts.append(mean.expand(stop - max(start, old), -1).to(parts[0].dtype if parts else mean.dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def grow_vocabulary(model: nn.Module, vocab_size: int) -> int:
    """Grow a loaded model's input embedding and (untied) output head to `vocab_size` rows, new rows set to the mean
    of the old ones; returns the old size."""
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        for weights in {
            id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        }.values():
            weights[old:] = weights[:old].mean(0, keepdim=True)
    return old


def _rows(param: torch.Tensor) -> tuple[int, int] | None:
    """This rank's [start, stop) rows of a dim-0-sharded DTensor, or None for a replicated tensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return None
    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        raise ValueError(f"a parameter sharded on dim {param.placements}: only dim-0 shards (FSDP2) are read")
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + local_shape[0]


@torch.no_grad()
def materialize(
    root: nn.Module, model: nn.Module, device: torch.device, files: CheckpointFiles | None, seed: int = 0
) -> None:
    """Give the meta `model` (inside `root`, the module that was sharded, or `model` itself) real storage on `device`:
    its buffers as computed on the CPU, its parameters read from `files`, each rank its own rows, and LoRA adapters
    (which no base checkpoint holds) as PEFT initialises them (`sftflow.tasks.train.lora.initial_adapter`)."""
    from safetensors import safe_open

    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    tied = tied_names(model)
    root.to_empty(device=device)
    for name, source in tied.items():
        # `to_empty` gives each module its own new parameter (FSDP2 keeps shared ones shared; plain modules do not).
        parent, _, attr = name.rpartition(".")
        shared = model.get_parameter(source)
        if model.get_parameter(name) is not shared:
            setattr(model.get_submodule(parent), attr, shared)
    for name, value in buffers.items():
        model.get_buffer(name).copy_(value)
    tensors = _state_tensors(model)
    for name, tensor in tensors.items():
        if is_adapter(name):
            rows = _rows(tensor) or (0, tensor.shape[0])
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(initial_adapter(name, tensor.shape, seed)[rows[0] : rows[1]])
    if files is None:
        return
    sources, missing = checkpoint_sources(model, files)
    if missing:
        raise ValueError(f"{files.folder}: the checkpoint holds no tensor for {missing[:3]} (of {len(missing)})")
    by_file: dict[Path, list[tuple[str, torch.Tensor, Source]]] = {}
    for name, tensor in tensors.items():
        if not is_adapter(name):
            source = sources[checkpoint_name(name)]
            first = source if isinstance(source, str) else source.parts[0][0]
            by_file.setdefault(files.files[first], []).append((name, tensor, source))
    for path, pending in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name, tensor, source in pending:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                rows = _rows(tensor)
                if isinstance(source, StackedExperts):
                    _copy_experts(files, name, source, rows or (0, tensor.shape[0]), tensor.shape[0], local)
                    continue
                stored = f.get_slice(source).get_shape()
                if stored[0] < tensor.shape[0] and list(stored[1:]) == list(tensor.shape[1:]):
                    value = _grown_rows(f, source, rows or (0, tensor.shape[0]))
                elif rows is None:
                    value = f.get_tensor(source)
                elif rows[1] > rows[0]:
                    value = f.get_slice(source)[rows[0] : rows[1]]
                else:
                    continue  # a rank past the end of a short tensor holds no rows of it
                _check_shape(path, name, value, local)
                local.copy_(value)  # converted on the way (on the GPU, for a GPU parameter): no fp32 copy on the host
    log.info("loaded %d tensors from %s (this rank's rows of each)", sum(map(len, by_file.values())), files.folder)


def _check_shape(path: Path, name: str, value: torch.Tensor, local: torch.Tensor) -> None:
    if tuple(value.shape) != tuple(local.shape):
        raise ValueError(
            f"{path}: tensor {name} has shape {tuple(value.shape)} for this rank, the model expects "
            f"{tuple(local.shape)}; the checkpoint does not match its config.json"
        )


def _copy_experts(
    files: CheckpointFiles,
    name: str,
    source: StackedExperts,
    rows: tuple[int, int],
    num_experts: int,
    local: torch.Tensor,
) -> None:
    """Fill `local`, experts [start, stop) of the stacked parameter `name`, from the checkpoint's per-expert
    tensors, one tensor at a time, each copied into its place (converted to the parameter's dtype on the way)."""
    from safetensors import safe_open

    for names in source.parts:
        if len(names) != num_experts:
            raise ValueError(
                f"{files.folder}: {name} stacks one tensor per expert, and the checkpoint has {len(names)} tensors "
                f"like {names[0]} where the model has {num_experts} experts; the checkpoint does not match its "
                "config.json"
            )
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}

        def stored(key: str):
            path = files.files[key]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            return opened[path]

        for row, expert in enumerate(range(*rows)):
            keys = [names[expert] for names in source.parts]
            shapes = [stored(key).get_slice(key).get_shape() for key in keys]
            whole = [*shapes[0][: source.dim], sum(s[source.dim] for s in shapes), *shapes[0][source.dim + 1 :]]
            if whole != list(local.shape[1:]):
                raise ValueError(
                    f"{files.folder}: {' + '.join(f'{k} {tuple(s)}' for k, s in zip(keys, shapes, strict=True))} "
                    f"concatenated on dim {source.dim} make a {tuple(whole)} expert of {name}, the model expects "
                    f"{tuple(local.shape[1:])}; the checkpoint does not match its config.json"
                )
            offset = 0
            for key, shape in zip(keys, shapes, strict=True):
                place = local[row].narrow(source.dim, offset, shape[source.dim])
                value = stored(key).get_tensor(key)
                _check_shape(files.files[key], key, value, place)
                place.copy_(value)
                offset += shape[source.dim]
