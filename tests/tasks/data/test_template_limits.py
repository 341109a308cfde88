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
        ("{{ 'x' * 10**10 }}", "'*' of a str by 10000000000 would make about 10000000000 characters"),
        ("{{ 7 ** (10 ** 9) }}", "'**' would make an integer of about 2807354922 bits"),
        ("{{ 'x' | center(10**10) }}", "filter center would make about 10000000000 characters"),
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


DOUBLING = "{% set ns = namespace(v=SEED) %}{% for i in range(36) %}{% set ns.v = ns.v OP ns.v %}{% endfor %}{{ ns.v }}"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{{ 7 ** (10 ** 9) }}", "'**' would make an integer of about 2807354922 bits, over 65536"),
        ("{{ (2 ** 60000) * (2 ** 60000) }}", "'*' would make an integer of about 120002 bits"),
        (DOUBLING.replace("SEED", "'x'").replace("OP", "~"), "'~' would make about 1048576 characters"),
        (DOUBLING.replace("SEED", "'x'").replace("OP", "+"), "'+' would make about 1048576 characters"),
        (DOUBLING.replace("SEED", "['x']").replace("OP", "+"), "'+' would make about"),
        ("{{ [('x' * 900000)] * 1000 }}", "'*' of a list by 1000 would make about 900004000 characters"),
        ("{{ 'x'.ljust(10**10) }}", "str.ljust() would make about 10000000000 characters"),
        ("{{ (1).to_bytes(10**10, 'big') }}", "int.to_bytes() would make about 10000000000 characters"),
        ("{{ ('\t' * 1000).expandtabs(100000) }}", "str.expandtabs() would make about 100001000 characters"),
        ("{{ '{:>1000000000}'.format('x') }}", "str.format() would make about 1000000015 characters"),
        ("{{ '{:{}}'.format('x', 10**9) }}", "str.format() would make"),
        ("{{ '%*d' % (10**9, 1) }}", "'%' formatting would make"),
        ("{{ '%1000000000s' | format('x') }}", "filter format would make about 1000000013 characters"),
        ("{{ '-'.join(['x' * 999000, 'y' * 999000]) }}", "str.join() would make about 1998008 characters"),
        ("{{ ['x' * 600000, 'y' * 600000] | join }}", "filter join would make about 1200006 characters"),
        ("{{ ('x' * 1001) | replace('x', 'y' * 1000) }}", "filter replace would make about 1001000 characters"),
        ("{{ ('\n' * 1000) | indent(1000000) }}", "filter indent would make about 1001001000 characters"),
        ("{{ [1] | batch(10**8, 'x') | list }}", "filter batch would make about 500000005 characters"),
        ("{{ [1] | slice(10**8) | list }}", "filter slice would make about 400000005 characters"),
        ("{{ ([[0]] * 1000) | sum(start=[]) }}", "filter sum would make"),
        ("{{ ['x' * 1000] | tojson(indent=1000000) }}", "filter tojson would make about 1000005 characters"),
        ("{{ dict.fromkeys(range(100000), 'x' * 1000) }}", "calling fromkeys would make"),
        ("{% set b %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}", "a block's text would"),
        ("{% macro f() %}{% for i in range(2000) %}{{ 'x' * 999 }}{% endfor %}{% endmacro %}{{ f() }}", "a block"),
    ],
)
def test_an_operation_that_would_grow_past_the_budget_is_refused_before_it_runs(body, message):
    """Each of these is one C call (or builds its value in one): it is sized from its operands and refused, long
    before the time limit could stop it (60 s here, so a stop by time would name time instead)."""
    with pytest.raises(TemplateProblem, match="data.jsonl:7: chat template hostile.jinja was stopped") as err:
        _render(body, max_render_seconds=60.0, max_output_chars=1_000_000)
    assert message in str(err.value)
    assert "over the output budget of 1000000" in str(err.value) or "bits, over 65536" in str(err.value)


def test_operations_within_the_budget_render_as_jinja_renders_them():
    body = (
        "{{ 2 ** 100 }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ [2] }} {{ '%s-%03d' % ('x', 7) }} "
        "{{ '{}:{:>4}'.format('k', 'v') }} {{ ['a', 'b'] | join(',') }} {{ 'aXa' | replace('a', 'bb') }} "
        "{{ 'x'.ljust(3, '.') }} {{ [1, 2, 3] | batch(2, 0) | list }} {{ {'k': [1]} | tojson(indent=1) }} "
    )
    assert _render(body) == (
        "1267650600228229401496703205376 ababab [1, 2] a1[2] x-007 k:   v a,b bbXbb x.. [[1, 2], [3, 0]] "
        '{\n "k": [\n  1\n ]\n} hihello'
    )


