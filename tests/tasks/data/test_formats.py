"""Record formats normalised to messages, and the errors for bad records."""

from __future__ import annotations

import json

import pytest

from sftflow.tasks.data.formats import (
    Conversation,
    RecordError,
    TextWithSpans,
    detect_format,
    normalize_record,
)


@pytest.mark.parametrize(
    "record, fmt",
    [
        ({"messages": []}, "messages"),
        ({"conversations": []}, "sharegpt"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"instruction": "a", "input": "", "output": "b"}, "alpaca"),
        ({"text": "abc", "spans": []}, "text_spans"),
        ({"foo": 1}, None),
        ([1, 2], None),
    ],
)
def test_detect_format(record, fmt):
    assert detect_format(record) == fmt


def test_messages_keep_tools_names_reasoning_and_drop_none():
    record = {
        "messages": [
            {"role": "system", "content": "S", "name": None},
            {"role": "user", "content": "U", "name": "alice"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [{"name": "f", "parameters": {}}],
    }
    conv = normalize_record(record, "messages", "d.jsonl:1")
    assert isinstance(conv, Conversation)
    assert conv.messages[0] == {"role": "system", "content": "S"}
    assert conv.messages[1]["name"] == "alice"
    assert conv.messages[2]["content"] == ""
    assert conv.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert conv.messages[3]["tool_call_id"] == "c1"
    assert conv.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def test_text_content_parts_are_joined_like_a_string():
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    record = {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        ]
    }
    as_parts = normalize_record(record, "messages", "d.jsonl:1")
    as_strings = normalize_record(
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        "messages",
        "d.jsonl:1",
    )
    assert as_parts.messages == as_strings.messages
    assert record["messages"][0]["content"] is parts  # the caller's record is not modified


def test_sharegpt_with_function_call_observation_and_tools_string():
    record = {
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp": 21}'},
            {"from": "gpt", "value": "21 °C."},
        ],
        "tools": '[{"name": "get_weather", "description": "d", "parameters": {"type": "object"}}]',
        "system": "Be brief.",
    }
    conv = normalize_record(record, "sharegpt", "g.json:record 1")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = conv.messages[2]["tool_calls"][0]
    assert call == {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert conv.tools[0]["function"]["name"] == "get_weather"


def test_glaive_records_normalise(shared_data):
    path = shared_data / "datasets/glaive-toolcall-en-demo/glaive_toolcall_en_demo.json"
    if not path.exists():
        pytest.skip("glaive dataset absent")
    records = json.loads(path.read_text())
    convs = [normalize_record(r, "sharegpt", f"glaive:{i}") for i, r in enumerate(records)]
    calls = [m for c in convs for m in c.messages if "tool_calls" in m]
    assert calls and all(isinstance(m["tool_calls"][0]["function"]["arguments"], dict) for m in calls)
    assert any(m["role"] == "tool" for c in convs for m in c.messages)


def test_prompt_completion_strings_and_lists():
    conv = normalize_record({"prompt": "Q", "completion": "A", "system": "S"}, "prompt_completion", "p:1")
    assert conv.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    conv = normalize_record(
        {"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]},
        "prompt_completion",
        "p:2",
    )
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]


def test_alpaca():
    conv = normalize_record({"instruction": "Add", "input": "1 2", "output": "3"}, "alpaca", "a:0")
    assert conv.messages == [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    conv = normalize_record({"instruction": "Hi", "input": "", "output": "Hello"}, "alpaca", "a:1")
    assert conv.messages[0]["content"] == "Hi"


def test_text_spans_train_and_exclude():
    record = {"text": "abcdefghij", "spans": [[6, 8], [1, 3], [2, 4], [9, 9]]}
    trained = normalize_record(record, "text_spans", "t:1")
    assert isinstance(trained, TextWithSpans) and trained.train_char_spans == [(1, 4), (6, 8)]
    excluded = normalize_record(record, "text_spans", "t:1", text_spans="exclude")
    assert excluded.train_char_spans == [(0, 1), (4, 6), (8, 10)]
    custom = normalize_record(
        {"body": "xyz", "mask": [[0, 1]]}, "text_spans", "t:2", text_field="body", spans_field="mask"
    )
    assert custom.train_char_spans == [(0, 1)]


@pytest.mark.parametrize(
    "fmt, record, field, message",
    [
        (
            "messages",
            {"messages": [{"role": "assitant", "content": "x"}]},
            "messages[0].role",
            "is 'assitant'; expected one of system/user/assistant/tool",
        ),
        ("messages", {"messages": [{"content": "x"}]}, "messages[0].role", "is missing"),
        ("messages", {"messages": [{"role": "user"}]}, "messages[0].content", "is missing"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "is 'image_url'; only text parts can be rendered",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
            "is an int; expected a string",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
            "is an int; expected a string",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
            "messages[1].content",
            "is empty",
        ),
        ("messages", {"messages": []}, "messages", "is empty"),
        (
            "messages",
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
            "messages[0].tool_calls[0].function.name",
            "is missing",
        ),
        ("sharegpt", {"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0].from", "is 'robot'"),
        ("sharegpt", {"conversations": [{"from": "human", "value": None}]}, "conversations[0].value", "is missing"),
        (
            "sharegpt",
            {"conversations": [{"from": "function_call", "value": "{oops"}]},
            "conversations[0].value",
            "is not valid JSON",
        ),
        (
            "sharegpt",
            {"conversations": [{"from": "human", "value": "x"}], "tools": "[bad"},
            "tools",
            "is not valid JSON",
        ),
        ("alpaca", {"instruction": "x", "output": 5}, "output", "is an int; expected a string"),
        ("prompt_completion", {"prompt": "x", "completion": ""}, "completion[0].content", "is empty"),
        ("text_spans", {"text": "abc", "spans": [[2, 9]]}, "spans[0]", "is [2, 9]; expected [start, end)"),
        ("text_spans", {"text": 7}, "text", "is an int"),
    ],
)
def test_bad_records_name_source_and_field(fmt, record, field, message):
    with pytest.raises(RecordError) as info:
        normalize_record(record, fmt, "data.jsonl:7")
    assert info.value.field == field
    assert str(info.value).startswith(f"data.jsonl:7: {field} {message}")
    assert info.value.as_reject() == {"source": "data.jsonl:7", "field": field, "reason": info.value.reason}
