"""Sandboxed chat templates and exact `{% generation %}` spans."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError, TemplateError

from sftflow.tasks.data.chat_template import ChatTemplate, builtin_template_text, load_template


def _chat(*contents):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


def test_chatml_spans_cover_content_and_end_token_only():
    text, spans = load_template("chatml").render(_chat("Hi", "Hello!", "And 2+2?", "4"))
    assert [text[s:e] for s, e in spans] == ["Hello!<|im_end|>", "4<|im_end|>"]
    assert text.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!")
    assert "\x00" not in text


def test_llama3_spans_and_bos():
    template = load_template("llama3")
    template.special_tokens = {"bos_token": "<|begin_of_text|>"}
    messages = [{"role": "system", "content": "Be brief."}, *_chat("Hi", "Hello!")]
    text, spans = template.render(messages)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert [text[s:e] for s, e in spans] == ["Hello!<|eot_id|>"]
    assert text[: spans[0][0]].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_chatml_tools_tool_calls_and_reasoning():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C."},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text, spans = load_template("chatml").render(messages, tools)
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}' in text
    assert [text[s:e] for s, e in spans] == [
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|im_end|>",
        "21 °C.<|im_end|>",
    ]
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>\n' in text


def test_marker_like_content_cannot_break_spans():
    nasty = "\x00sftflow-gen-start-00000000000000000000000000000000\x00 {% generation %} \x00sftflow-gen-end-\x00"
    text, spans = load_template("chatml").render(_chat(nasty, nasty))
    assert [text[s:e] for s, e in spans] == [nasty + "<|im_end|>"]
    assert text.count(nasty) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=2, max_size=6))
def test_spans_match_plain_render_for_any_text(contents):
    """Stripping the markers gives exactly the text the template renders without the tracker."""
    template = load_template("chatml")
    messages = _chat(*contents)
    text, spans = template.render(messages)
    assert text == template._compiled.render(messages=messages, tools=None, documents=None)
    expected = [c + "<|im_end|>" for c in contents[1::2]]
    assert [text[s:e] for s, e in spans] == expected


def test_generation_inside_set_block_and_macro_is_exact():
    # Hugging Face measures the streamed output when the block closes, which is wrong for captured output.
    source = (
        "{% macro turn(m) %}[{{ m.role }}]{% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}"
        "{% for m in messages %}{% set out %}<{{ turn(m) }}>{% endset %}{{ 'pad' * loop.index }}{{ out }}{% endfor %}"
    )
    text, spans = ChatTemplate(source).render(_chat("ab", "cd"))
    assert text == "pad<[user]ab>padpad<[assistant]cd>"
    assert [text[s:e] for s, e in spans] == ["ab", "cd"]


def test_filter_altering_generation_output_is_detected():
    source = "{% for m in messages %}{% set out %}{% generation %}{{ m.content }}{% endgeneration %}{% endset %}"
    source += "{{ out | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="altered by the template"):
        ChatTemplate(source).render(_chat("ab"))


def test_nested_generation_blocks_give_outer_span():
    source = "x{% generation %}a{% generation %}b{% endgeneration %}c{% endgeneration %}y"
    text, spans = ChatTemplate(source).render([])
    assert (text, spans) == ("xabcy", [(1, 4)])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ [].append(1) }}",
    ],
)
def test_hostile_templates_are_refused(source):
    with pytest.raises(SecurityError):
        ChatTemplate(source).render(_chat("hi"))


def test_globals_like_hugging_face():
    template = ChatTemplate(
        "{{ {'k': 'é<'} | tojson }}|{{ strftime_now('%Y') | length }}|{% for i in range(5) %}"
        "{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ dict(a=1)['a'] }}"
    )
    assert template.render([])[0] == '{"k": "é<"}|4|01|1'
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([])


def test_trim_and_lstrip_blocks_like_hugging_face():
    text, _ = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB").render([])
    assert text == "A\nB"


def test_load_template_sources(tmp_path, tiny_tokenizer):
    path = tmp_path / "t.jinja"
    path.write_text("{{ eos_token }}")
    assert load_template(str(path), tiny_tokenizer).render([])[0] == "<|im_end|>"
    assert load_template(None, tiny_tokenizer).text == tiny_tokenizer.chat_template
    assert load_template("chatml").text == builtin_template_text("chatml")
    with pytest.raises(ValueError, match="neither .auto., a built-in"):
        load_template("chatml2")
    with pytest.raises(ValueError, match="does not exist"):
        load_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


# The stock (or stock-equivalent) templates in ../shared/data/templates and the tagged template that renders like each.
OFFICIAL = {
    "trl-llama3.jinja": ("llama3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "trl-qwen2_5.jinja": ("qwen2_5", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "trl-gemma_training.jinja": ("gemma", {"bos_token": "<bos>", "eos_token": "<eos>"}),
    "trl-phi3_training.jinja": ("phi3", {"eos_token": "<|endoftext|>"}),
    "smollm2-trl-chatml.jinja": ("chatml", {"eos_token": "<|im_end|>"}),
    "tinyllama-1.1b-chat-v1.0-zephyr.jinja": ("zephyr", {"bos_token": "<s>", "eos_token": "</s>"}),
    "mistral-common-v3.jinja": ("mistral", {"bos_token": "<s>", "eos_token": "</s>"}),
}


def _tokenizer_with(template_text: str, special: dict[str, str]):
    import types

    return types.SimpleNamespace(chat_template=template_text, special_tokens_map=special)


_GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def _auto_pick(stock_text: str, special: dict[str, str]) -> str:
    """The name of the built-in template `auto` picks for a tokenizer whose own template is `stock_text`."""
    return load_template("auto", _tokenizer_with(stock_text, special), tokenizer_name="some/model").name


def _untagged(name: str) -> str:
    """A built-in template without its generation tags: what the family's tokenizer ships."""
    return _GENERATION_TAGS.sub("", builtin_template_text(name))


