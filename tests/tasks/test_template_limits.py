"""Templates are untrusted code and records untrusted data: each way one of them used to burn CPU or memory without
limit (or crash the run) is now a located error, or a counted reject for a bad record under `on_bad_record: reject`."""

from __future__ import annotations

import json
import threading
import time

import pytest

from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.data.render import RenderConfig, TemplateProblem, render_record, render_source
from sftflow.tasks.data.template_limits import RenderLimitError, RenderLimits

RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TAGGED = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"


def _render(body: str, **limits) -> str:
    template = ChatTemplate(body + TAGGED, name="hostile.jinja")
    config = RenderConfig(**limits)
    return render_record(RECORD, template, config, source="data.jsonl:7").text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than 1 s"),
        ("{{ lipsum(n=10**7) }}", "lipsum(n=10000000"),
        ("{{ 'x' * 10**10 }}", "'*' would make a sequence of 10000000000"),
        ("{{ 7 ** (10 ** 9) }}", "'**' would make an integer"),
        ("{{ 'x' | center(10**10) }}", "width=10000000000 is over the output budget"),
        ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "output passed 1000000 characters"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
        ("{% for i in range(10**9) %}{% endfor %}", "range"),
    ],
)
def test_a_template_over_its_limits_is_stopped_and_named(body, message):
    started = time.monotonic()
    with pytest.raises(TemplateProblem, match="data.jsonl:7: chat template hostile.jinja was stopped") as err:
        _render(body, max_render_seconds=1.0, max_output_chars=1_000_000)
    assert message in str(err.value)
    assert time.monotonic() - started < 15  # the time budget, not the template, decides


def test_a_stopped_render_leaves_nothing_behind_on_its_thread():
    """The timeout is raised inside the rendering thread; once it is caught, later renders there run normally."""
    loop = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    for _ in range(3):
        with pytest.raises(RenderLimitError):
            loop.render(RECORD["messages"], limits=RenderLimits(seconds=0.2))
        assert _render("") == "hihello"
    time.sleep(0.3)  # past any deadline: nothing fires late
    assert _render("") == "hihello"


def test_limits_hold_on_worker_threads_too():
    """Renders run on a task runner's threads, where signals cannot interrupt them."""
    errors = []

    def work():
        try:
            _render(
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                max_render_seconds=0.5,
            )
        except TemplateProblem as err:
            errors.append(str(err))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 3 and all("ran longer than 0.5 s" in e for e in errors)


def test_records_too_large_or_too_deep_are_rejected_under_reject_and_located_errors_otherwise(tmp_path):
    source = tmp_path / "data.jsonl"
    deep = '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"
    nested = {"messages": RECORD["messages"], "meta": json.loads("[" * 150 + "]" * 150)}
    big = {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "ok"}]}
    lines = [json.dumps(RECORD), deep, json.dumps(nested), json.dumps(big), json.dumps(RECORD)]
    source.write_text("\n".join(lines) + "\n")
    template = ChatTemplate(TAGGED, name="t")
    config = RenderConfig(format="messages", on_bad_record="reject", max_record_bytes=4096)
    stats = render_source(source, tmp_path / "out.jsonl", config, template)
    assert (stats.records, stats.rendered, stats.rejected) == (5, 2, 3)
    rejects = [json.loads(line) for line in (tmp_path / "out.jsonl.rejects.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{source}:{n}" for n in (2, 3, 4)]
    assert "over render.max_record_bytes=4096" in rejects[0]["reason"]  # the 400k-byte line, never parsed
    assert "nests deeper than render.max_nesting=100" in rejects[1]["reason"]
    assert "over render.max_record_bytes=4096" in rejects[2]["reason"]

    deep_only = tmp_path / "deep.jsonl"
    deep_only.write_text(deep + "\n")
    with pytest.raises(ValueError, match=rf"{deep_only}:1: line is JSON nested too deeply to parse"):
        render_source(deep_only, tmp_path / "x.jsonl", RenderConfig(format="messages"), template)
