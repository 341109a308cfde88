"""Tagged templates for Llama 3.2, SmolLM3, Phi-4-mini and Mistral's tool calls.

The expected texts are what Hugging Face's `apply_chat_template` renders with each family's own template, on the day
`fixed_clock` names (Llama 3.2 and SmolLM3 write the day they render).
"""

from __future__ import annotations

import re
from datetime import datetime

import pytest
from jinja2.exceptions import TemplateError

from sftflow.tasks.data.chat_template import builtin_template_text, load_template
from sftflow.tasks.data.template_clock import fixed_clock
from sftflow.tasks.data.template_match import PROBES, count_alike, renders_alike
from tests.tasks.data.test_chat_template import _auto_pick, _tokenizer_with, _untagged

DAY = datetime(2025, 2, 3, 23, 59, 59)
_GET_WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {}}}]


def _render(name, special, messages, tools=None, add_generation_prompt=False):
    template = load_template(name, _tokenizer_with("", special))
    with fixed_clock(DAY):
        text, spans = template.render(messages, tools, add_generation_prompt)
    return text, [text[a:b] for a, b in spans]


def _chat(*contents):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


# ------------------------------------------------------------------------------------------------------- Llama 3.2

_LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
_HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


def test_llama3_2_writes_the_render_day_and_otherwise_renders_as_llama3_1():
    messages = [{"role": "system", "content": " s "}, *_chat("a", " b\n", "c", "d")]
    text, trained = _render("llama3_2", _LLAMA, messages)
    assert text == (
        "<|begin_of_text|>" + _HEADER.format("system") + "Cutting Knowledge Date: December 2023\nToday Date: 03 Feb "
        "2025\n\ns<|eot_id|>"
        + _HEADER.format("user")
        + "a<|eot_id|>"
        + _HEADER.format("assistant")
        + "b<|eot_id|>"
        + _HEADER.format("user")
        + "c<|eot_id|>"
        + _HEADER.format("assistant")
        + "d<|eot_id|>"
    )
    assert trained == ["b<|eot_id|>", "d<|eot_id|>"]
    # tools, calls and tool results: Llama 3.1's text (its own test holds it) with the render day for its fixed one
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    with_tools = [
        *messages[:2],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21"},
    ]
    text_3_2, trained_3_2 = _render("llama3_2", _LLAMA, with_tools, _GET_WEATHER)
    text_3_1, trained_3_1 = _render("llama3_1", _LLAMA, with_tools, _GET_WEATHER)
    assert text_3_2 == text_3_1.replace("Today Date: 26 Jul 2024", "Today Date: 03 Feb 2025")
    assert trained_3_2 == trained_3_1 == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>']


def test_llama3_2_day_follows_the_clock_and_auto_tells_it_from_llama3_1():
    template = load_template("llama3_2", _tokenizer_with("", _LLAMA))
    with fixed_clock(datetime(2031, 12, 9)):
        assert "Today Date: 09 Dec 2031\n" in template.render(_chat("a", "b"))[0]
    for name in ("llama3_1", "llama3_2"):
        assert _auto_pick(_untagged(name), _LLAMA).startswith(f"{name} (auto:")
    # the two compare equal only on Llama 3.1's own fixed day
    with fixed_clock(datetime(2024, 7, 26)):
        official = load_template("auto", _tokenizer_with(_untagged("llama3_2"), _LLAMA))
    assert official.name.startswith("llama3_1 (auto:")


# ------------------------------------------------------------------------------------------------------- SmolLM3

_SMOL = {"eos_token": "<|im_end|>"}
_SMOL_THINK_DEFAULT = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves "
    "thoroughly exploring questions through a systematic thinking process before providing the final precise and "
    "accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, "
    "reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please "
    "structure your response into two main sections: Thought and Solution using the specified format: <think> Thought "
    "section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each step "
    "should include detailed considerations such as analysing questions, summarizing relevant findings, "
    "brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting "
    "previous steps. In the Solution section, based on various attempts, explorations, and reflections from the "
    "Thought section, systematically present the final solution that you deem correct. The Solution section should "
    "be logical, accurate, and concise and detail necessary steps needed to reach the conclusion."
)


def _smol_preamble(mode: str, instructions: str) -> str:
    return (
        "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: 03 February 2025\n"
        f"Reasoning Mode: {mode}\n\n## Custom Instructions\n\n{instructions}\n\n"
    )