_SIGTERM_CHILD = """
import signal, sys, threading, time
from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.data.template_limits import RenderLimits

signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a Python handler, as a Prefect run installs one
def render():
    try:
        ChatTemplate("{{ 7 ** (10 ** 9) }}").render([], limits=RenderLimits(seconds=600))
    except Exception as err:
        print(err, flush=True)
print("rendering", flush=True)
threading.Thread(target=render, daemon=True).start()
while True:
    time.sleep(0.05)
"""


def test_with_default_limits_a_huge_power_is_refused_and_sigterm_ends_the_process():
    """A power computed in one C call would hold the GIL for minutes, so a SIGTERM handler (run by the main thread)
    would wait for it; sized first, it is refused, and SIGTERM ends the process."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _SIGTERM_CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "rendering\n"
    time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143
    assert "'**' would make an integer of about 2807354922 bits" in out


def test_a_lone_surrogate_is_a_located_reject_or_error_naming_its_field(tmp_path):
    """JSON may escape half a UTF-16 pair; Python reads it, and writing the rendered text used to fail the stage."""
    source = tmp_path / "data.jsonl"
    bad = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "lone \\ud800"}]}'
    paired = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}]}'
    source.write_text("\n".join([json.dumps(RECORD), bad, paired]) + "\n")
    template = ChatTemplate(TAGGED, name="t")
    stats = render_source(source, tmp_path / "out.jsonl", RenderConfig(on_bad_record="reject"), template)
    assert (stats.records, stats.rendered, stats.rejected, stats.rejects_by_field) == (3, 2, 1, {"messages": 1})
    (reject,) = [json.loads(line) for line in (tmp_path / "out.jsonl.rejects.jsonl").read_text().splitlines()]
    assert reject["source"] == f"{source}:2" and reject["field"] == "messages[1].content"
    assert "lone surrogate ('\\ud800' at character 5)" in reject["reason"]
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[1])["text"] == "\U0001f600ok"

    with pytest.raises(ValueError, match=rf"^{source}:2: messages\[1\].content holds a lone surrogate"):
        render_source(source, tmp_path / "x.jsonl", RenderConfig(), template)

    array = tmp_path / "data.json"
    array.write_text(f"[{json.dumps(RECORD)}, {bad}]")
    with pytest.raises(ValueError, match=rf"^{array}:record 2: messages\[1\].content holds a lone surrogate"):
        render_source(array, tmp_path / "y.jsonl", RenderConfig(), template)


def test_a_number_python_cannot_parse_is_a_located_reject(tmp_path):
    source = tmp_path / "data.jsonl"
    source.write_text(json.dumps(RECORD)[:-1] + ', "n": ' + "9" * 5000 + "}\n")
    stats = render_source(source, tmp_path / "out.jsonl", RenderConfig(on_bad_record="reject"), ChatTemplate(TAGGED))
    assert (stats.records, stats.rejected, stats.rejects_by_field) == (1, 1, {"line": 1})


def test_the_default_limits_keep_one_rendered_text_within_what_the_tokenizer_takes_in_one_call():
    """A 60 MB record aborted the tokenizer at 7.9 GB of RSS; a record under the default limit renders (within the
    default budget) to at most one tokenizer batch of text."""
    from sftflow.tasks.data.spans import BATCH_CHARS

    config = RenderConfig()
    assert config.max_record_bytes == 8 * 2**20
    limits = RenderLimits(output_chars=config.max_output_chars)
    assert limits.output_budget(config.max_record_bytes) <= BATCH_CHARS


def test_a_stage_that_ends_stops_its_renders_before_its_runner_waits_for_them():
    """SIGTERM reaches a Prefect flow as `TerminationSignal` in the main thread; the task runner's exit then waits for
    its threads, so a render with a long time budget (and every later one on those threads) kept the process alive
    for minutes after SIGTERM. Here the body raises as the signal would, with a render of 600 s running."""
    from concurrent.futures import ThreadPoolExecutor

    from sftflow.tasks.data.template_limits import renders_stopped_on_error

    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = threading.Event()

    def render_two():
        started.set()
        for _ in range(2):
            try:
                _render(slow, max_render_seconds=600.0)
            except TemplateProblem as err:
                outcomes.append(str(err))

    outcomes: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with renders_stopped_on_error(ThreadPoolExecutor(1)) as pool:
            pool.submit(render_two)
            started.wait()
            time.sleep(0.2)
            raise KeyboardInterrupt
    assert len(outcomes) == 2 and all("the stage is ending (SIGTERM" in o for o in outcomes)
    assert _render("") == "hihello"  # renders are allowed again once the runner is done
