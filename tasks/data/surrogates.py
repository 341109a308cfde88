"""Lone surrogates: JSON text may escape a UTF-16 half (`"\\ud800"`) that no UTF-8 text can hold. `json.loads`
accepts it, and the record then fails much later, where its text is written or tokenized, with no record named.
Records are checked once, as they are read, and the field holding one is named."""

from __future__ import annotations

import re
from typing import Any

# Only an escape can put a surrogate into a record read from UTF-8 text; lines without one skip the walk.
_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def may_hold_surrogate(json_text: str) -> bool:
    return _ESCAPE_RE.search(json_text) is not None


def lone_surrogate(value: Any) -> tuple[str, str, int] | None:
    """`(field, surrogate, index)` of the first string in `value` holding a lone surrogate, in document order
    (`field` as `messages[1].content`), or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if found := _SURROGATE_RE.search(item):
                return path or "record", found.group(), found.start()
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = f"{path}.{key}" if path else str(key)
                stack.append((child, name))
                stack.append((key, f"{name} (the key)"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def surrogate_reason(surrogate: str, index: int) -> str:
    return (
        f"holds a lone surrogate ('\\u{ord(surrogate):04x}' at character {index}), which is not Unicode text and "
        "cannot be written as UTF-8; fix the text (a UTF-16 pair split in two?) or remove the record"
    )