def test_smollm3_think_mode_by_default_reasoning_inline_and_the_system_turn_left_open():
    text, trained = _render("smollm3", _SMOL, _chat("a", "\n<think>\nr\n</think>\nb"))
    # SmolLM3's template closes the system turn only when it lists tools
    assert text == (
        _smol_preamble("/think", _SMOL_THINK_DEFAULT)
        + "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\nb<|im_end|>\n"
    )
    assert trained == ["<think>\nr\n</think>\nb<|im_end|>"]


def test_smollm3_no_think_flag_writes_an_empty_think_block_that_is_not_trained():
    messages = [{"role": "system", "content": "Be brief. /no_think"}, *_chat("a", "b", "c", "\nd")]
    text, trained = _render("smollm3", _SMOL, messages)
    answer = "<|im_start|>assistant\n<think>\n\n</think>\n{}<|im_end|>\n"
    assert text == (
        _smol_preamble("/no_think", "Be brief.")
        + "<|im_start|>user\na<|im_end|>\n"
        + answer.format("b")
        + "<|im_start|>user\nc<|im_end|>\n"
        + answer.format("d")
    )
    assert trained == ["b<|im_end|>", "d<|im_end|>"]
    prompt, _ = _render("smollm3", _SMOL, messages[:2], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")


def test_smollm3_system_override_and_tools():
    text, trained = _render(
        "smollm3", _SMOL, [{"role": "system", "content": "You are a pirate. /system_override"}, *_chat("a", "b")]
    )
    assert text == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        "<|im_start|>assistant\nb<|im_end|>\n"
    )
    assert trained == ["b<|im_end|>"]
    messages = [
        {"role": "system", "content": "sys /no_think"},
        *_chat("w?", "x"),
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "y"},
    ]
    text, trained = _render("smollm3", _SMOL, messages, _GET_WEATHER)
    answer = "<|im_start|>assistant\n<think>\n\n</think>\n{}<|im_end|>\n"
    assert text == (
        _smol_preamble("/no_think", "sys") + "### Tools\n\nYou may call one or more functions to assist with the user "
        "query.\nYou are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n"
        "{'type': 'function', 'function': {'name': 'get_weather', 'description': 'd', 'parameters': {}}}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "<|im_end|>\n<|im_start|>user\nw?<|im_end|>\n"
        + answer.format("x")
        + "<|im_start|>user\n21<|im_end|>\n"
        + answer.format("y")
    )
    assert trained == ["x<|im_end|>", "y<|im_end|>"]


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
            },
            "drops tool calls",
        ),
        ({"role": "assistant", "content": "x", "reasoning_content": "r"}, "drops separate reasoning"),
        ({"role": "system", "content": "late"}, "only a first system message"),
    ],
)
def test_smollm3_refuses_what_its_template_drops(message, match):
    with pytest.raises(TemplateError, match=match):
        _render("smollm3", _SMOL, [{"role": "user", "content": "q"}, message])


def test_auto_picks_smollm3_over_the_tags_smollm3_ships():
    """SmolLM3's own template has generation tags around the role cue and the newline after each answer; `auto`
    uses the built-in copy, which renders the same text and trains only the answers. Tags that cover no more than
    the built-in's are the tokenizer's to keep."""
    untagged = _untagged("smollm3")
    cue, newline = "{{- cue -}}\n", "\n{{- '\\n' -}}\n"
    assert untagged.count(cue) == 1 and untagged.count(newline) == 1
    shipped = untagged.replace(cue, "{% generation %}" + cue).replace(newline, newline + "{% endgeneration %}")
    assert _auto_pick(shipped, _SMOL).startswith("smollm3 (auto:")
    assert _auto_pick(untagged, _SMOL).startswith("smollm3 (auto:")
    assert _auto_pick(builtin_template_text("smollm3"), _SMOL) == "tokenizer.chat_template"
    for neighbour in ("chatml", "qwen2_5", "qwen3"):
        assert _auto_pick(_untagged(neighbour), _SMOL).startswith(f"{neighbour} (auto:")


# ------------------------------------------------------------------------------------------------------- Phi-4-mini

_PHI = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}


def test_phi4_mini_renders_turns_without_newlines_and_trains_the_final_eos():
    messages = [{"role": "system", "content": " s "}, *_chat(" a\n", "\n b ", "c", "d")]
    text, trained = _render("phi4_mini", _PHI, messages)
    assert text == (
        "<|system|> s <|end|><|user|> a\n<|end|><|assistant|>\n b <|end|><|user|>c<|end|><|assistant|>d<|end|>"
        "<|endoftext|>"
    )
    assert trained == ["\n b <|end|>", "d<|end|>", "<|endoftext|>"]
    assert _render("phi4_mini", _PHI, messages[:2], add_generation_prompt=True)[0] == (
        "<|system|> s <|end|><|user|> a\n<|end|><|assistant|>"
    )


