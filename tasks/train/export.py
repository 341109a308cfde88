"""Export: a Hugging Face `save_pretrained` folder (safetensors + config + tokenizer) that `from_pretrained` loads."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_hf(
    state_dict: dict[str, torch.Tensor],
    config,
    out_dir: str | Path,
    *,
    tokenizer: str | None,
    dtype: str = "auto",
    source: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write `state_dict` (full, unsharded, HF names) as a model of `config` into `out_dir`: safetensors (sharded
    with an index past 5 GB, as the Hub does), the config, the source folder's `generation_config.json`, the
    tokenizer, and the chat template the training data was rendered with (`chat_template`, a .jinja file).

    The model is rebuilt with the stock `sdpa` attention, so the folder loads anywhere without sftflow registered.
    `dtype="auto"` keeps the dtype of the source model's config (fp32 for presets and random inits).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if dtype == "auto":
        target = getattr(config, "dtype", None) or torch.float32
        target = getattr(torch, target) if isinstance(target, str) else target
    else:
        target = _DTYPES[dtype]
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # Tied heads appear under one name only; anything else missing is a real mismatch.
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"export to {out}: missing weights {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.to(target).save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    generation = Path(source) / "generation_config.json" if source else None
    if generation is not None and generation.is_file():
        shutil.copyfile(generation, out / "generation_config.json")
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        if chat_template is not None:
            # Generation tags render as plain text in Hugging Face's template environment too.
            tok.chat_template = Path(chat_template).read_text(encoding="utf-8")
        tok.save_pretrained(out)
    else:
        log.warning("export to %s: no tokenizer given; the folder has model weights and config only", out)
    return out


def tokenizer_source(model_spec: str, tokenizer: str | None) -> str | None:
    """The tokenizer to ship: the configured one, else the model folder's own if it has one."""
    if tokenizer is not None:
        return tokenizer
    folder = Path(model_spec)
    if folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return str(folder)
    return None
