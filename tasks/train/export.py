"""Export: a Hugging Face `save_pretrained` folder (safetensors + config + tokenizer) that `from_pretrained` loads.

The weights are written a tensor group at a time (one decoder layer, or one of the embeddings, final norm and head):
each group is gathered to full tensors, cast to the export dtype, put through the model family's save-time
conversions (transformers' own table: Qwen3-MoE's stacked experts become one tensor per expert again) and added to the
current safetensors shard, which is written once it would pass 5 GB. Rank 0 so holds at most one shard and one group
at a time, not the whole model (an 8B model in fp32 and its bf16 copy, ~48 GB, before), and a model larger than its
host memory exports. Files are written into a staging folder beside `out` and moved in once complete.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.core.leftovers import remove
from sftflow.tasks.train.checksums import CHECKSUMS

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# save_pretrained's default `max_shard_size="5GB"`, in its units (10**9 bytes).
MAX_SHARD_BYTES = 5 * 10**9
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")
_WEIGHT_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def export_dtype(config, dtype: str) -> torch.dtype:
    """`dtype` ("bf16", "fp32"), or for "auto" the dtype of the source model's config (fp32 for presets and random
    inits)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    target = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, target) if isinstance(target, str) else target


def saved_tensor_names(model) -> list[str]:
    """The state-dict names `save_pretrained` stores for `model` (a meta model will do), before its save-time
    conversions: a tied tensor once, under its first name (the input embedding, not the head tied to it), and none
    of `_keys_to_ignore_on_save`."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    seen, names = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or name in ignored:
            continue
        seen.add(id(tensor))
        names.append(name)
    return names


def tensor_groups(names: list[str]) -> list[list[str]]:
    """`names` in groups that the save-time conversions never cross: each decoder layer's tensors together, every
    other tensor on its own; in the order of `names`."""
    groups: dict[str, list[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return list(groups.values())


def _revert_conversions(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the names and layout checkpoints of `model`'s family hold (transformers' save-time reversal of
    its load-time conversions)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 converts nothing on load: its models name tensors as checkpoints do
        return tensors
    return revert_weight_conversion(model, tensors)


class ShardWriter:
    """safetensors shards of at most `max_bytes` (a larger tensor alone in one), in the order tensors are added,
    named and indexed as `save_pretrained` names them once the count is known."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.parts: list[list[str]] = []  # the tensor names of each written part
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.current, self.folder / f"part-{len(self.parts)}.safetensors", metadata={"format": "pt"})
        self.parts.append(list(self.current))
        self.current, self.current_bytes = {}, 0

    def finish(self, total_parameters: int) -> None:
        if self.current or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            (self.folder / "part-0.safetensors").rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.parts):
            file = f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors"
            (self.folder / f"part-{i}.safetensors").rename(self.folder / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_parameters": total_parameters, "total_size": self.total_bytes},
                 "weight_map": weight_map}  # fmt: skip
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_streamed(
    tensor_of: Callable[[str], torch.Tensor],
    config,
    out_dir: str | Path,
    *,
    is_main: bool = True,
    tokenizer: str | None = None,
    dtype: str = "auto",
    source: str | None = None,
    chat_template: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the model of `config` whose full tensors `tensor_of(name)` gives (by state-dict name, fp32, on any
    device) into `out_dir`, as `save_pretrained` writes it: safetensors (sharded with an index past
    `max_shard_bytes`), the config, the source folder's `generation_config.json`, the tokenizer, and the chat template
    the training data was rendered with (`chat_template`, a .jinja file).

    Every rank calls this and `tensor_of` for every name in the same order (gathering a sharded parameter is a
    collective); only `is_main` writes. The config is that of the model rebuilt with the stock `sdpa` attention, so
    the folder loads anywhere without sftflow registered."""
    out = Path(out_dir)
    target = export_dtype(config, dtype)
    model = _meta_model(config)
    staging = out.parent / f".{out.name}.writing"
    if is_main:
        remove(staging)  # a killed export's (a link there is removed, not followed)
        staging.mkdir(parents=True)
    shards = ShardWriter(staging, max_shard_bytes)
    for group in tensor_groups(saved_tensor_names(model)):
        tensors = {}
        for name in group:
            full = tensor_of(name).detach()  # on every rank: gathering a shard is a collective
            if is_main:
                tensors[name] = _cast(full, target).cpu()
            del full
        if is_main:
            for name, tensor in _revert_conversions(model, tensors).items():
                shards.add(name, tensor)
        del tensors
    if not is_main:
        return out
    shards.finish(total_parameters=model.num_parameters())
    model.config.dtype = str(target).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(staging)
    if model.can_generate():
        model.generation_config.save_pretrained(staging)
    _ship_extras(staging, out, tokenizer, source, chat_template)
    _with_umask_permissions(staging)
    _write_listing(staging)  # what every reader of the folder checks (`verify_export`)
    _move_in(staging, out)
    return out


def export_hf(state_dict: dict[str, torch.Tensor], config, out_dir: str | Path, **options) -> Path:
    """`export_streamed` (with its keyword `options`) from a full, unsharded state dict under the model's Hugging Face
    names (a tied head may be there under its own name, or not); any other missing or unexpected name is an error."""
    model = _meta_model(config)
    missing = set(saved_tensor_names(model)) - set(state_dict)
    unexpected = set(state_dict) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"export to {out_dir}: missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    return export_streamed(state_dict.__getitem__, config, out_dir, **options)


def _meta_model(config):
    """`config`'s model on the meta device, with the stock attention (what the exported config names)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating-point tensors in the export dtype; others (integer buffers) as they are, as `Module.to` does."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _ship_extras(folder: Path, out: Path, tokenizer: str | None, source: str | None, chat_template: str | None) -> None:
    """Into `folder`: the source's generation config, the tokenizer and the chat template the data was rendered
    with."""
    from transformers import AutoTokenizer

    generation = Path(source) / "generation_config.json" if source else None
    if generation is not None and generation.is_file():
        shutil.copyfile(generation, folder / "generation_config.json")
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        if chat_template is not None:
            # Generation tags render as plain text in Hugging Face's template environment too.
            tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
        tok.save_pretrained(folder)
    else:
        log.warning("export to %s: no tokenizer given; the folder has model weights and config only", out)


def _move_in(staging: Path, out: Path) -> None:
    """Replace the weights (and the other files written) in `out` with `staging`'s complete ones; what else `out`
    holds (a LoRA run's `adapter/`) stays.

    Each file is replaced by a rename (a reader opens the old file or the new one, never a gap), the old weight files
    the new export does not have are removed after, and `CHECKSUMS` comes last: until it does, the folder's listing is
    the old one, so a reader that checks it (`verify_export`) refuses a folder caught halfway instead of loading old
    and new shards together."""
    out.mkdir(parents=True, exist_ok=True)
    new_names = {new.name for new in staging.iterdir()}
    for new in sorted(staging.iterdir(), key=lambda p: p.name == CHECKSUMS):
        if new.name != CHECKSUMS:
            new.replace(out / new.name)
    for old in out.iterdir():
        if old.is_file() and _WEIGHT_FILES.match(old.name) and old.name not in new_names:
            old.unlink()
    (staging / CHECKSUMS).replace(out / CHECKSUMS)
    staging.rmdir()


def _write_listing(folder: Path) -> None:
    """`CHECKSUMS`: the sha256 of every file under `folder`, by relative path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    write_atomic(folder / CHECKSUMS, "".join(f"{sha256_file(p)}  {p.relative_to(folder)}\n" for p in files))


def _with_umask_permissions(folder: Path) -> None:
    """The files as the user's umask makes any file (safetensors writes its own with mode 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~mask)


def verify_export(folder: str | Path) -> None:
    """Raise `ValueError` naming the first file of an exported folder that differs from its `CHECKSUMS` (or is
    missing). A folder without the listing (a hub model, an older export) is not checked."""
    folder = Path(folder)
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return
    for line in listing.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split("  ", 1)
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{file} is missing from the exported model {folder} (listed in {listing})")
        if sha256_file(file) != digest:
            raise ValueError(
                f"{file} does not match its sha256 in {listing}: the exported model is damaged, or was being "
                "rewritten while read; export it again (or wait for the export to finish)"
            )


def tokenizer_source(model_spec: str, tokenizer: str | None) -> str | None:
    """The tokenizer to ship: the configured one, else the model folder's own if it has one."""
    if tokenizer is not None:
        return tokenizer
    folder = Path(model_spec)
    if folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return str(folder)
    return None
