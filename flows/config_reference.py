"""The configuration reference, generated from `SFTConfig`'s fields and their descriptions.

`python -m sftflow.flows.config_reference > docs/reference/config.md` regenerates the page; a test fails when the
page differs from what this module writes, so the reference follows the config classes.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REGENERATE = "python -m sftflow.flows.config_reference > docs/reference/config.md"

_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "min length", "max_length": "max length"}


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _constraints(metadata: list[Any]) -> list[Any]:
    """The constraints of `metadata`, with a `Field(...)` opened: `Annotated[int, Field(ge=1)]` inside a union keeps
    the `FieldInfo` itself as its metadata (pydantic opens it only at the top of a field), its bounds inside."""
    found = []
    for item in metadata:
        found.extend(_constraints(item.metadata) if isinstance(item, FieldInfo) else [item])
    return found


def _bounds(metadata: list[Any]) -> str:
    """` ≥ 1`, ` > 0, ≤ 1`, ... from a field's or an `Annotated` type's constraints."""
    found = []
    for item in _constraints(metadata):
        for name, sign in _BOUNDS.items():
            value = getattr(item, name, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return f" ({', '.join(found)})" if found else ""


def type_name(tp: Any) -> str:
    """A readable name of an annotation: `int`, `str | null`, `"packed" | "padded"`, `list[SourceSpec]`."""
    if tp is None or tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0]) + _bounds(list(args[1:]))
    if origin is Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else str(a).lower() for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if name == "tuple" and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{type_name(args[0])}, ...]"
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in tp)
    if isinstance(tp, type):
        return {"NoneType": "null", "PurePath": "path", "Path": "path"}.get(tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")


def _value(value: Any) -> str:
    """A default as it would be written in the YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return _value(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, BaseModel):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.model_dump(mode="json").items()) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def default_text(field: FieldInfo) -> str:
    """`required`, the default value, or `(section)` for a default that is a nested section of its own."""
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return ""
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{_value(value)}`"


def _models_in(tp: Any) -> list[tuple[type[BaseModel], bool]]:
    """The models an annotation holds, each with whether it is an item of a list (or tuple, or dict value)."""
    if _is_model(tp):
        return [(tp, False)]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in args for m in _models_in(a)]
    if origin in (list, tuple, set, frozenset, dict):
        return [(m, True) for a in args for m, _ in _models_in(a)]
    return []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(model: type[BaseModel], key: str = "", _outer: tuple[type, ...] = ()) -> list[tuple[str, type[BaseModel]]]:
    """Every (section key, model) under `model`, depth first in field order: `data`, `data.render`, ...; an item of
    a list of models is `key[]`, and a union of several models names each (`key (Model)`). A model already being
    walked (a recursive config) is not walked again."""
    found = [(key, model)]
    for name, field in model.model_fields.items():
        models = _models_in(field.annotation)
        for sub, listed in models:
            if sub is model or sub in _outer:
                continue
            sub_key = (f"{key}.{name}" if key else name) + ("[]" if listed else "")
            if len(models) > 1:
                sub_key += f" ({sub.__name__})"
            found.extend(sections(sub, sub_key, (*_outer, model)))
    return found


def _section_table(key: str, model: type[BaseModel]) -> str:
    title = f"`{key}`" if key else "top level"
    lines = [f"## {title}", ""]
    doc = " ".join((model.__doc__ or "").split()) if model.__doc__ and model.__doc__ != BaseModel.__doc__ else ""
    lines += [f"`{model.__name__}`" + (f": {doc}" if doc else ""), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        shown = field.alias or name
        typ = type_name(field.annotation) + _bounds(field.metadata)
        lines.append(
            f"| `{shown}` | `{_cell(typ)}` | {_cell(default_text(field))} | {_cell(field.description or '')} |"
        )
    return "\n".join(lines)


def reference(model: type[BaseModel] | None = None) -> str:
    """The configuration reference as Markdown: one table per section (key, type, default, description)."""
    if model is None:
        from sftflow.flows.config import SFTConfig

        model = SFTConfig
    parts = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config classes' field descriptions; do not edit. Regenerate with: {REGENERATE} -->",
        "",
        "Generated from the field descriptions of `sftflow.flows.config.SFTConfig`; regenerate it with",
        f"`{REGENERATE}`.",
        "Every key can be set in the YAML config, with `--set KEY=VALUE` on any command",
        "(`--set train.optimizer.lr=1e-5`), or in a flow's `overrides`",
        "(`-p overrides='{\"train.optimizer.lr\": 1e-5}'`, see [Deployments](../deployments.md#parameters)).",
        "A section whose default is `(section)` has its own table below; `key[]` is an item of a list.",
    ]
    for key, sub in sections(model):
        parts += ["", _section_table(key, sub)]
    return "\n".join(parts) + "\n"


def main() -> None:
    print(reference(), end="")


if __name__ == "__main__":
    main()
