"""render: source records → rendered text plus the character spans to train on (one JSONL shard per source).

    {"messages": [...]}  ──normalise──▶  messages  ──chat template──▶  {"text": "...", "train_char_spans": [[s, e)],
    {"conversations": ...}                                                  "source": "data.jsonl:7"}

Sources are JSONL (`file:line`), a `.json` array or Parquet (`file:record N`) or a folder saved with
`datasets.save_to_disk` (`folder:record N`, or `folder[split]:record N`); lines and records count from 1.

`mask_policy="generation"` trains what the template's `{% generation %}` blocks render. `mask_policy="roles"` works
with any prefix-stable template: the span of message i is the text that rendering `messages[:i+1]` adds to rendering
`messages[:i]`; for assistant turns it starts after the generation prompt (the role cue), when that is a prefix too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

from jinja2.exceptions import SecurityError, TemplateError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.core.manifests import TemplateChoice
from sftflow.tasks.data.chat_template import ChatTemplate, load_template
from sftflow.tasks.data.formats import FORMATS, ROLES, Conversation, RecordError, detect_format, normalize_record
from sftflow.tasks.data.records import RenderedDoc
from sftflow.tasks.data.sharding import SourceRange, iter_range_records
from sftflow.tasks.data.template_limits import DEFAULT_OUTPUT_CHARS, DEFAULT_SECONDS, RenderLimitError, RenderLimits

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RenderConfig(BaseModel):
    """How records become text. `template`: "auto" (the tokenizer's template if it has generation tags, else the
    shipped tagged template that renders the same text), None (the tokenizer's, as it is), a built-in name or a
    .jinja file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "text_spans"] = Field(
        "auto", description="the records' format (auto: detected per file)"
    )
    template: str | None = Field(
        "auto",
        description="auto: the built-in tagged template that renders what the tokenizer's renders; tokenizer or null: "
        "the tokenizer's own; a built-in name (chatml, llama3, llama3_1, llama3_2, qwen2_5, qwen3, smollm3, gemma, "
        "gemma3, phi3, phi4, phi4_mini, zephyr, mistral); or a .jinja file",
    )
    template_tokens: tuple[str, ...] | None = Field(
        None,
        description="special tokens your own .jinja template writes (e.g. ['<|im_start|>', '<|im_end|>']): those the "
        "tokenizer lacks are added to a copy of it as single tokens, and training grows the model's embeddings to "
        "match; [] keeps them as text. Built-in templates declare their own",
    )
    mask_policy: Literal["generation", "roles"] = Field(
        "generation",
        description="generation: train the template's {% generation %} spans; roles: train train_roles, found by "
        "rendering conversation prefixes (the template must be prefix-stable)",
    )
    train_roles: tuple[Literal["system", "user", "assistant", "tool"], ...] = Field(
        ("assistant",), description="roles trained under mask_policy: roles"
    )
    on_bad_record: Literal["error", "reject"] = Field(
        "error", description="error: stop with file:line and field; reject: write rejects.jsonl and count"
    )
    text_spans: Literal["train", "exclude"] = Field(
        "train", description="for text + spans records: train the spans, or everything but them"
    )
    text_field: str = Field("text", description="the text field of text + spans records")
    spans_field: str = Field("spans", description="the character-spans field of text + spans records")
    tag_field: str | None = Field(
        "tag", description="a record field whose value (a string) labels the record; metrics break down by it"
    )
    # Limits: a template is untrusted code and a record untrusted data.
    max_render_seconds: float = Field(DEFAULT_SECONDS, gt=0, description="wall time one record's render may take")
    max_output_chars: int = Field(
        DEFAULT_OUTPUT_CHARS, ge=1, description="rendered characters (or 2x the record's text, if larger)"
    )
    # The tokenizer peaks near 190 MiB of RSS per MB of one text (`spans.BATCH_CHARS`): 8 MiB records, rendered to at
    # most 16 Mi characters, stay near 3 GiB; a 60 MB record took 7.9 GB and aborted it.
    max_record_bytes: int = Field(8 * 2**20, ge=1, description="a JSONL line longer than this is a bad record")
    max_nesting: int = Field(100, ge=1, description="a record nested deeper than this is a bad record")

    @field_validator("train_roles")
    @classmethod
    def _non_empty(cls, value):
        if not value:
            raise ValueError(f"train_roles must name at least one of {'/'.join(ROLES)}")
        return value


