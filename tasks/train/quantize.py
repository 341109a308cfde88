"""QLoRA: the frozen base's linear layers held in 4 bits (bitsandbytes NF4), LoRA adapters trained on top.

With `train.quantize: nf4` (and `train.lora`), every frozen `nn.Linear` of the model but the LM head (the decoder's
projections, which PEFT has wrapped as `<name>.base_layer`) becomes a `bitsandbytes.nn.Linear4bit`::

    weight     Params4bit: NF4 codes, two per byte, in blocks of 64 weights with one absmax per block; the absmaxes
               quantised again to 8 bits in blocks of 256 (double quantisation, `compress_statistics`), as QLoRA does:
               ~0.52 bytes per weight instead of 2
    matmul     dequantise the weight to the compute dtype (bf16), multiply; the input's gradient likewise, and the
               weight gets none
    kept bf16  embeddings, norms, the LM head (the fused cross-entropy reads it), biases

The adapters and their fused AdamW stay fp32 and the decoder runs under bf16 autocast, as on the LoRA path.

Loading. The model is built as for LoRA (on the meta device, a checkpoint read shard by shard). The linears to be
quantised are set aside, `sftflow.tasks.train.weights.materialize` gives the rest (embeddings, norms, head,
adapters) their storage and weights, and then each linear is read from the checkpoint one tensor at a time (on the
host, in the checkpoint's dtype), copied to the GPU in bf16, quantised there and dropped. No bf16 copy of the whole
base is made: the transient above the final model is one linear's weight, in bf16 on the GPU (the largest, e.g.
Llama-3.1-8B's 14336 x 4096 MLP projections: 112 MiB) and in the checkpoint's dtype on the host. A model already in
memory (what transformers loads whole) is quantised layer by layer from its own weights, each freed once quantised.

Compiled layers. The 4-bit matmul runs outside the layer's graph (`torch.compiler.disable` on each `Linear4bit`):
dynamo breaks the layer's graph around each projection and compiles the pieces between them (norms, RoPE and
attention, SwiGLU, residual adds), and the adapters' matmuls stay in those pieces.

Checkpoints and export. Checkpoints hold the adapters and their optimizer state, as for LoRA; a resume quantises the
base again from its checkpoint (quantisation is deterministic). The export's `hf/adapter/` is PEFT's folder as for
LoRA; `merge` merges the adapters into the bf16 base read again from its checkpoint a tensor at a time
(`base_tensor_of`), not into the dequantised 4-bit weights they were trained against: the merged model is the
adapter applied to the original model, as `PeftModel.from_pretrained(original, adapter)` computes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sftflow.tasks.train.lora import checkpoint_name, is_adapter
from sftflow.tasks.train.weights import CheckpointFiles, checkpoint_sources, materialize, tied_names

log = logging.getLogger("sftflow.train")


def nf4_refusal(config, *, cuda: bool, bitsandbytes: bool) -> str | None:
    """Why a `train.quantize: nf4` run (`TrainConfig`) cannot train here, in one line that says what to do instead, or
    None. `cuda`: a CUDA GPU is visible; `bitsandbytes`: the package is importable (the launcher checks both)."""
    from sftflow.tasks.train.model import PRESETS

    ranks = config.nproc * config.nnodes
    if ranks > 1:
        return (
            f"train.quantize: nf4 (QLoRA) trains on one GPU, and this run has {ranks} ranks (nproc x nnodes): FSDP "
            "cannot shard a 4-bit base; set nproc: 1, or train LoRA on the bf16 base over all ranks (quantize: none)"
        )
    if config.parallel == "fsdp":
        return "train.quantize: nf4 (QLoRA) trains on the one-GPU path, not under FSDP; set parallel: auto or single"
    if config.model in PRESETS or config.model.endswith(".json"):
        return (
            f"train.quantize: nf4 (QLoRA) quantises a pretrained base, and model {config.model!r} is a random init; "
            "give train.model a Hugging Face folder or hub id, or train LoRA without quantize"
        )
    if config.device == "cpu" or not cuda:
        return (
            "train.quantize: nf4 (QLoRA) runs on CUDA GPUs only (bitsandbytes' 4-bit matmuls); this run has none: "
            "train LoRA on the bf16 base instead (quantize: none)"
        )
    if not bitsandbytes:
        return "train.quantize: nf4 (QLoRA) needs bitsandbytes: pip install 'sftflow[qlora]'"
    return None


# NF4 with double quantisation: 4 bits a weight, an 8-bit absmax per block of 64, an fp32 scale per 256 blocks.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)


def frozen_weight_bytes(lm: nn.Module, quantize: str) -> float:
    """Bytes the frozen weights will take on the device: 2 per weight in bf16, NF4's per quantised linear."""
    frozen = sum(p.numel() for p in lm.parameters() if not p.requires_grad)
    if quantize != "nf4":
        return 2.0 * frozen
    quantised = sum(lm.get_submodule(name).weight.numel() for name in frozen_linear_names(lm))
    return 2.0 * (frozen - quantised) + NF4_BYTES_PER_WEIGHT * quantised