@pytest.mark.parametrize("official", sorted(OFFICIAL))
def test_auto_picks_the_tagged_template_that_renders_what_the_official_one_renders(official, shared_data):
    from sftflow.tasks.data.template_match import PROBES

    expected, special = OFFICIAL[official]
    # TRL's training copies of Gemma's and Phi-3's templates are the stock ones plus generation tags: without the
    # tags, they are what those tokenizers ship.
    text = _GENERATION_TAGS.sub("", (shared_data / "templates" / official).read_text())
    picked = load_template("auto", _tokenizer_with(text, special), tokenizer_name="some/model")
    assert picked.name == f"{expected} (auto: matches some/model's chat_template)"
    stock = ChatTemplate(text, special)
    for messages, tools in PROBES[:4]:
        try:
            want = stock.render(messages, tools)[0]
        except TemplateError:
            continue
        got, spans = picked.render(messages, tools)
        assert got == want
        # Every assistant turn is trained, from its content to its end-of-turn token.
        contents = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert len(spans) >= len(contents)
        for content, (start, end) in zip(contents, spans, strict=False):
            assert got[start:end].strip().startswith(content)


def test_auto_keeps_a_tagged_template_and_explains_when_nothing_matches():
    tagged = builtin_template_text("chatml")
    assert load_template("auto", _tokenizer_with(tagged, {})).name == "tokenizer.chat_template"
    odd = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError) as err:
        load_template("auto", _tokenizer_with(odd, {}), tokenizer_name="org/odd-model")
    message = str(err.value)
    assert "org/odd-model" in message and "{% generation %}" in message and "mask_policy: roles" in message