class TemplateProblem(ValueError):
    """The template (not one record) is unusable: never counted as a reject, always raised."""


class RenderStats(BaseModel):
    source: str
    format: str | None
    records: int
    rendered: int
    rejected: int
    rejects_by_field: dict[str, int]
    out_path: str
    rejects_path: str | None


# ---------------------------------------------------------------------------------------------------------- records


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    # Same aliasing as Hugging Face's apply_chat_template, so templates that read `thinking` see the reasoning too.
    out = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _render(
    template: ChatTemplate, conv: Conversation, messages, source: str, limits: RenderLimits, add_generation_prompt=False
):
    try:
        return template.render(_alias_reasoning(messages), conv.tools, add_generation_prompt, limits)
    except SecurityError as err:
        raise TemplateProblem(f"chat template {template.name}: refused an unsafe operation: {err}") from err
    except RenderLimitError as err:
        raise TemplateProblem(
            f"{source}: chat template {template.name} was stopped: {err}; see render.max_render_seconds and "
            "render.max_output_chars"
        ) from None
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise RecordError(source, "template", f"failed to render: {type(err).__name__}: {err}") from err


def _generation_spans(template: ChatTemplate, conv: Conversation, source: str, limits: RenderLimits) -> RenderedDoc:
    if not template.has_generation_tag:
        raise TemplateProblem(
            f"chat template {template.name} has no {{% generation %}} tag, so mask_policy='generation' cannot tell "
            "which text to train. Wrap each assistant turn's content and its end-of-turn token, e.g. "
            "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}, "
            "or use mask_policy='roles' with a prefix-stable template."
        )
    text, spans = _render(template, conv, conv.messages, source, limits)
    for k, (start, end) in enumerate(spans):
        if end == start:
            raise RecordError(source, "messages", f"has an assistant turn (generation block {k}) empty after rendering")
    if not spans and any(m["role"] == "assistant" for m in conv.messages):
        raise RecordError(source, "messages", "has assistant turns but the template rendered no generation block")
    return RenderedDoc(text=text, train_char_spans=tuple(spans), source=source)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _role_spans(template: ChatTemplate, conv: Conversation, train_roles, source: str, limits) -> RenderedDoc:
    messages = conv.messages
    try:
        previous = _render(template, conv, [], source, limits)[0]
    except RecordError:  # many templates cannot render an empty conversation; its text is then empty
        previous = ""
    spans = []
    for i, message in enumerate(messages):
        current = _render(template, conv, messages[: i + 1], source, limits)[0]
        if not current.startswith(previous):
            at = _first_difference(previous, current)
            raise RecordError(
                source,
                "template",
                f"is not prefix-stable: rendering messages[:{i}] is not a prefix of rendering messages[:{i + 1}] "
                f"(they differ at character {at}: {previous[at : at + 30]!r} vs {current[at : at + 30]!r}); "
                "mask_policy='roles' needs a prefix-stable template, or use a template with {% generation %} tags",
            )
        if message["role"] in train_roles:
            start = len(previous)
            if message["role"] == "assistant":
                prompt = _render(template, conv, messages[:i], source, limits, add_generation_prompt=True)[0]
                if len(prompt) > start and current.startswith(prompt):
                    start = len(prompt)
            if len(current) <= start:
                field = f"messages[{i}]"
                raise RecordError(source, field, f"is a {message['role']!r} turn that is empty after rendering")
            spans.append((start, len(current)))
        previous = current
    return RenderedDoc(text=previous, train_char_spans=tuple(spans), source=source)


MAX_TAG_CHARS = 200


