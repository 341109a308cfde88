"""render: sources, mask policies, error paths, rejects and the rendered shard."""

from __future__ import annotations

import json
import re

import pydantic
import pytest

from sftflow.tasks.data.chat_template import ChatTemplate, load_template
from sftflow.tasks.data.formats import RecordError
from sftflow.tasks.data.render import (
    RenderConfig,
    TemplateProblem,
    iter_source_records,
    read_rendered_shard,
    render_record,
    render_source,
)

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
# A ChatML template with no generation tags, like most stock templates.
PLAIN_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_render_record_generation_policy():
    doc = render_record(GOOD, load_template("chatml"), RenderConfig(), "mem:1")
    assert doc.text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    assert [doc.text[s:e] for s, e in doc.train_char_spans] == ["Hello!<|im_end|>"]
    assert doc.source == "mem:1"


def test_render_record_text_spans_needs_no_template():
    doc = render_record({"text": "Q: 1+1? A: 2", "spans": [[10, 12]]}, None, RenderConfig(), "t:1")
    assert doc.train_char_spans == ((10, 12),)


def test_template_without_generation_tag_explains_the_fix():
    with pytest.raises(TemplateProblem, match=r"\{% generation %\}.*mask_policy='roles'"):
        render_record(GOOD, ChatTemplate(PLAIN_CHATML), RenderConfig(), "mem:1")


def _roles_check(template: ChatTemplate):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    doc = render_record({"messages": messages}, template, RenderConfig(mask_policy="roles"), "mem:1")
    assert [doc.text[s:e] for s, e in doc.train_char_spans] == ["A1<|im_end|>\n", "A2<|im_end|>\n"]
    users = RenderConfig(mask_policy="roles", train_roles=("user", "assistant"))
    doc = render_record({"messages": messages}, template, users, "mem:1")
    assert [doc.text[s:e] for s, e in doc.train_char_spans][:2] == [
        "<|im_start|>user\nQ1<|im_end|>\n",
        "A1<|im_end|>\n",
    ]


def test_roles_policy_on_tiny_template():
    _roles_check(ChatTemplate(PLAIN_CHATML))


def test_roles_policy_on_smollm2_template(shared_data):
    path = shared_data / "templates/smollm2-trl-chatml.jinja"
    if not path.exists():
        pytest.skip("smollm2 template absent")
    _roles_check(load_template(str(path)))


def test_roles_policy_rejects_prefix_unstable_template():
    # Marks the last message, so rendering a prefix is not a prefix of rendering the whole conversation.
    unstable = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(RecordError, match=r"mem:1: template is not prefix-stable: rendering messages\[:1\]"):
        render_record(GOOD, ChatTemplate(unstable), RenderConfig(mask_policy="roles"), "mem:1")


def test_assistant_turn_empty_after_rendering():
    # The template drops the letters x from content, so "xxx" renders to nothing inside the generation block.
    source = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] | replace('x', '') }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "xxx"}]}
    with pytest.raises(RecordError, match="mem:1: messages has an assistant turn .* empty after rendering"):
        render_record(record, ChatTemplate(source), RenderConfig(), "mem:1")
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] | replace('x', '') }}{% endfor %}")
    with pytest.raises(RecordError, match=r"mem:1: messages\[1\] is a 'assistant' turn that is empty after rendering"):
        render_record(record, plain, RenderConfig(mask_policy="roles"), "mem:1")


def test_hostile_template_is_a_template_problem_not_a_reject(tmp_path):
    src = _write_jsonl(tmp_path / "d.jsonl", [GOOD])
    hostile = ChatTemplate("{% generation %}{{ ''.__class__.__mro__ }}{% endgeneration %}")
    with pytest.raises(TemplateProblem, match="unsafe"):
        render_source(src, tmp_path / "out.jsonl", RenderConfig(on_bad_record="reject"), hostile)