def test_phi4_mini_tools_of_the_system_message_and_tool_turns():
    call = '<|tool_call|>[{"name": "f", "arguments": {}}]<|/tool_call|>'
    messages = [
        {"role": "system", "content": "s", "tools": '[{"name": "f"}]'},
        *_chat("w?", call),
        {"role": "tool", "content": "21"},
        {"role": "assistant", "content": "21."},
    ]
    text, trained = _render("phi4_mini", _PHI, messages)
    assert text == (
        '<|system|>s<|tool|>[{"name": "f"}]<|/tool|><|end|><|user|>w?<|end|><|assistant|>' + call + "<|end|>"
        "<|tool|>21<|end|><|assistant|>21.<|end|><|endoftext|>"
    )
    assert trained == [call + "<|end|>", "21.<|end|>", "<|endoftext|>"]
    calls = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    with pytest.raises(TemplateError, match="drops tool calls"):
        _render(
            "phi4_mini",
            _PHI,
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}],
        )
    with pytest.raises(TemplateError, match="record-level tools"):
        _render("phi4_mini", _PHI, _chat("x", "y"), _GET_WEATHER)


def test_auto_tells_phi4_mini_from_phi3_phi4_and_zephyr():
    for name in ("phi4_mini", "phi3", "phi4", "zephyr"):
        assert _auto_pick(_untagged(name), _PHI).startswith(f"{name} (auto:")


# ------------------------------------------------------------------------------------------------- Mistral tools

_MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}
_PARIS = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}, "id": "abc123XYZ"}
_NOARGS = {"type": "function", "function": {"name": "f", "arguments": ""}, "id": "def456UVW"}
_MISTRAL_TOOL_CHAT = [
    {"role": "system", "content": "sys"},
    *_chat("a", "b", "w?"),
    {"role": "assistant", "content": "", "tool_calls": [_PARIS, _NOARGS]},
    {"role": "tool", "content": "21.5", "tool_call_id": "abc123XYZ"},
    {"role": "tool", "content": "noon", "call_id": "def456UVW"},
    {"role": "assistant", "content": "Sunny."},
]
_CALLS = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}, '
    '{"name": "f", "arguments": {}, "id": "def456UVW"}]</s>'
)


def test_mistral_tool_calls_and_results():
    text, trained = _render("mistral", _MISTRAL, _MISTRAL_TOOL_CHAT, _GET_WEATHER)
    assert text == (
        '<s>[INST]a[/INST]b</s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", '
        '"description": "d", "parameters": {}}}][/AVAILABLE_TOOLS][INST]sys\n\nw?[/INST]'
        + _CALLS
        + '[TOOL_RESULTS]{"content": 21.5, "call_id": "abc123XYZ"}[/TOOL_RESULTS]'
        '[TOOL_RESULTS]{"content": "noon", "call_id": "def456UVW"}[/TOOL_RESULTS]Sunny.</s>'
    )
    assert trained == ["b</s>", _CALLS, "Sunny.</s>"]


def test_mistral_differs_from_its_template_only_by_the_escaped_quotes_of_object_arguments(shared_data):
    """Mistral's v3 template, rendered as Hugging Face renders it, writes &#34; for the quotes around a call whose
    arguments are an object (its `|safe` JSON concatenated to plain text is HTML-escaped); the tagged copy writes the
    quotes, as mistral-common encodes the call."""
    official = load_template(
        "tokenizer", _tokenizer_with((shared_data / "templates" / "mistral-common-v3.jinja").read_text(), _MISTRAL)
    )
    want = official.render(_MISTRAL_TOOL_CHAT, _GET_WEATHER)[0]
    assert "&#34;name&#34;: &#34;get_weather&#34;" in want
    assert want.replace("&#34;", '"') == _render("mistral", _MISTRAL, _MISTRAL_TOOL_CHAT, _GET_WEATHER)[0]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (
            [
                {"role": "user", "content": "w?"},
                {"role": "assistant", "content": "", "tool_calls": [{**_PARIS, "id": "x"}]},
            ],
            "id of 9",
        ),
        (
            [
                {"role": "user", "content": "w?"},
                {"role": "assistant", "content": "", "tool_calls": [_PARIS]},
                {"role": "tool", "content": "1"},
            ],
            "call_id or tool_call_id",
        ),
        (
            [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "x", "tool_calls": [_PARIS]}],
            "both content and tool calls",
        ),
        (
            [{"role": "user", "content": "w?"}, {"role": "tool", "content": "1", "tool_call_id": "abc123XYZ"}],
            "must follow an assistant",
        ),
    ],
)
def test_mistral_refuses_what_its_template_refuses(messages, match):
    with pytest.raises(TemplateError, match=match):
        _render("mistral", _MISTRAL, messages, _GET_WEATHER)