def record_tag(record: dict[str, Any], field: str | None, source: str) -> str | None:
    """The record's tag: a non-empty string (or an integer, as text) in `field`; None when absent, null or empty."""
    if field is None or not isinstance(record, dict):
        return None
    value = record.get(field)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(
            source, field, f"is {type(value).__name__}; a tag is a string (render.tag_field: null reads no tags)"
        )
    tag = str(value)
    if len(tag) > MAX_TAG_CHARS:
        raise RecordError(source, field, f"is {len(tag)} characters long; a tag has at most {MAX_TAG_CHARS}")
    return tag


def render_record(
    record: dict[str, Any], template: ChatTemplate | None, config: RenderConfig, source: str = "<record>"
) -> RenderedDoc:
    """Normalise and render one raw record. Raises `RecordError` (a ValueError) naming `source` and the field."""
    doc = _render_record(record, template, config, source)
    tag = record_tag(record, config.tag_field, source)
    return doc if tag is None else dataclasses.replace(doc, tag=tag)


def _render_record(
    record: dict[str, Any], template: ChatTemplate | None, config: RenderConfig, source: str
) -> RenderedDoc:
    fmt = config.format
    if fmt == "auto":
        fmt = detect_format(record)
        if fmt is None:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise RecordError(source, "record", f"has keys {keys}; cannot tell its format ({'/'.join(FORMATS)})")
    normalized = normalize_record(
        record,
        fmt,
        source,
        text_field=config.text_field,
        spans_field=config.spans_field,
        text_spans=config.text_spans,
    )
    if not isinstance(normalized, Conversation):
        return RenderedDoc(text=normalized.text, train_char_spans=tuple(normalized.train_char_spans), source=source)
    if template is None:
        raise TemplateProblem(f"{source}: format {fmt!r} needs a chat template; none was given")
    limits = RenderLimits(seconds=config.max_render_seconds, output_chars=config.max_output_chars)
    if config.mask_policy == "generation":
        return _generation_spans(template, normalized, source, limits)
    return _role_spans(template, normalized, config.train_roles, source, limits)


# ---------------------------------------------------------------------------------------------------------- sources


