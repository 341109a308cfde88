"""Sandboxed chat-template rendering with exact character spans for `{% generation %}` blocks.

Templates are untrusted code (they come from model repos), so they run in Jinja's `ImmutableSandboxedEnvironment`
with the same globals and filters Hugging Face provides (`raise_exception`, `strftime_now`, `tojson`, `dict`,
`namespace`, `loopcontrols`, `trim_blocks`, `lstrip_blocks`). A template rendered here gives the same text as
`tokenizer.apply_chat_template`.

How generation spans are found, and why this way: the `{% generation %}` tag wraps what it renders in a start and
an end marker that carry a fresh 128-bit random nonce per render call. After rendering, one regex pass removes the
markers and records where they were in the *final* string. Hugging Face instead measures the text streamed so far
when the block closes; that is wrong whenever the block's output does not go straight to the output stream (inside a
macro, a `{% set %}` block, or a filter). Markers travel with the text, so any such detour is either handled exactly
or detected: if the number of markers found is not twice the number of generation blocks rendered, or they do not
nest, rendering fails instead of producing a wrong mask. Message text cannot forge a marker because it cannot know
the nonce.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sftflow.tasks.core.manifests import TemplateChoice
from sftflow.tasks.data.template_clock import strftime_now
from sftflow.tasks.data.template_limits import RenderLimits, render_limited
from sftflow.tasks.data.template_sizes import (
    bounded_concat,
    checked_binop,
    checked_call,
    checked_concat,
    checked_filter,
    checked_result,
    lipsum_checked,
)

log = logging.getLogger(__name__)

# The special tokens each built-in template writes, which a tokenizer must know as single tokens for the text to
# tokenize as the format's own models see it (Zephyr's role cues are plain text in its models' vocabularies). The
# order is the order `template: auto` tries them in.
TEMPLATE_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "llama3_1": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "llama3_2": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "qwen2_5": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),
    "smollm3": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "gemma3": ("<start_of_turn>", "<end_of_turn>"),
    "phi3": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    "phi4": ("<|im_start|>", "<|im_sep|>", "<|im_end|>"),
    "phi4_mini": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"),
    "zephyr": (),
    "mistral": (),  # [INST] is a control token in v3 vocabularies, plain text in older ones
}
BUILTIN_TEMPLATES = tuple(TEMPLATE_TOKENS)
_GENERATION_TAG_RE = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
# Generation markers of any render; `_strip_markers` keeps only those carrying this render's nonce. One pattern for
# all renders: compiling one per render (per nonce) was a third of the render stage's time.
_MARKER_RE = re.compile("\x00sftflow-gen-(start|end)-([0-9a-f]{32})\x00")


@dataclass
class _Tracker:
    nonce: str
    blocks: int = 0


_TRACKER: ContextVar[_Tracker | None] = ContextVar("sftflow_generation_tracker", default=None)


class GenerationExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the rendered text inside as trained."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        tracker = _TRACKER.get()
        if tracker is None:  # rendered outside `ChatTemplate.render`: behave like a plain block
            return text
        tracker.blocks += 1
        return f"\x00sftflow-gen-start-{tracker.nonce}\x00{text}\x00sftflow-gen-end-{tracker.nonce}\x00"


class _TemplateDict:
    """`dict(...)` for templates without exposing the `dict` type itself (as Hugging Face does)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A `namespace` that refuses underscore-prefixed attributes, so templates cannot plant dunders."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r} on a namespace")


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _SizedConcatGenerator(CodeGenerator):
    """Compiles `a ~ b` to a join that sizes its parts first (Jinja's own join cannot be intercepted otherwise)."""

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.checked_concat({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every operation that can build a large value sized against the render's output
    budget before it runs (`sftflow.tasks.data.template_sizes`): `*`, `**`, `+`, `%`, `~`, calls, filters, the text of
    macros and blocks, and each `{{ }}`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _SizedConcatGenerator
    concat = staticmethod(bounded_concat)  # macros, `{% set %}` blocks and call blocks join their text with it
    checked_concat = staticmethod(checked_concat)

    def call_binop(self, context, operator, left, right):
        if operator in self.intercepted_binops:
            return checked_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's names, free of the caller's keywords)
        return checked_call(__obj, args, kwargs, partial(ImmutableSandboxedEnvironment.call, __self, __context))


def _checked_output(value):
    return checked_result(value, "'{{ }}'")


def make_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationExtension, jinja2.ext.loopcontrols],
        finalize=_checked_output,
    )
    env.globals["lipsum"] = lipsum_checked(env.globals["lipsum"])
    env.filters["tojson"] = _tojson
    env.filters = {name: checked_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = make_environment()


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to (`bos_token`, `eos_token`, ...)."""

    def __init__(
        self,
        text: str,
        special_tokens: dict[str, str] | None = None,
        name: str = "<template>",
        writes_tokens: tuple[str, ...] = (),
    ):
        self.text = text
        self.name = name
        self.writes_tokens = writes_tokens  # special tokens it writes, when known (built-in templates)
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = _ENV.from_string(text)
        except TemplateError as err:
            raise ValueError(f"chat template {name}: does not compile: {err}") from err
        self.has_generation_tag = bool(_GENERATION_TAG_RE.search(text))
        self.choice: TemplateChoice | None = None  # how `load_template` chose it

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        limits: RenderLimits = RenderLimits(),
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render `messages`; return the text and the half-open character spans of its generation blocks.

        Raises `jinja2.TemplateError` (including `SecurityError`) from the template itself, `RenderLimitError` when
        the render passes its time or output budget (`limits`), and `ValueError` when generation markers were
        altered by the template so that spans cannot be located.
        """
        tracker = _Tracker(nonce=secrets.token_hex(16))
        token = _TRACKER.set(tracker)
        context = (
            dict(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
            | self.special_tokens
        )
        try:
            raw = render_limited(self._compiled, context, limits, _size(messages) + _size(tools))
        finally:
            _TRACKER.reset(token)
        if tracker.blocks == 0:
            return raw, []
        return _strip_markers(raw, tracker, self.name)


def _size(value) -> int:
    """Characters of text in a conversation (strings, at any depth): what its rendering's output budget scales with."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 0


def _strip_markers(raw: str, tracker: _Tracker, name: str) -> tuple[str, list[tuple[int, int]]]:
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    out_len = 0
    pos = 0
    depth = 0
    start = 0
    markers = 0
    for match in _MARKER_RE.finditer(raw):
        if match.group(2) != tracker.nonce:  # not this render's marker (e.g. data imitating one): plain text
            continue
        piece = raw[pos : match.start()]
        pieces.append(piece)
        out_len += len(piece)
        pos = match.end()
        markers += 1
        if match.group(1) == "start":
            if depth == 0:
                start = out_len
            depth += 1
        else:
            depth -= 1
            if depth < 0:
                break
            if depth == 0:
                spans.append((start, out_len))
    if depth != 0 or markers != 2 * tracker.blocks:
        raise ValueError(
            f"chat template {name}: the output of a {{% generation %}} block was altered by the template "
            "(a filter or string operation on it), so its character spans cannot be located; "
            "put {% generation %} directly around the text that is written out"
        )
    pieces.append(raw[pos:])
    return "".join(pieces), spans


def builtin_template_text(name: str) -> str:
    return resources.files("sftflow.tasks.data").joinpath(f"templates/{name}.jinja").read_text(encoding="utf-8")


def load_template(spec: str | None, tokenizer=None, tokenizer_name: str = "the tokenizer") -> ChatTemplate:
    """Resolve a template: `None`/"tokenizer" (the tokenizer's `chat_template`), "auto" (see `_auto`), a built-in
    name, or a `.jinja` path.

    `tokenizer` (a Hugging Face tokenizer) supplies the special tokens the template may use, and the template itself
    for `None` and "auto".
    """
    special = dict(tokenizer.special_tokens_map) if tokenizer is not None else {}
    special = {k: v for k, v in special.items() if isinstance(v, str)}
    if spec in (None, "tokenizer", "auto"):
        text = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"template: {tokenizer_name} has no chat_template; name a built-in one "
                f"({'/'.join(BUILTIN_TEMPLATES)}) or a .jinja file"
            )
        own = ChatTemplate(text, special, name="tokenizer.chat_template")
        if spec != "auto":
            own.choice = TemplateChoice(name=own.name, how="tokenizer")
            return own
        return _auto(own, special, tokenizer_name)
    if spec in BUILTIN_TEMPLATES:
        named = ChatTemplate(builtin_template_text(spec), special, name=spec, writes_tokens=TEMPLATE_TOKENS[spec])
        named.choice = TemplateChoice(name=spec, how="named")
        return named
    path = Path(spec)
    if path.suffix == ".jinja" or path.is_file():
        if not path.is_file():
            raise ValueError(f"template: file {spec} does not exist")
        given = ChatTemplate(path.read_text(encoding="utf-8"), special, name=str(path))
        given.choice = TemplateChoice(name=path.name, how="file")
        return given
    raise ValueError(
        f"template: {spec!r} is neither 'auto', a built-in template ({'/'.join(BUILTIN_TEMPLATES)}) nor a .jinja file"
    )


def _auto(own: ChatTemplate, special: dict[str, str], tokenizer_name: str) -> ChatTemplate:
    """`template: auto`: the built-in tagged template that renders what the tokenizer's template renders
    (`sftflow.tasks.data.template_match`). A tokenizer template with generation tags of its own is kept, unless its tags
    cover more than the matching built-in's (SmolLM3 ships tags around the role cue and the newline after each
    answer): sftflow does not train role cues, and `template: tokenizer` keeps the tokenizer's tags as they are."""
    from sftflow.tasks.data.template_match import renders_alike, tags_cover_more

    # No `writes_tokens`: the text is the tokenizer's own template's, so its tokens are the tokenizer's already.
    candidates = (ChatTemplate(builtin_template_text(n), special, name=n) for n in BUILTIN_TEMPLATES)
    match = next((t for t in candidates if renders_alike(own, t)), None)
    if own.has_generation_tag and (match is None or not tags_cover_more(own, match)):
        own.choice = TemplateChoice(name=own.name, how="auto", note="the tokenizer's own, with generation tags")
        return own
    if match is None:
        raise ValueError(
            f"template auto: the chat_template of {tokenizer_name} has no {{% generation %}} tags and renders like "
            f"none of sftflow's tagged templates ({'/'.join(BUILTIN_TEMPLATES)}); either give a copy of it with "
            "{% generation %}...{% endgeneration %} around each assistant turn (render.template: my.jinja), or set "
            "render.mask_policy: roles to train the assistant turns found by rendering prefixes"
        )
    if own.has_generation_tag:
        log.info(
            "template auto: the generation tags in %s's chat_template also cover role cues; using %s, which renders "
            "the same text and trains only the answers (template: tokenizer keeps the tokenizer's tags)",
            tokenizer_name,
            match.name,
        )
    else:
        log.info("template auto: %s renders what the chat_template of %s renders; using it", match.name, tokenizer_name)
    match.choice = _auto_choice(own, match)
    match.name = f"{match.name} (auto: matches {tokenizer_name}'s chat_template)"
    return match


def _auto_choice(own: ChatTemplate, match: ChatTemplate) -> TemplateChoice:
    """How `template: auto` chose `match`: the probes it renders as the tokenizer's own template does."""
    from sftflow.tasks.data.template_match import count_alike

    counts = count_alike(own, match)
    notes = []
    if counts.differing:  # alike, not equal: only tool calls that the tokenizer's template drops and `match` refuses
        probes = " or ".join(counts.differing)
        notes.append(f"not on {probes}: the tokenizer's own drops its tool calls, {match.name} refuses them")
    if own.has_generation_tag:
        notes.append("the tokenizer's own tags also cover role cues")
    return TemplateChoice(
        name=match.name, how="auto", probes=counts.compared, equal=counts.equal, note="; ".join(notes) or None
    )