# ---------------------------------------------------------------------------------------------------- template: auto


def test_a_tagged_template_may_refuse_only_the_tool_calls_the_official_one_drops():
    """The tool probe: an official template that renders it as if the call were not there matches a tagged one that
    refuses the call; one that writes the call does not."""
    messages, tools = PROBES[-1]
    assert any(m.get("tool_calls") for m in messages) and tools
    dropping = load_template("tokenizer", _tokenizer_with(_untagged("smollm3"), _SMOL))
    assert renders_alike(dropping, load_template("smollm3", _tokenizer_with("", _SMOL)))
    writing = re.sub(
        r"\{%- if message\['tool_calls'\] is defined and message\['tool_calls'\] -%\}.*?\{%- elif",
        "{%- if false -%}{%- elif",
        _untagged("smollm3"),
        flags=re.S,
    )
    writing = writing.replace(
        "{{- cue -}}", "{{- cue -}}{{- message['tool_calls'] | tojson if message['tool_calls'] is defined else '' -}}"
    )
    assert not renders_alike(
        load_template("tokenizer", _tokenizer_with(writing, _SMOL)),
        load_template("smollm3", _tokenizer_with("", _SMOL)),
    )


def test_auto_counts_the_probes_its_choice_renders_as_the_tokenizer_s_own():
    """`count_alike` counts what `renders_alike` decides: a tagged template equal on every probe, and one equal on
    all but the tool probe, which it refuses where the official one drops the call; `auto` records the counts."""
    own = load_template("tokenizer", _tokenizer_with(_untagged("chatml"), {}))
    counts = count_alike(own, load_template("chatml"))
    assert "tool" in own.text and counts.compared == len(PROBES)
    assert counts.equal == counts.alike == counts.compared and counts.differing == ()
    chosen = load_template("auto", _tokenizer_with(_untagged("chatml"), {})).choice
    assert (chosen.name, chosen.how, chosen.probes, chosen.equal, chosen.note) == ("chatml", "auto", 5, 5, None)
    assert chosen.reason() == "auto, equal to the tokenizer's own on 5/5 probes"

    # SmolLM3's own template writes an assistant turn with tool calls as if they were not there; ours refuses them.
    official = re.sub(r'\{\{- raise_exception\("[^"]*drops tool calls[^"]*"\) -\}\}', "", _untagged("smollm3"))
    assert official != _untagged("smollm3")
    dropping = load_template("tokenizer", _tokenizer_with(official, _SMOL))
    counts = count_alike(dropping, load_template("smollm3", _tokenizer_with("", _SMOL)))
    assert (counts.compared, counts.equal, counts.alike, counts.differing) == (5, 4, 5, ("a tool call",))
    chosen = load_template("auto", _tokenizer_with(official, _SMOL)).choice
    assert (chosen.name, chosen.probes, chosen.equal) == ("smollm3", 5, 4)
    assert chosen.reason().startswith("auto, equal to the tokenizer's own on 4/5 probes; ")
    assert chosen.note == "not on a tool call: the tokenizer's own drops its tool calls, smollm3 refuses them"
    # A template the matcher turns down counts fewer probes alike than it compares.
    odd = load_template("tokenizer", _tokenizer_with(_untagged("chatml").replace("<|im_end|>", "<|end|>"), {}))
    counts = count_alike(odd, load_template("chatml"))
    assert counts.alike < counts.compared and not renders_alike(odd, load_template("chatml"))


def test_the_template_records_how_it_was_chosen(tmp_path):
    mine = tmp_path / "my.jinja"
    mine.write_text(builtin_template_text("chatml"))
    tokenizer = _tokenizer_with(_untagged("chatml"), {})
    assert load_template(str(mine), tokenizer).choice.reason() == "given in data.render.template"
    assert load_template(str(mine), tokenizer).choice.name == "my.jinja"
    assert load_template("chatml", tokenizer).choice.reason() == "named in data.render.template"
    assert load_template("tokenizer", tokenizer).choice.how == "tokenizer"
    tagged = load_template("auto", _tokenizer_with(builtin_template_text("chatml"), {})).choice
    assert (tagged.how, tagged.probes) == ("auto", None) and "generation tags" in tagged.reason()
