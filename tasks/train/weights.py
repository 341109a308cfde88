"""Loading a Hugging Face checkpoint shard by shard: no rank ever holds the whole model.

The model is built on the meta device (no memory, no random init). Its buffers (RoPE frequencies, Gemma's embedding
scale) are not in checkpoints; they are computed on the CPU by the model's own `_init_weights`, the code
`from_pretrained` runs for them. After sharding (FSDP2 turns each parameter into a DTensor holding this rank's rows),
`materialize` allocates the rank's storage on its device and fills each parameter from the safetensors files with
`safe_open(...).get_slice`, reading only this rank's rows of each tensor, one tensor at a time, and converting them
to the parameter's dtype as they are copied in. Peak host memory is one tensor's slice, in the checkpoint's dtype;
tied weights stay one parameter (they are tied on the meta model and FSDP keeps them so).

Checkpoints whose tensor names differ from the model's (transformers renames or fuses some on load, e.g. the
experts of Qwen3-MoE) or that are not safetensors are loaded by `from_pretrained` instead, whole, on every rank
(`shard_loadable` says which).
"""

from __future__ import annotations

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


def shard_loadable(model: nn.Module, files: CheckpointFiles) -> list[str]:
    """The names of `model`'s tensors the checkpoint does not hold under the same name (empty: loadable by slices)."""
    return sorted(set(_state_tensors(model)) - set(files.files))


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


def _tied_names(model: nn.Module) -> dict[str, str]:
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
    tied = _tied_names(model)
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
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if not is_adapter(name):
            by_file.setdefault(files.files[checkpoint_name(name)], []).append((name, tensor))
    for path, pending in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name, tensor in pending:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                rows = _rows(tensor)
                stored = f.get_slice(checkpoint_name(name)).get_shape()
                if stored[0] < tensor.shape[0] and list(stored[1:]) == list(tensor.shape[1:]):
                    value = _grown_rows(f, checkpoint_name(name), rows or (0, tensor.shape[0]))
                elif rows is None:
                    value = f.get_tensor(checkpoint_name(name))
                elif rows[1] > rows[0]:
                    value = f.get_slice(checkpoint_name(name))[rows[0] : rows[1]]
                else:
                    continue  # a rank past the end of a short tensor holds no rows of it
                if tuple(value.shape) != tuple(local.shape):
                    raise ValueError(
                        f"{path}: tensor {name} has shape {tuple(value.shape)} for this rank, the model expects "
                        f"{tuple(local.shape)}; the checkpoint does not match its config.json"
                    )
                local.copy_(value)  # converted on the way (on the GPU, for a GPU parameter): no fp32 copy on the host
    log.info("loaded %d tensors from %s (this rank's rows of each)", sum(map(len, by_file.values())), files.folder)