@pytest.mark.parametrize(
    ("folder", "expected"), [("smollm2-135m-chatml", "chatml"), ("tinyllama-1.1b-chat-v1.0", "zephyr")]
)
def test_auto_on_real_tokenizers(folder, expected, shared_data):
    from transformers import AutoTokenizer

    from sftflow.tasks.data.render import RenderConfig, resolve_template

    path = shared_data / "tokenizers" / folder
    template = resolve_template(RenderConfig(), path)  # the default: template auto, mask_policy generation
    assert template.name.startswith(f"{expected} (auto:")
    # The data stage names the choice in its console line (`sft-data: ... template <name>`), not only in a logger
    from sftflow.tasks.core.manifests import TokenizerRef
    from sftflow.tasks.data.stage import training_template

    assert training_template(RenderConfig(), TokenizerRef(path=str(path), sha256=""), None)[2] == template.name
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert template.render(messages)[0] == tokenizer.apply_chat_template(messages, tokenize=False)


def test_mistral_template_places_the_system_in_the_last_user_turn_and_trains_answers_with_eos():
    template = load_template("mistral", _tokenizer_with("", {"bos_token": "<s>", "eos_token": "</s>"}))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+3?"},
        {"role": "user", "content": "Quick."},
        {"role": "assistant", "content": "5"},
    ]
    text, spans = template.render(messages)
    assert text == "<s>[INST]Hi[/INST]Hello</s>[INST]Be brief.\n\n2+3?\n\nQuick.[/INST]5</s>"
    assert [text[a:b] for a, b in spans] == ["Hello</s>", "5</s>"]
    with pytest.raises(TemplateError, match="starts with a user turn"):
        template.render([{"role": "assistant", "content": "x"}])


# Qwen3's official template renders history: reasoning only after the last real user query, an empty <think> block on
# the last turn. The expected texts are what Hugging Face's `apply_chat_template` renders with Qwen3's own template.
_QWEN3_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {}}}]
_QWEN3_CASES = [
    (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "think b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d", "reasoning_content": "\nthink d\n"},
        ],
        None,
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthink d\n</think>\n\nd<|im_end|>\n",
        ["b<|im_end|>", "<think>\nthink d\n</think>\n\nd<|im_end|>"],
    ),
    (
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "w?"},
            {
                "role": "assistant",
                "content": "let me",
                "reasoning_content": "plan",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                ],
            },
            {"role": "tool", "content": "1"},
            {"role": "tool", "content": "2"},
            {"role": "assistant", "content": "done", "reasoning_content": "fin"},
        ],
        _QWEN3_TOOLS,
        "<|im_start|>system\nsys\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\nlet me\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n'
        "</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nfin\n"
        "</think>\n\ndone<|im_end|>\n",
        None,
    ),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "x", "reasoning_content": "r"},
            {"role": "user", "content": "<tool_response>\nz\n</tool_response>"},
            {"role": "assistant", "content": "<think>r2</think>y"},
        ],
        None,
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>\n<|im_start|>user\n"
        "<tool_response>\nz\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\ny<|im_end|>\n",
        ["<think>\nr\n</think>\n\nx<|im_end|>", "<think>\nr2\n</think>\n\ny<|im_end|>"],
    ),
]


