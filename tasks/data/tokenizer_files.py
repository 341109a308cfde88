"""What the data stages need from a tokenizer folder before tokenizing (its chat template, special tokens and
vocabulary), read from the folder's files with the `tokenizers` library instead of transformers.

Loading a tokenizer through transformers imports torch: ~9 s on 2 cores, most of a plain `sftflow data` whose
stages are all Cached. Folders this cannot read exactly (no `tokenizer.json`, several named chat templates, a
template list in the config) are loaded through transformers as before, so the result never differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The attributes transformers' `special_tokens_map` reports, in its order.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TokenizerFiles:
    """The part of a Hugging Face tokenizer's interface that template resolution reads (`special_tokens_map`,
    `chat_template`, `get_vocab`), from files. The vocabulary is parsed from `tokenizer.json` only when asked for:
    resolving a template needs the small config files alone."""

    path: Path
    special_tokens_map: dict[str, str]
    chat_template: str | None

    def get_vocab(self) -> dict[str, int]:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(self.path / "tokenizer.json")).get_vocab(with_added_tokens=True)
        # transformers adds a configured special token that the vocabulary lacks when it loads the tokenizer (the id
        # given here is a placeholder: only membership is read)
        for text in self.special_tokens_map.values():
            vocab.setdefault(text, len(vocab))
        return vocab


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialized AddedToken
        return value["content"]
    return None


def read_tokenizer_files(folder: str | Path) -> TokenizerFiles | None:
    """The folder's template, special tokens and vocabulary, or None where only transformers reads it exactly."""
    folder = Path(folder)
    config_path, tokenizer_json = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_json.is_file()) or (folder / "additional_chat_templates").exists():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        mapped = folder / "special_tokens_map.json"
        extra = json.loads(mapped.read_text(encoding="utf-8")) if mapped.is_file() else {}
    except (OSError, ValueError):
        return None  # transformers reports the broken file in its own words
    if not isinstance(config, dict) or not isinstance(extra, dict):
        return None
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None  # a list of named templates: transformers decides which one is the default
    special = {}
    for key in SPECIAL_KEYS:
        # special_tokens_map.json wins over tokenizer_config.json where both name a token, as in transformers
        text = _token_text(extra.get(key))
        if text is None:
            text = _token_text(config.get(key))
        if text is not None:
            special[key] = text
    return TokenizerFiles(path=folder, special_tokens_map=special, chat_template=template or None)


def load_tokenizer_files(folder: str | Path):
    """`read_tokenizer_files`, or the transformers tokenizer where the files alone are not enough."""
    files = read_tokenizer_files(folder)
    if files is not None:
        return files
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
