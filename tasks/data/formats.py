"""Record formats, each normalised to OpenAI-style `messages` (or to text with character spans).

- `messages`: `messages` (roles system/user/assistant/tool, `tool_calls`, `reasoning_content`, `name`) and an
  optional record-level `tools`; validated and kept. `content` is a string or a list of text parts
  (`[{"type": "text", "text": ...}]`, joined); other parts are errors.
- `sharegpt`: `conversations` of `{from, value}`, optional `system` and `tools`. human→user, gpt→assistant,
  function_call→assistant with `tool_calls` (the value is the call as JSON), observation→tool.
- `prompt_completion`: `prompt` and `completion`, each a string or a list of messages; optional `system`.
- `alpaca`: `instruction`, optional `input`, `output`, optional `system`. The user turn is `instruction\n\ninput`.
- `text_spans`: `text` plus `spans`, half-open `[start, end)` character (code point) ranges, trained or excluded.

Conventions shared with Hugging Face's `apply_chat_template`: keys whose value is `None` are dropped; tool-call
`arguments` given as a JSON string are parsed into an object (chat templates `tojson` them); tools given as bare
function schemas are wrapped as `{"type": "function", "function": schema}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca", "text_spans")

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
}


class RecordError(ValueError):
    """A record that cannot be rendered: `source` is `file:line` or `file:record N`, `field` names the bad field."""

    def __init__(self, source: str, field: str, reason: str):
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field} {reason}")

    def as_reject(self) -> dict[str, str]:
        return {"source": self.source, "field": self.field, "reason": self.reason}


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class TextWithSpans:
    text: str
    train_char_spans: list[tuple[int, int]]


def detect_format(record: Any) -> str | None:
    """The format of one record from its keys, or None when no format fits."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text_spans"
    return None


def _kind(value: Any) -> str:
    name = type(value).__name__
    return {dict: "an object", list: "a list", type(None): "null"}.get(
        type(value), f"a{'n' * (name[0] in 'aeiou')} {name}"
    )


def _string(record: dict, key: str, source: str, field: str, required: bool = True) -> str | None:
    if key not in record or record[key] is None:
        if required:
            raise RecordError(source, field, "is missing")
        return None
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(source, field, f"is {_kind(value)}; expected a string")
    return value


def _text_content(message: dict, source: str, field: str) -> str:
    """`content` as a string; OpenAI's list of content parts is joined when every part is text.

    Chat templates that accept parts render the text parts back to back, so joining them with nothing between gives
    the same text. Other parts (images, audio, files) have no place in a text model's rendering: they are errors.
    """
    value = message.get("content")
    if not isinstance(value, list):
        return _string(message, "content", source, field)
    texts = []
    for i, part in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(part, dict):
            raise RecordError(
                source, where, f'is {_kind(part)}; expected a content part {{"type": "text", "text": ...}}'
            )
        if part.get("type") != "text":
            raise RecordError(source, f"{where}.type", f"is {part.get('type')!r}; only text parts can be rendered")
        texts.append(_string(part, "text", source, f"{where}.text"))
    message["content"] = "".join(texts)
    return message["content"]