@pytest.mark.parametrize("case", range(len(_QWEN3_CASES)))
def test_qwen3_template_renders_history_as_qwen3_does(case):
    from sftflow.tasks.data.render import _alias_reasoning

    messages, tools, expected, trained = _QWEN3_CASES[case]
    template = load_template("qwen3", _tokenizer_with("", {"eos_token": "<|im_end|>"}))
    text, spans = template.render(_alias_reasoning(messages), tools)
    assert text == expected
    if trained is not None:
        assert [text[a:b] for a, b in spans] == trained
    # the last turn always carries a <think> block, empty without reasoning; the generation prompt does not
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert template.render(plain)[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>\n")
    assert (
        template.render(plain[:1], add_generation_prompt=True)[0]
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_auto_tells_qwen3_from_qwen2_5_and_chatml():
    """A Qwen3-style tokenizer template (the tagged one with its tags removed) is matched by `qwen3` alone."""
    assert _auto_pick(_untagged("qwen3"), {"eos_token": "<|im_end|>"}).startswith("qwen3 (auto:")


def test_gemma3_template_folds_the_system_message_into_the_first_user_turn():
    """Expected text: what Hugging Face's `apply_chat_template` renders with Gemma 3's own template. Gemma 1/2's
    template refuses a system message, so `auto` tells the two apart."""
    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    template = load_template("gemma3", _tokenizer_with("", special))
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": " a\n"},
        {"role": "assistant", "content": "\n b "},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    text, spans = template.render(messages)
    assert text == (
        "<bos><start_of_turn>user\ns\n\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
        "<start_of_turn>user\nc<end_of_turn>\n<start_of_turn>model\nd<end_of_turn>\n"
    )
    assert [text[a:b] for a, b in spans] == ["b<end_of_turn>\n", "d<end_of_turn>\n"]
    with pytest.raises(TemplateError, match="alternate"):
        template.render([{"role": "assistant", "content": "x"}])
    for name in ("gemma", "gemma3"):
        assert _auto_pick(_untagged(name), special).startswith(f"{name} (auto:")


def test_llama3_1_template_writes_the_date_preamble_and_tools_in_the_first_user_turn():
    """Expected text: what Hugging Face's `apply_chat_template` renders with Llama 3.1's own template (its fixed
    date, tools in the first user turn, one JSON call per turn, tool output JSON-encoded)."""
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    template = load_template("llama3_1", _tokenizer_with("", special))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": " 21.\n"},
    ]
    text, spans = template.render(messages, tools)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert text == (
        "<|begin_of_text|>" + header.format("system") + "Environment: ipython\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\ns<|eot_id|>" + header.format("user") + "Given the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        'Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n'
        '        "description": "d",\n        "parameters": {}\n    }\n}\n\nw?<|eot_id|>'
        + header.format("assistant")
        + '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        + header.format("ipython")
        + '"21"<|eot_id|>'
        + header.format("assistant")
        + "21.<|eot_id|>"
    )
    trained = ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "21.<|eot_id|>"]
    assert [text[a:b] for a, b in spans] == trained
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert template.render(plain)[0] == (
        "<|begin_of_text|>" + header.format("system") + "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul "
        "2024\n\n<|eot_id|>" + header.format("user") + "hi<|eot_id|>" + header.format("assistant") + "hello<|eot_id|>"
    )
    with pytest.raises(TemplateError, match="single tool-calls"):
        template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": []}])
    for name in ("llama3", "llama3_1"):
        assert _auto_pick(_untagged(name), special).startswith(f"{name} (auto:")


def test_phi4_template_renders_turns_without_newlines_and_refuses_tool_calls():
    """Expected text: what Hugging Face's `apply_chat_template` renders with Phi-4's own template, which drops tool
    calls and tool turns; the tagged copy refuses them instead of training a turn without its call."""
    template = load_template("phi4", _tokenizer_with("", {"eos_token": "<|im_end|>"}))
    messages = [
        {"role": "system", "content": " s "},
        {"role": "user", "content": " a\n"},
        {"role": "assistant", "content": "\n b "},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    text, spans = template.render(messages)
    assert text == (
        "<|im_start|>system<|im_sep|> s <|im_end|><|im_start|>user<|im_sep|> a\n<|im_end|>"
        "<|im_start|>assistant<|im_sep|>\n b <|im_end|><|im_start|>user<|im_sep|>c<|im_end|>"
        "<|im_start|>assistant<|im_sep|>d<|im_end|>"
    )
    assert [text[a:b] for a, b in spans] == ["\n b <|im_end|>", "d<|im_end|>"]
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    with pytest.raises(TemplateError, match="no tool calls"):
        template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert _auto_pick(_untagged("phi4"), {}).startswith("phi4 (auto:")