def test_template_raise_exception_is_a_located_record_error():
    template = ChatTemplate("{% generation %}{{ raise_exception('System role not supported') }}{% endgeneration %}")
    with pytest.raises(RecordError, match="mem:3: template failed to render: TemplateError: System role not supported"):
        render_record(GOOD, template, RenderConfig(), "mem:3")


BAD_LINES = [
    GOOD,
    '{"messages": [oops',
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assitant", "content": "x"}]},
    {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
    GOOD,
]
EXPECTED_ERRORS = [
    (2, "line", "line is not valid JSON"),
    (3, "messages[1].role", "messages[1].role is 'assitant'; expected one of system/user/assistant/tool"),
    (4, "messages[0].content", "messages[0].content is missing"),
    (5, "messages[0].content[0]", "messages[0].content[0] is a str; expected a content part"),
    (6, "messages[1].content", "messages[1].content is empty"),
]


def test_a_broken_json_line_names_the_column_python_reads_on_that_line(tmp_path):
    """An error at a line's end is at that line's last column, not "column 1" of the line after it."""
    src = tmp_path / "data.jsonl"
    truncated = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}'
    src.write_text(json.dumps(GOOD) + "\n" + truncated + "\n")
    with pytest.raises(ValueError) as info:
        render_source(src, tmp_path / "out.jsonl", RenderConfig(template="chatml"), load_template("chatml"))
    with pytest.raises(json.JSONDecodeError) as python:
        json.loads(truncated)
    assert python.value.colno == len(truncated) + 1
    assert f"{src}:2: line is not valid JSON (Expecting ',' delimiter at column {len(truncated) + 1})" in str(
        info.value
    )