def frozen_linear_names(lm: nn.Module) -> list[str]:
    """The modules QLoRA quantises: every frozen `nn.Linear` but the LM head (a LoRA-wrapped projection's
    `base_layer`, or a linear no adapter targets)."""
    head = lm.get_output_embeddings()
    return [
        name
        for name, module in lm.named_modules()
        if type(module) is nn.Linear and module is not head and not module.weight.requires_grad
    ]


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def nf4_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device, compute_dtype: torch.dtype
) -> nn.Module:
    """A `bitsandbytes.nn.Linear4bit` on `device` holding `weight` (out, in) as NF4 with double quantisation,
    quantised from its `compute_dtype` rounding (what the bf16 LoRA base holds), computing in `compute_dtype`."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    with torch.device("meta"):
        linear = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
        )
    value = weight.detach().to(device=device, dtype=compute_dtype)
    # `.to` a device quantises a not yet quantised `Params4bit` there; `value` is then dropped.
    linear.weight = bnb.nn.Params4bit(
        value, requires_grad=False, compress_statistics=True, quant_type="nf4", module=linear
    ).to(device)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(device=device, dtype=compute_dtype), requires_grad=False)
    # The 4-bit matmul stays outside compiled graphs (see the module docstring); in eager this is a plain call.
    linear.forward = torch.compiler.disable(linear.forward)
    return linear


@torch.no_grad()
def quantize_base(
    lm: nn.Module, device: torch.device, files: CheckpointFiles | None, compute_dtype: torch.dtype, seed: int = 0
) -> int:
    """Give `lm` (a LoRA model, its base frozen) its weights on `device` with the frozen linears in NF4: read from
    `files` for a model on the meta device, else from the model's own weights. Returns how many were quantised."""
    names = frozen_linear_names(lm)
    if not names:
        raise ValueError("train.quantize: nf4 found no frozen linear layer to quantise in the model")
    on_meta = any(p.is_meta for p in lm.parameters())
    if on_meta:
        if files is None:
            raise ValueError("train.quantize: nf4 needs the base's weights: its model is on the meta device")
        sources, _ = checkpoint_sources(lm, files)  # while the linears are still in the model
        shapes = {name: tuple(lm.get_submodule(name).weight.shape) for name in names}
        for name in names:
            _set_module(lm, name, nn.Identity())  # out of `materialize`'s way: it fills the rest
        materialize(lm, lm, device, files, seed=seed)
        _read_quantized(lm, shapes, sources, files, device, compute_dtype)
    else:
        for name in names:
            old = lm.get_submodule(name)
            _set_module(lm, name, nf4_linear(old.weight, old.bias, device, compute_dtype))
            del old  # its weight is freed here, before the next layer is quantised
        lm.to(device)
    log.info(
        "quantize: %d frozen linear layers in NF4 (double quantisation, compute %s); the 4-bit matmuls run outside "
        "compiled graphs",
        len(names),
        str(compute_dtype).removeprefix("torch."),
    )
    return len(names)


def _read_quantized(
    lm: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    sources: dict,
    files: CheckpointFiles,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> None:
    """Read each linear of `shapes` (name -> weight shape) from the checkpoint, one tensor at a time, and put it into
    `lm` in NF4."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        source = sources.get(checkpoint_name(f"{name}.weight"))
        if not isinstance(source, str):
            raise ValueError(f"{files.folder}: the checkpoint holds no tensor {checkpoint_name(f'{name}.weight')}")
        by_file.setdefault(files.files[source], []).append(name)
    for path, pending in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in pending:
                weight_name = checkpoint_name(f"{name}.weight")
                weight = f.get_tensor(sources[weight_name])
                bias_name = sources.get(checkpoint_name(f"{name}.bias"))
                bias = f.get_tensor(bias_name) if bias_name is not None else None
                if tuple(weight.shape) != shapes[name]:
                    raise ValueError(
                        f"{path}: tensor {weight_name} has shape {tuple(weight.shape)}, the model expects "
                        f"{shapes[name]}; the checkpoint does not match its config.json"
                    )
                _set_module(lm, name, nf4_linear(weight, bias, device, compute_dtype))


def base_tensor_of(lm: nn.Module, spec: str, overrides: dict | None = None) -> Callable[[str], torch.Tensor]:
    """A QLoRA run's base tensors for the export, by the training model's names (a wrapped projection's
    `base_layer`), in bf16 on the CPU, read again from `spec`'s checkpoint, never the dequantised 4-bit weights. A
    local safetensors folder that holds each tensor under its own name is read a tensor at a time; anything else
    (a hub id, tensors that transformers converts on load) is loaded whole by `from_pretrained`."""
    from safetensors import safe_open

    files = CheckpointFiles.find(spec)
    wanted = {checkpoint_name(n) for n, _ in lm.named_parameters(remove_duplicate=False) if not is_adapter(n)}
    tied = {checkpoint_name(name) for name in tied_names(lm)}  # a tied head: no checkpoint need hold it
    if files is None or not wanted <= set(files.files) | tied:
        whole = _base_state_dict(lm, spec, overrides)
        return whole.__getitem__

    def tensor_of(name: str) -> torch.Tensor:
        stored = checkpoint_name(name)
        with safe_open(files.files[stored], framework="pt") as f:
            return f.get_tensor(stored).to(torch.bfloat16)

    return tensor_of


def _base_state_dict(lm: nn.Module, spec: str, overrides: dict | None = None) -> dict[str, torch.Tensor]:
    """The base model read again from `spec` (its folder or hub id) in bf16 on the CPU, under `lm`'s names."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(spec, dtype=torch.bfloat16, **dict(overrides or {}))
    names = {checkpoint_name(n): n for n, _ in lm.named_parameters(remove_duplicate=False) if not is_adapter(n)}
    return {names.get(k, k): v for k, v in base.state_dict().items()}
