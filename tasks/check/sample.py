"""The documents `sftflow check` works on: the first records of each source, rendered and tokenized exactly as the
data stages do, kept beside the normalised conversation Hugging Face is given."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.data.formats import Conversation, RecordError, detect_format, normalize_record
from sftflow.tasks.data.records import RenderedDoc, TokenizedDoc
from sftflow.tasks.data.render import RenderConfig, iter_source_records, render_record
from sftflow.tasks.data.spans import SpansConfig, tokenize_docs


@dataclass(frozen=True)
class SampledDoc:
    """One sampled record: its conversation (None for `text_spans` records), its rendering, and its tokens as
    training sees them (`trained`: the spans config as given, without its length limit) and as the template alone
    writes them (`templated`: no BOS or EOS added). Either is None when the record has no trained token."""

    source: str
    conversation: Conversation | None
    rendered: RenderedDoc
    trained: TokenizedDoc | None
    templated: TokenizedDoc | None


def sample_records(paths: list[str], count: int, config: RenderConfig) -> list[tuple[str, dict]]:
    """`(source, record)` for the first records of each source, `count` in all, spread evenly over the sources. A bad
    line raises its `RecordError` under `on_bad_record: error` and is passed over under `reject`."""
    per_source = math.ceil(count / len(paths))
    picked: list[tuple[str, dict]] = []
    for path in paths:
        taken = 0
        for source, record in iter_source_records(path, None, config.max_record_bytes):
            if taken == per_source or len(picked) == count:
                break
            if isinstance(record, RecordError):
                if config.on_bad_record == "error":
                    raise record
                continue
            picked.append((source, record))
            taken += 1
    return picked


def _one(doc: RenderedDoc, tokenizer, config: SpansConfig) -> TokenizedDoc | None:
    kept, _ = tokenize_docs([doc], tokenizer, config)
    return kept[0] if kept else None


def sample_docs(
    records: list[tuple[str, dict]], template: ChatTemplate | None, tokenizer, render: RenderConfig, spans: SpansConfig
) -> list[SampledDoc]:
    """Render and tokenize each record as the data stages would (the format detected once per file, from its first
    record, as `render_source` does)."""
    formats: dict[str, str] = {}
    trained_config = spans.model_copy(update={"max_length": None})
    templated_config = spans.model_copy(update={"max_length": None, "bos": "never", "eos": "never"})
    out = []
    for source, record in records:
        file = source.rsplit(":", 1)[0]
        fmt = render.format if render.format != "auto" else formats.setdefault(file, detect_format(record) or "auto")
        config = render.model_copy(update={"format": fmt})
        try:
            rendered = render_record(record, template, config, source)
        except RecordError:
            if render.on_bad_record == "error":
                raise
            continue
        conversation = None
        if fmt != "text_spans":
            normalized = normalize_record(record, fmt, source)
            conversation = normalized if isinstance(normalized, Conversation) else None
        out.append(
            SampledDoc(
                source=source,
                conversation=conversation,
                rendered=rendered,
                trained=_one(rendered, tokenizer, trained_config),
                templated=_one(rendered, tokenizer, templated_config),
            )
        )
    return out
