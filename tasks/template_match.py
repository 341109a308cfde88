"""`template: auto`: the shipped template with generation tags that renders what a tokenizer's own template renders.

Official chat templates carry no `{% generation %}` tags, so they cannot say which text to train. sftflow ships
tagged templates written for the common formats (`sftflow/tasks/templates/*.jinja`); `auto` renders a set of probe
conversations (one and several turns, with and without a system message, contents with surrounding whitespace, and a
tool call when the tokenizer's template mentions tools) with the tokenizer's template and with each shipped one, and
picks the shipped template whose text is the same on every probe (the markers of its tags removed). A probe that both
templates refuse (a system message for Gemma) counts as the same; one that only one refuses does not.
"""

from __future__ import annotations

from jinja2.exceptions import TemplateError

from sftflow.tasks.template_limits import RenderLimitError

_USER, _ASSISTANT = "What is 2 + 3?", "2 + 3 = 5."
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {}}}
]

PROBES: list[tuple[list[dict], list[dict] | None]] = [
    ([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}], None),
    (
        [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _ASSISTANT},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _ASSISTANT},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "  Reverse 'abc'.\n"},
            {"role": "assistant", "content": "\n'cba' "},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 degrees."},
        ],
        _TOOLS,
    ),
]
# Probes that must render with the tokenizer's template for a match to count (the plain conversations).
_REQUIRED = 1

_FAILURES = (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError, RenderLimitError)


def _render(template, messages, tools) -> str | None:
    try:
        return template.render(messages, tools)[0]
    except _FAILURES:
        return None


def renders_alike(official, tagged) -> bool:
    """Whether `tagged` renders the probe conversations as `official` does (see the module docstring)."""
    for i, (messages, tools) in enumerate(PROBES):
        if tools and "tool" not in official.text:  # a template that knows nothing of tools: nothing to compare
            continue
        want, got = _render(official, messages, tools), _render(tagged, messages, tools)
        if want is None and i < _REQUIRED:
            return False
        if want != got:
            return False
    return True
