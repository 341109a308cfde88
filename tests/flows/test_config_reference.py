"""The configuration reference: generated from the config classes, and the checked-in page is what it generates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from sftflow.flows.config_reference import REGENERATE, reference, sections

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


class _Leaf(BaseModel):
    """A leaf."""

    size: int = Field(3, ge=1, description="how big | how wide")
    rows: Annotated[int, Field(ge=2)] | Literal["auto"] = Field("auto", description="a bound inside a union")


class _Other(BaseModel):
    flag: bool = False


class _Root(BaseModel):
    name: str = Field(description="a required name")
    mode: Literal["a", "b"] = "a"
    leaf: _Leaf = _Leaf()
    items: list[str | _Leaf] = Field(default_factory=list, description="paths or leaves")
    either: _Leaf | _Other | None = None


def test_every_section_and_field_is_listed_with_type_default_and_description():
    keys = [key for key, _ in sections(_Root)]
    assert keys == ["", "leaf", "items[]", "either (_Leaf)", "either (_Other)"]
    text = reference(_Root)
    assert "| `name` | `str` | required | a required name |" in text
    assert '| `mode` | `"a" \\| "b"` | `a` |  |' in text
    assert "| `leaf` | `_Leaf` | (section) |  |" in text
    assert "| `items` | `list[str \\| _Leaf]` | `[]` | paths or leaves |" in text
    assert "| `size` | `int (≥ 1)` | `3` | how big \\| how wide |" in text
    assert '| `rows` | `int (≥ 2) \\| "auto"` | `auto` | a bound inside a union |' in text
    assert "| `flag` | `bool` | `false` |  |" in text
    assert text.count("## `items[]`") == 1 and "`_Leaf`: A leaf." in text


def test_the_reference_page_is_current():
    assert PAGE.read_text() == reference(), f"docs/reference/config.md is out of date; regenerate it: {REGENERATE}"


def test_every_field_of_sftconfig_is_in_the_reference():
    from sftflow.flows.config import SFTConfig

    text = reference()
    for key, model in sections(SFTConfig):
        assert (f"## `{key}`" if key else "## top level") in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text