def iter_source_records(
    path: str | Path, source_range: SourceRange | None = None, max_record_bytes: int | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield `(source, record)` for every record of a source, or of one shard of it (`sftflow.tasks.data.sharding`).

    A line that is not JSON (or not UTF-8), or is longer than `max_record_bytes`, yields a `RecordError` as its
    record. Sources name the whole file's line or row, so a shard's records carry the same `source` strings as in an
    unsharded read.
    """
    return iter_range_records(path, source_range, max_record_bytes)


def nesting_depth(value: Any, limit: int) -> int:
    """How deeply lists and dicts nest in `value`, counted iteratively up to `limit + 1` (a record nested deeper than
    Python's recursion limit must not crash the check)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def render_source(
    source_path: str | Path,
    out_path: str | Path,
    config: RenderConfig,
    template: ChatTemplate | None,
    rejects_path: str | Path | None = None,
    source_range: SourceRange | None = None,
) -> RenderStats:
    """Render every record of one source into a JSONL shard of `{"text", "train_char_spans", "source"}`.

    With `on_bad_record="reject"`, bad records go to `rejects_path` (default: `<out_path>.rejects.jsonl`) as
    `{"source", "field", "reason"}` and are counted; with "error" the first one raises its `RecordError`.
    Both files are written atomically (temporary name, fsync, rename). `source_range` renders one shard of the source.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    reject = config.on_bad_record == "reject"
    if reject and rejects_path is None:
        rejects_path = out_path.with_name(out_path.name + ".rejects.jsonl")
    rejects_path = Path(rejects_path) if rejects_path is not None else None
    fmt = None if config.format == "auto" else config.format
    record_config = config
    counts: Counter[str] = Counter()
    records = rendered = 0
    with ExitStack() as files:  # both written atomically; on any error neither is left behind, temporary or not
        out = files.enter_context(atomic_writer(out_path, "w", encoding="utf-8"))
        rout = files.enter_context(atomic_writer(rejects_path, "w", encoding="utf-8")) if reject else None
        for source, record in iter_source_records(source_path, source_range, config.max_record_bytes):
            records += 1
            try:
                if isinstance(record, RecordError):
                    raise record
                if nesting_depth(record, config.max_nesting) > config.max_nesting:
                    raise RecordError(source, "record", f"nests deeper than render.max_nesting={config.max_nesting}")
                if fmt is None:  # autodetect once per file, from the first valid record
                    fmt = detect_format(record)
                    if fmt is None:
                        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                        raise ValueError(
                            f"{source}: record has keys {keys}; cannot tell the format of {source_path}. "
                            f"Set format to one of {'/'.join(FORMATS)}"
                        )
                    record_config = config.model_copy(update={"format": fmt})
                doc = render_record(record, template, record_config, source)
            except RecordError as err:
                if not reject:
                    raise
                counts[err.field.split("[")[0].split(".")[0]] += 1
                rout.write(json.dumps(err.as_reject(), ensure_ascii=False) + "\n")
                continue
            row = {"text": doc.text, "train_char_spans": [list(s) for s in doc.train_char_spans], "source": source}
            if doc.tag is not None:
                row["tag"] = doc.tag
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            rendered += 1
    return RenderStats(
        source=str(source_path),
        format=fmt,
        records=records,
        rendered=rendered,
        rejected=sum(counts.values()),
        rejects_by_field=dict(counts),
        out_path=str(out_path),
        rejects_path=str(rejects_path) if reject else None,
    )


def read_rendered_shard(path: str | Path) -> list[RenderedDoc]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            spans = tuple((int(s), int(e)) for s, e in row["train_char_spans"])
            docs.append(RenderedDoc(row["text"], spans, row["source"], row.get("tag")))
    return docs


def resolve_template(config: RenderConfig, tokenizer_path: str | Path | None = None) -> ChatTemplate | None:
    """Load the template `config` names, with special tokens (bos_token, eos_token, ...) from the tokenizer."""
    tokenizer = None
    if tokenizer_path is not None:
        from sftflow.tasks.data.tokenizer_files import load_tokenizer_files

        tokenizer = load_tokenizer_files(tokenizer_path)
    if config.template is None and tokenizer is None:
        if config.format == "text_spans":
            return None
        raise ValueError("template: no template given and no tokenizer to take its chat_template from")
    spec = config.template
    if spec == "auto" and config.mask_policy == "roles":
        spec = None  # the roles policy needs no tags: the tokenizer's own template, as it is
    template = load_template(spec, tokenizer, tokenizer_name=str(tokenizer_path))
    if spec != config.template:
        template.choice = TemplateChoice(
            name=template.name, how="auto", note="the tokenizer's own, as mask_policy roles needs no generation tags"
        )
    if config.template_tokens:
        template.writes_tokens = tuple(dict.fromkeys(template.writes_tokens + config.template_tokens))
    elif config.template_tokens is None and tokenizer is not None and spec not in (None, "tokenizer", "auto"):
        check_template_tokens(template, tokenizer.get_vocab(), tokenizer_path)
    return template


# What a special token looks like in most vocabularies (<|im_start|>, <|eot_id|>, <|/tool|>). Other markers, such as
# <start_of_turn> or <think>, are plain text in some vocabularies and special in others, so only this form is caught.
_SPECIAL_TOKEN_RE = re.compile(r"<\|[^<>|\s]{1,64}\|>")


def check_template_tokens(template: ChatTemplate, vocab: dict[str, int], tokenizer_path) -> None:
    """A template that is not the tokenizer's and declares no tokens (the user's own .jinja) must not write a
    special-looking token the tokenizer lacks: it would be split into pieces of text without a word."""
    if template.writes_tokens:
        return
    missing = sorted({t for t in _SPECIAL_TOKEN_RE.findall(template.text) if t not in vocab})
    if missing:
        raise TemplateProblem(
            f"template {template.name}: writes {missing}, which tokenizer {tokenizer_path} does not have as single "
            f"tokens; list them in data.render.template_tokens to add them to a copy of the tokenizer (training grows "
            f"the model's embeddings to match), or set data.render.template_tokens: [] to keep them as text"
        )
