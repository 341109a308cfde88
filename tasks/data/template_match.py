"""`template: auto`: the shipped template with generation tags that renders what a tokenizer's own template renders.

Official chat templates carry no `{% generation %}` tags, so they cannot say which text to train. sftflow ships
tagged templates written for the common formats (`sftflow/tasks/templates/*.jinja`); `auto` renders a set of probe
conversations (one and several turns, with and without a system message, contents with surrounding whitespace, and a
tool call when the tokenizer's template mentions tools) with the tokenizer's template and with each shipped one, and
picks the shipped template whose text is the same on every probe (the markers of its tags removed). A probe that both
templates refuse (a system message for Gemma) counts as the same; one that only one refuses does not, with one
exception: a shipped template may refuse tool calls that the official one drops without a word (renders the same with
or without them), since training such a turn would teach an answer without its call.

Templates that write the day they render (Llama 3.2, SmolLM3) read the same `strftime_now`; all probes are rendered
at one instant (`fixed_clock`), so that a comparison across midnight still sees one day.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from sftflow.tasks.data.template_clock import fixed_clock
from sftflow.tasks.data.template_limits import RenderLimitError

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
PROBE_NAMES = ("one turn", "a system message", "several turns", "surrounding whitespace", "a tool call")
# Probes that must render with the tokenizer's template for a match to count (the plain conversations).
_REQUIRED = 1

_FAILURES = (TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError, RenderLimitError)


def _render(template, messages, tools) -> tuple[str, list[tuple[int, int]]] | None:
    try:
        return template.render(messages, tools)
    except _FAILURES:
        return None


def _text(template, messages, tools) -> str | None:
    rendered = _render(template, messages, tools)
    return None if rendered is None else rendered[0]


def _without_tool_calls(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]


def _compared(official) -> list[tuple[int, list[dict], list[dict] | None]]:
    # a template that knows nothing of tools: nothing to compare on the tool probe
    return [(i, m, t) for i, (m, t) in enumerate(PROBES) if not (t and "tool" not in official.text)]


def _verdicts(official, tagged) -> Iterator[tuple[int, bool, bool]]:
    """Per probe compared, lazily: (its index, whether both render the same text, whether the probe is alike: the
    same, or refused by `tagged` where `official` drops the tool calls). Callers render under one `fixed_clock`."""
    for i, messages, tools in _compared(official):
        want, got = _text(official, messages, tools), _text(tagged, messages, tools)
        if want is None and i < _REQUIRED:
            yield i, False, False
            continue
        equal = want == got
        yield i, equal, equal or (got is None and _refuses_what_is_dropped(official, tagged, messages, tools, want))


def renders_alike(official, tagged) -> bool:
    """Whether `tagged` renders the probe conversations as `official` does (see the module docstring)."""
    with fixed_clock():
        return all(alike for _, _, alike in _verdicts(official, tagged))


@dataclass(frozen=True)
class ProbeCount:
    """How `tagged` compares with `official` on the probes: `compared` of them (the tool call only where `official`
    mentions tools), `equal` rendered the same text, `alike` as `renders_alike` counts them; `differing`: the names
    of those that are not equal."""

    compared: int
    equal: int
    alike: int
    differing: tuple[str, ...]


def count_alike(official, tagged) -> ProbeCount:
    """`renders_alike`, counted over every probe (it stops at the first that is not alike)."""
    with fixed_clock():
        verdicts = list(_verdicts(official, tagged))
    return ProbeCount(
        compared=len(verdicts),
        equal=sum(equal for _, equal, _ in verdicts),
        alike=sum(alike for _, _, alike in verdicts),
        differing=tuple(PROBE_NAMES[i] for i, equal, _ in verdicts if not equal),
    )


def _refuses_what_is_dropped(official, tagged, messages, tools, want: str | None) -> bool:
    """Whether `official` renders `messages` as if their tool calls were not there (and `tagged` refuses them), while
    `tagged` renders the rest as `official` does: with the tools, or without them where `official` ignores them too
    (and `tagged` refuses those)."""
    calls = [m for m in messages if m.get("tool_calls")]
    if want is None or not calls:
        return False
    rest = _without_tool_calls(messages)
    if _text(official, rest, tools) != want:
        return False
    rest_tools = None if _text(official, rest, None) == want else tools
    return _text(tagged, rest, rest_tools) == _text(official, rest, rest_tools)


def tags_cover_more(official, tagged) -> bool:
    """Whether the generation tags of `official` (a template that has some) cover all `tagged` trains and more, on
    the probes both render: tags around role cues or separators besides the answers."""
    wider = False
    with fixed_clock():
        for _, messages, tools in _compared(official):
            theirs, ours = _render(official, messages, tools), _render(tagged, messages, tools)
            if theirs is None or ours is None:
                continue
            if theirs[0] != ours[0]:
                return False
            inside = all(any(a <= s and e <= b for a, b in theirs[1]) for s, e in ours[1])
            if not inside:
                return False
            wider = wider or theirs[1] != ours[1]
    return wider