@pytest.mark.parametrize("bad", range(len(EXPECTED_ERRORS)))
def test_error_mode_raises_located_value_error(tmp_path, bad):
    line, _, message = EXPECTED_ERRORS[bad]
    src = _write_jsonl(tmp_path / "data.jsonl", [GOOD, BAD_LINES[line - 1]])
    with pytest.raises(ValueError) as info:
        render_source(src, tmp_path / "out.jsonl", RenderConfig(template="chatml"), load_template("chatml"))
    assert str(info.value).startswith(f"{src}:2: {message}")
    assert not (tmp_path / "out.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]  # no temporary file left behind


def test_reject_mode_counts_and_writes_rejects(tmp_path):
    src = _write_jsonl(tmp_path / "data.jsonl", BAD_LINES)
    stats = render_source(src, tmp_path / "out.jsonl", RenderConfig(on_bad_record="reject"), load_template("chatml"))
    assert (stats.records, stats.rendered, stats.rejected) == (7, 2, 5)
    assert stats.rejects_by_field == {"line": 1, "messages": 4}
    assert stats.format == "messages"
    rejects = [json.loads(line) for line in open(stats.rejects_path)]
    assert [(r["source"], r["field"]) for r in rejects] == [(f"{src}:{n}", f) for n, f, _ in EXPECTED_ERRORS]
    docs = read_rendered_shard(stats.out_path)
    assert [d.source for d in docs] == [f"{src}:1", f"{src}:7"]
    assert docs[0].text[slice(*docs[0].train_char_spans[0])] == "Hello!<|im_end|>"


def test_autodetect_skips_leading_bad_line_and_unknown_format_fails(tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", ["{bad", {"instruction": "Add 1 2", "output": "3"}])
    stats = render_source(src, tmp_path / "o.jsonl", RenderConfig(on_bad_record="reject"), load_template("chatml"))
    assert (stats.format, stats.rendered, stats.rejected) == ("alpaca", 1, 1)
    src = _write_jsonl(tmp_path / "b.jsonl", [{"question": "?"}])
    with pytest.raises(ValueError, match=r"b.jsonl:1: record has keys \['question'\]; cannot tell the format"):
        render_source(src, tmp_path / "o.jsonl", RenderConfig(on_bad_record="reject"), load_template("chatml"))


def test_json_array_parquet_and_datasets_sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD, {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    expected = [r["messages"][1]["content"] + "<|im_end|>" for r in rows]
    for name, sources in [
        ("d.json", ["d.json:record 1", "d.json:record 2"]),
        ("d.parquet", ["d.parquet:record 1", "d.parquet:record 2"]),
        ("ds", ["ds:record 1", "ds:record 2"]),
        ("dd", ["dd[train]:record 1", "dd[train]:record 2"]),
    ]:
        stats = render_source(tmp_path / name, tmp_path / f"{name}.out.jsonl", RenderConfig(), load_template("chatml"))
        docs = read_rendered_shard(stats.out_path)
        assert [d.source for d in docs] == [str(tmp_path / s) for s in sources], name
        assert [d.text[slice(*d.train_char_spans[0])] for d in docs] == expected, name


@pytest.mark.parametrize("kind", ["d.json", "d.parquet", "ds"])
def test_bad_records_of_arrays_and_tables_are_located_from_record_1(tmp_path, kind):
    """The third record is `record 3` in the error and in the rejects file, as line 3 of a JSONL file would be."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [GOOD, GOOD, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}]
    path = tmp_path / kind
    if kind == "d.json":
        path.write_text(json.dumps(rows))
    elif kind == "d.parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:record 3: messages\[1\].content is empty"):
        render_source(path, tmp_path / "o.jsonl", RenderConfig(), load_template("chatml"))
    stats = render_source(path, tmp_path / "o.jsonl", RenderConfig(on_bad_record="reject"), load_template("chatml"))
    [reject] = [json.loads(line) for line in open(stats.rejects_path)]
    assert (reject["source"], reject["field"]) == (f"{path}:record 3", "messages[1].content")


def test_parquet_null_optional_fields_are_dropped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"messages": [{"role": "user", "content": "Hi", "name": "bob"}, {"role": "assistant", "content": "Yo"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")  # the assistant row gets name=None
    [(source, record)] = list(iter_source_records(tmp_path / "d.parquet"))
    assert record["messages"][1]["name"] is None
    doc = render_record(record, load_template("chatml"), RenderConfig(), source)
    assert doc.text.endswith("<|im_start|>assistant\nYo<|im_end|>\n")


def test_missing_source_and_bad_json_array(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_source_records(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.json").write_text('[{"a": 1},\n {oops}]')
    with pytest.raises(ValueError, match=r"bad.json:2:3: not valid JSON"):
        list(iter_source_records(tmp_path / "bad.json"))


def test_render_config_validation_names_the_field():
    with pytest.raises(pydantic.ValidationError, match="mask_policy"):
        RenderConfig(mask_policy="everything")
    with pytest.raises(pydantic.ValidationError, match="train_roles"):
        RenderConfig(train_roles=())
    with pytest.raises(pydantic.ValidationError, match="on_bad_record"):
        RenderConfig(on_bad_record="ignore")
    with pytest.raises(pydantic.ValidationError, match="formt"):
        RenderConfig(formt="messages")


def test_glaive_renders_with_tool_calls_trained(shared_data, tmp_path):
    path = shared_data / "datasets/glaive-toolcall-en-demo/glaive_toolcall_en_demo.json"
    if not path.exists():
        pytest.skip("glaive dataset absent")
    stats = render_source(path, tmp_path / "g.jsonl", RenderConfig(), load_template("chatml"))
    assert (stats.format, stats.records, stats.rendered) == ("sharegpt", 300, 300)
    docs = read_rendered_shard(stats.out_path)
    trained = [d.text[s:e] for d in docs for s, e in d.train_char_spans]
    assert any(t.startswith('<tool_call>{"name": ') for t in trained)
    assert all(t.endswith("<|im_end|>") for t in trained)
    assert all("<tools>" in d.text for d in docs if "<tool_call>" in d.text)