def _parse_json_string(value: Any, source: str, field: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise RecordError(source, field, f"is not valid JSON ({err.msg} at char {err.pos})") from None
    return value


def normalize_tools(value: Any, source: str, field: str = "tools") -> list[dict] | None:
    value = _parse_json_string(value, source, field)
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RecordError(source, field, f"is {_kind(value)}; expected a list of tool schemas")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise RecordError(source, f"{field}[{i}]", f"is {_kind(tool)}; expected an object")
        if "type" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        tools.append(tool)
    return tools


def _normalize_tool_calls(value: Any, source: str, field: str) -> list[dict]:
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RecordError(source, field, f"is {_kind(value)}; expected a non-empty list of tool calls")
    calls = []
    for j, call in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise RecordError(source, where, f"is {_kind(call)}; expected an object")
        call = {k: v for k, v in call.items() if v is not None}
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise RecordError(source, f"{where}.function", f"is {_kind(function)}; expected an object")
        fn_field = f"{where}.function" if "function" in call else where
        _string(function, "name", source, f"{fn_field}.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        function = {**function, "arguments": arguments}
        if "function" in call:
            calls.append({**call, "type": call.get("type", "function"), "function": function})
        else:
            calls.append({"type": "function", "function": function})
    return calls


def normalize_messages(value: Any, source: str, field: str = "messages") -> list[dict]:
    """Validate OpenAI-style messages; return copies with None-valued keys dropped."""
    if not isinstance(value, list):
        raise RecordError(source, field, f"is {_kind(value)}; expected a list of messages")
    if not value:
        raise RecordError(source, field, "is empty")
    messages = []
    for i, raw in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(raw, dict):
            raise RecordError(source, where, f"is {_kind(raw)}; expected an object")
        message = {k: v for k, v in raw.items() if v is not None}
        role = message.get("role")
        if role is None:
            raise RecordError(source, f"{where}.role", "is missing")
        if role not in ROLES:
            raise RecordError(source, f"{where}.role", f"is {role!r}; expected one of {'/'.join(ROLES)}")
        if "tool_calls" in message:
            if role != "assistant":
                raise RecordError(source, f"{where}.tool_calls", f"is set on a {role!r} message; only assistant calls")
            message["tool_calls"] = _normalize_tool_calls(message["tool_calls"], source, f"{where}.tool_calls")
        for key in ("reasoning_content", "name"):
            _string(message, key, source, f"{where}.{key}", required=False)
        if "content" not in message and "tool_calls" in message:
            message["content"] = ""
        content = _text_content(message, source, f"{where}.content")
        if role == "assistant" and not content.strip() and "tool_calls" not in message:
            if not message.get("reasoning_content", "").strip():
                raise RecordError(source, f"{where}.content", "is empty; an assistant turn needs content or tool_calls")
        messages.append(message)
    return messages


def _sharegpt(record: dict, source: str) -> Conversation:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RecordError(source, "conversations", f"is {_kind(turns)}; expected a non-empty list of turns")
    messages: list[dict] = []
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(source, where, f"is {_kind(turn)}; expected an object")
        speaker = _string(turn, "from", source, f"{where}.from")
        if speaker not in SHAREGPT_ROLES:
            raise RecordError(source, f"{where}.from", f"is {speaker!r}; expected one of {'/'.join(SHAREGPT_ROLES)}")
        value = _string(turn, "value", source, f"{where}.value")
        if speaker == "function_call":
            calls = _parse_json_string(value, source, f"{where}.value")
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    messages = _with_system(record, source, normalize_messages(messages, source, "conversations"))
    return Conversation(messages, normalize_tools(record.get("tools"), source))


def _turns(value: Any, role: str, source: str, field: str) -> list[dict]:
    if isinstance(value, list):
        return normalize_messages(value, source, field)
    if value is None:
        raise RecordError(source, field, "is missing")
    if not isinstance(value, str):
        raise RecordError(source, field, f"is {_kind(value)}; expected a string or a list of messages")
    return normalize_messages([{"role": role, "content": value}], source, field)


def _with_system(record: dict, source: str, messages: list[dict]) -> list[dict]:
    system = _string(record, "system", source, "system", required=False)
    return ([{"role": "system", "content": system}] if system else []) + messages


def _prompt_completion(record: dict, source: str) -> Conversation:
    messages = _turns(record.get("prompt"), "user", source, "prompt")
    messages += _turns(record.get("completion"), "assistant", source, "completion")
    messages = _with_system(record, source, messages)
    return Conversation(messages, normalize_tools(record.get("tools"), source))


def _alpaca(record: dict, source: str) -> Conversation:
    instruction = _string(record, "instruction", source, "instruction")
    extra = _string(record, "input", source, "input", required=False)
    output = _string(record, "output", source, "output")
    if not output.strip():
        raise RecordError(source, "output", "is empty; an assistant turn needs content")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return Conversation(_with_system(record, source, messages))


def _text_spans(record: dict, source: str, text_field: str, spans_field: str, text_spans: str) -> TextWithSpans:
    text = _string(record, text_field, source, text_field)
    raw = record.get(spans_field)
    spans: list[tuple[int, int]] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise RecordError(source, spans_field, f"is {_kind(raw)}; expected a list of [start, end) pairs")
        for i, pair in enumerate(raw):
            ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(type(x) is int for x in pair)
            if not ok or not 0 <= pair[0] <= pair[1] <= len(text):
                expected = f"expected [start, end) with 0 <= start <= end <= {len(text)}"
                raise RecordError(source, f"{spans_field}[{i}]", f"is {pair!r}; {expected}")
            if pair[1] > pair[0]:
                spans.append((pair[0], pair[1]))
    merged = merge_spans(spans)
    if text_spans == "exclude":
        merged = complement_spans(merged, len(text))
    return TextWithSpans(text, merged)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort half-open spans and merge overlapping or touching ones; drop empty ones."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def complement_spans(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for start, end in spans:
        if start > pos:
            out.append((pos, start))
        pos = end
    if pos < length:
        out.append((pos, length))
    return out


def normalize_record(
    record: Any,
    fmt: str,
    source: str,
    *,
    text_field: str = "text",
    spans_field: str = "spans",
    text_spans: str = "train",
) -> Conversation | TextWithSpans:
    """Normalise one raw record of format `fmt`; raise `RecordError` naming the source and the bad field."""
    if not isinstance(record, dict):
        raise RecordError(source, "record", f"is {_kind(record)}; expected an object")
    if fmt == "messages":
        messages = normalize_messages(record.get("messages"), source)
        return Conversation(messages, normalize_tools(record.get("tools"), source))
    if fmt == "sharegpt":
        return _sharegpt(record, source)
    if fmt == "prompt_completion":
        return _prompt_completion(record, source)
    if fmt == "alpaca":
        return _alpaca(record, source)
    if fmt == "text_spans":
        return _text_spans(record, source, text_field, spans_field, text_spans)
    raise ValueError(f"format: {fmt!r} is not one of {'/'.join(FORMATS)}")
