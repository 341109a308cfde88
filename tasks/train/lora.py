"""LoRA through `peft`: low-rank adapters on a frozen base, trained and checkpointed alone, exported in PEFT's format.

`apply_lora` injects PEFT's LoRA layers into the Hugging Face model in place (`peft.inject_adapter_in_model`), so the
model keeps its class, its decoder layers (FSDP units, compiled regions) and sftflow's attention and fused loss; a
wrapped `nn.Linear` becomes `<name>.base_layer` beside `<name>.lora_A.default` and `<name>.lora_B.default`. Only the
adapters require gradients. What else changes for a LoRA run:

- the frozen base is held in the compute dtype (bf16 on GPUs; the adapters and their AdamW state stay fp32), and its
  weights are read from the checkpoint even on a resume (checkpoints hold only the adapters); on one GPU the decoder
  runs under bf16 autocast so that the adapters compute in bf16 too (`compute_adapters_in_autocast`), as FSDP's
  mixed precision does where the model is sharded;
- an adapter built on the meta device (a checkpoint read shard by shard) is initialised here as PEFT initialises it
  (`lora_A` Kaiming-uniform, `lora_B` zeros, so step 0 computes the base model), from a generator seeded by the run's
  seed and the parameter's name, so every rank and world size starts from the same adapters;
- the export writes `hf/adapter/` (`adapter_config.json`, `adapter_model.safetensors`, loadable by
  `peft.PeftModel.from_pretrained(base, path)`) and, with `merge`, the merged model in `hf/`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sftflow.tasks.train.config import LoraSettings

ADAPTER = "default"  # PEFT's adapter name


def peft_config(settings: LoraSettings, base: str | None = None):
    from peft import LoraConfig

    targets = settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.scale_alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )


def linear_module_names(model: nn.Module) -> list[str]:
    """The last name parts of the model's `nn.Linear` modules (what `targets` can name), without the LM head."""
    head = model.get_output_embeddings()
    linear = (name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head)
    return sorted({name.rsplit(".", 1)[-1] for name in linear})


def check_targets(model: nn.Module, settings: LoraSettings, spec: str) -> None:
    linear = linear_module_names(model)
    if not isinstance(settings.targets, str):
        unknown = [t for t in settings.targets if t not in linear]
        if unknown:
            raise ValueError(
                f"lora.targets: {unknown} name no linear module of {spec!r}; its linear modules are {linear} "
                "(or use 'all-linear')"
            )


def apply_lora(model: nn.Module, settings: LoraSettings, spec: str) -> None:
    """Inject the adapters into `model` (in place) and freeze everything else."""
    from peft import inject_adapter_in_model

    check_targets(model, settings, spec)
    inject_adapter_in_model(peft_config(settings), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of a model tensor: a wrapped layer's `base_layer` is the original module."""
    return name.replace(".base_layer.", ".")


def initial_adapter(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The initial value of adapter tensor `name`, as PEFT initialises it, the same on every rank and world size."""
    out = torch.zeros(shape, dtype=torch.float32)
    if ".lora_A." in name:
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
    return out


def freeze_in_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the frozen base in `dtype` (the compute dtype): no fp32 copy of weights that never change. The parameters
    stay the same objects (`.data` is replaced), so tied ones stay tied."""
    for param in model.parameters():
        if not param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def compute_adapters_in_autocast(model: nn.Module) -> None:
    """For fp32 adapters on a bf16 base run under autocast: turn off PEFT's cast of each wrapped layer's input to the
    adapter's dtype. That cast makes an fp32 copy of every input (kept for the backward) and runs the adapter's
    matmuls and its output in fp32; under autocast the adapter computes in bf16 and its gradients still reach the fp32
    parameters."""
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def export_adapter(adapters: dict[str, torch.Tensor], config, settings: LoraSettings, base: str, out: Path) -> None:
    """Write `out` (PEFT's adapter folder) from the trained adapters (by the training model's names). PEFT's own
    `save_pretrained` writes it, from a PEFT model built on the meta device: the base is never materialised."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.name_or_path = base  # else PEFT records the config-built model's empty name as the base
        peft_model = get_peft_model(model, peft_config(settings, base))
    wanted = {n.removeprefix("base_model.model.") for n, _ in peft_model.named_parameters() if is_adapter(n)}
    if wanted != set(adapters):
        raise ValueError(
            f"export to {out}: missing adapters {sorted(wanted - set(adapters))}, "
            f"unexpected {sorted(set(adapters) - wanted)}"
        )
    state = {f"base_model.model.{name}": tensor for name, tensor in adapters.items()}
    peft_model.save_pretrained(out, safe_serialization=True, state_dict=state)


def merged_tensor_of(
    lm: nn.Module, base_of: Callable[[str], torch.Tensor], adapters: dict[str, torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """For `export_streamed`: each tensor of the merged model by its Hugging Face name. A wrapped linear's weight is
    its base plus the adapters' product, as PEFT merges it (`transpose(B @ A, fan_in_fan_out) * scaling`, in fp32);
    everything else is the base's. `base_of` gives a base tensor by the training model's name (a wrapped layer's
    `base_layer`), `adapters` the trained adapters."""

    def tensor_of(name: str) -> torch.Tensor:
        module_name, _, leaf = name.rpartition(".")
        module = lm.get_submodule(module_name)
        if not (hasattr(module, "lora_A") and ADAPTER in module.lora_A):
            return base_of(name)
        base = base_of(f"{module_name}.base_layer.{leaf}")
        if leaf != "weight":
            return base
        a = adapters[f"{module_name}.lora_A.{ADAPTER}.weight"].to(base.device, torch.float32)
        b = adapters[f"{module_name}.lora_B.{ADAPTER}.weight"].to(base.device, torch.float32)
        delta = b @ a
        return base.float() + (delta.T if module.fan_in_fan_out else delta) * module.scaling[ADAPTER]

    return tensor_of
