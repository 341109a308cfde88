"""spans: rendered text + trained character spans → token ids + token-level loss spans.

Each text is tokenized once with `add_special_tokens=False` and offsets: by tiktoken when the tokenizer is a byte-level
BPE that `sftflow.tasks.data.bpe_fast` reproduces exactly (its BPE is ~4x faster than HF's on one core), else in batches
by the fast (Rust) tokenizer. `tokenizer_backend` picks: `auto` (tiktoken when supported), `hf`, or `tiktoken` (an
error when unsupported). Under `auto` and `tiktoken` the first `VERIFY_DOCS` texts of every call (one call per shard)
that tiktoken encodes are also tokenized by HF; on any difference in ids or offsets `auto` uses HF for the whole call
and `tiktoken` raises, so the output does not depend on the backend.

A token is trained when any of its characters lies in a trained span, which is the rule Hugging Face's
`apply_chat_template(..., return_assistant_tokens_mask=True)` applies (token `[a, b)` overlaps a span `[s, e)` when
`a < e and b > s`; a zero-width token at `a` is trained when `s < a < e`).

One deliberate difference: some tokenizers report *trimmed* offsets (e.g. byte-level BPE with `trim_offsets`
leaves the leading space of " Hello" out of its offsets), so a character can belong to no token. Hugging Face then
never trains that character's token. Here each token's start is first extended back to the previous token's end, so
a gap character belongs to the token that actually contains it. For tokenizers without gaps the two rules agree.

    text     <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n
    spans                                                         [=========)
    tokens   <|im_start|> user \\n Hi <|im_end|> \\n <|im_start|> assistant \\n Hello <|im_end|> \\n
    mask          0        0    0  0     0       0       0          0      0    1        1      0

BOS (`bos="auto"`) is prepended, untrained, only when the tokenizer adds it itself when encoding with special
tokens and the text does not already start with it. EOS looks at the document's last token that is not whitespace
(templates end a turn with a stop and a newline, `<|im_end|>\n`): `never` adds nothing; `always` appends EOS (trained)
unless that token is already EOS; `auto` appends it (trained) only when that token is trained and is no end-of-turn
token (EOS or any of the tokenizer's special added tokens: `<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `<|end|>`),
for example `text_spans` records or a template that writes no stop. So a stop the template already trains is never
doubled (Hugging Face's `return_assistant_tokens_mask` trains `<|im_end|>\n` once), and a document that ends in an
untrained turn is left alone.

A document whose text and spans repeat an earlier one's in the same call is not tokenized again: it gets the earlier
one's ids and loss spans (and its own source and tag), so the output is the same as tokenizing every document.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.data.bpe_fast import FastBPE, why_unsupported
from sftflow.tasks.data.records import RenderedDoc, TokenizedDoc

SHARD_FORMAT_VERSION = 1
VERIFY_DOCS = 16  # texts per call (that tiktoken encodes) checked against HF before it is trusted with the rest
# Text per `encode_batch` call: Hugging Face tokenizers peaks at about 190 MiB of RSS per MB of a call's text
# (measured: 4 MB of English text, SmolLM2's and TinyLlama's tokenizers), so 16 Mi characters stay near 3 GiB.
BATCH_CHARS = 16 * 2**20

logger = logging.getLogger(__name__)


class SpansConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bos: Literal["auto", "never"] = Field(
        "auto", description="auto: add BOS only if the tokenizer adds one itself and the text lacks it"
    )
    eos: Literal["auto", "always", "never"] = Field(
        "auto",
        description="auto: append a trained EOS when the document's last non-whitespace token is trained and is no "
        "stop (EOS or a special token); always: append EOS unless that token is EOS; no policy doubles a trained stop",
    )
    max_length: int | None = Field(
        default=None, ge=1, description="longest document in tokens; a longer one is dropped or truncated"
    )
    length_policy: Literal["drop", "truncate"] = Field(
        "drop", description="a longer document is dropped, or cut to the longest prefix that still trains something"
    )
    batch_size: int = Field(default=256, ge=1, description="texts per tokenizer call")
    tokenizer_backend: Literal["auto", "hf", "tiktoken"] = Field(
        "auto", description="auto: tiktoken where it reproduces the tokenizer exactly, else HF"
    )


class TokenizeStats(BaseModel):
    out_path: str
    docs: int
    tokens: int
    loss_tokens: int
    truncated: int
    rejected: dict[str, int]
    tokenizer_backend: Literal["hf", "tiktoken"]
    rejects_path: str | None = None  # one JSON line per rejected document: its source (file:line) and reason
    repeated_docs: int = 0  # documents whose text and spans repeat an earlier one's in the shard: tokenized once


def _fast_backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer: {type(tokenizer).__name__} is not a fast tokenizer; spans need offset mappings")
    return backend


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(without) and with_special[0] == bos


def token_mask(offsets: np.ndarray, spans: tuple[tuple[int, int], ...] | list, text_length: int) -> np.ndarray:
    """Trained-token mask (bool, one per token) from token character offsets `(L, 2)` and half-open char spans."""
    count = len(offsets)
    if count == 0 or not spans:
        return np.zeros(count, dtype=bool)
    spans_S2 = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    diff = np.zeros(text_length + 1, dtype=np.int32)
    np.add.at(diff, spans_S2[:, 0], 1)
    np.add.at(diff, spans_S2[:, 1], -1)
    covered = np.cumsum(diff[:text_length]) > 0
    covered_before = np.concatenate(([0], np.cumsum(covered, dtype=np.int64)))  # chars covered in [0, i)
    starts = offsets[:, 0]
    ends = offsets[:, 1]
    previous_end = np.concatenate(([0], np.maximum.accumulate(ends)[:-1]))
    starts = np.minimum(starts, previous_end)  # give gap characters (trimmed offsets) to the token after them
    trained = covered_before[ends] - covered_before[starts] > 0
    zero_width = ends == starts
    if zero_width.any():
        # HF: a zero-width token at position a is trained when a span strictly contains it (s < a < e).
        pos = starts[zero_width]
        inside = (pos > 0) & (pos < text_length)
        left = covered[np.clip(pos - 1, 0, max(text_length - 1, 0))]
        right = covered[np.clip(pos, 0, max(text_length - 1, 0))]
        trained[zero_width] = inside & left & right
    return trained


def mask_to_spans(mask: np.ndarray) -> np.ndarray:
    """Half-open `[start, end)` runs of ones in a 0/1 mask, as int32 `(S, 2)`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return edges.reshape(-1, 2).astype(np.int32)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def _hf_arrays(encoding) -> tuple[np.ndarray, np.ndarray]:
    token_ids = encoding.ids
    ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    # fromiter over the flattened pairs is ~2x faster than np.asarray on a list of tuples.
    flat = chain.from_iterable(encoding.offsets)
    return ids, np.fromiter(flat, dtype=np.int64, count=2 * len(token_ids)).reshape(-1, 2)


def _fast_encoder(docs: list[RenderedDoc], tokenizer, backend, mode: str) -> FastBPE | None:
    """tiktoken for this call when `mode` allows it and it matches HF on the first `VERIFY_DOCS` texts it encodes."""
    if mode == "hf":
        return None
    fast = FastBPE.from_tokenizer(tokenizer)
    if fast is None:
        reason = why_unsupported(tokenizer)
        if mode == "tiktoken":
            raise ValueError(
                f"tokenizer_backend: tiktoken cannot reproduce this tokenizer ({reason}); use 'auto' or 'hf'"
            )
        _log_once(f"spans: tokenizing with Hugging Face tokenizers; tiktoken cannot reproduce it: {reason}")
        return None
    # Compare VERIFY_DOCS texts that tiktoken does encode: texts it hands to HF (`None`) check nothing, so look further
    # into the shard for them (at most 4 x VERIFY_DOCS texts are encoded twice).
    checked = 0
    for first in range(0, min(len(docs), 4 * VERIFY_DOCS), VERIFY_DOCS):
        sample = docs[first : first + VERIFY_DOCS]
        texts = [doc.text for doc in sample]
        reference = [
            encoding
            for batch in text_batches(texts, VERIFY_DOCS)
            for encoding in backend.encode_batch(batch, add_special_tokens=False)
        ]
        for doc, encoding, ours in zip(sample, reference, fast.encode_batch(texts), strict=True):
            if ours is None:  # tokenized by HF anyway
                continue
            ids, offsets = _hf_arrays(encoding)
            if not (np.array_equal(ours[0], ids) and np.array_equal(ours[1], offsets)):
                message = f"{doc.source}: tiktoken and Hugging Face tokenize this text differently"
                if mode == "tiktoken":
                    raise ValueError(f"{message}; use tokenizer_backend 'auto' or 'hf'")
                logger.warning(f"{message}; using Hugging Face for the {len(docs)} texts of this shard")
                return None
            checked += 1
        if checked >= VERIFY_DOCS:
            break
    _log_once(f"spans: tokenizing with {fast.description}, checked against Hugging Face per shard")
    return fast


def text_batches(texts: list[str], batch_size: int, max_chars: int = BATCH_CHARS):
    """Consecutive texts, at most `batch_size` of them and at most `max_chars` characters (a longer text alone)."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        if batch and (len(batch) == batch_size or chars + len(text) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


def _encodings(docs: list[RenderedDoc], backend, fast: FastBPE | None, batch_size: int):
    """(ids, offsets) per doc, in order; texts tiktoken cannot reproduce (`FastBPE.encode` is None) go to HF."""
    for texts in text_batches([doc.text for doc in docs], batch_size):
        if fast is None:
            yield from map(_hf_arrays, backend.encode_batch(texts, add_special_tokens=False))
            continue
        for text, ours in zip(texts, fast.encode_batch(texts), strict=True):
            yield ours if ours is not None else _hf_arrays(backend.encode(text, add_special_tokens=False))


def _end_of_turn_ids(tokenizer) -> frozenset[int]:
    """EOS and the tokenizer's special added tokens: the markers a template ends a turn with (`<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`, `<|end|>`), which need not be the tokenizer's EOS."""
    ids = {tokenizer.eos_token_id}
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return frozenset(i for i in ids if i is not None)


def _last_visible_token(text: str, offsets: np.ndarray) -> int:
    """Index of the last token that is not whitespace alone, or -1: the token whose characters reach past the text's
    trailing whitespace."""
    end = len(text.rstrip())
    for i in range(len(offsets) - 1, -1, -1):
        if offsets[i, 0] < end and offsets[i, 1] > offsets[i, 0]:
            return i
    return -1


def _adds_eos(policy: str, text: str, ids, offsets, mask, eos_id: int, stops: frozenset[int]) -> bool:
    """Whether the EOS policy appends a trained EOS to this document (see the module docstring)."""
    if policy == "never" or len(ids) == 0:
        return False
    last = _last_visible_token(text, offsets)
    if last < 0:
        return policy == "always"
    if policy == "always":
        return int(ids[last]) != eos_id
    return bool(mask[last]) and int(ids[last]) not in stops


@dataclass(frozen=True)
class _Tokenized:
    """What tokenizing one text with its spans gives: the kept ids and loss spans (whether they were truncated), or
    the reason it is rejected. It depends on the text and spans alone, so a repeated document reuses it."""

    ids: np.ndarray | None
    spans_S2: np.ndarray | None
    truncated: bool = False
    reject: str | None = None


def _tokenize(
    docs: list[RenderedDoc], tokenizer, config: SpansConfig
) -> tuple[list[TokenizedDoc], list[tuple[str, str]], int, Literal["hf", "tiktoken"], int]:
    """The kept documents, the rejected ones as `(source, reason)`, the number truncated, the backend, and the number
    of documents that repeat an earlier one's text and spans (tokenized once; each keeps its own source and tag).

    The index drops such repeats as duplicates anyway, but only after every one was tokenized: on chat data
    scraped from the web a large share of records can be exact copies.
    """
    backend = _fast_backend(tokenizer)
    bos_id = tokenizer.bos_token_id if config.bos == "auto" and _adds_bos(tokenizer) else None
    eos_id = tokenizer.eos_token_id
    if config.eos != "never" and eos_id is None:
        raise ValueError(f"eos: policy {config.eos!r} needs an eos_token, and the tokenizer has none; use eos='never'")
    stops = _end_of_turn_ids(tokenizer) if eos_id is not None else frozenset()
    # Each doc's position among the distinct (text, spans); the dict holds references to the docs' own strings.
    position: dict[tuple[str, tuple[tuple[int, int], ...]], int] = {}
    unique: list[RenderedDoc] = []
    for doc in docs:
        key = (doc.text, doc.train_char_spans)
        if key not in position:
            position[key] = len(unique)
            unique.append(doc)
    fast = _fast_encoder(unique, tokenizer, backend, config.tokenizer_backend)
    results: list[_Tokenized] = []
    for doc, (ids, offsets) in zip(unique, _encodings(unique, backend, fast, config.batch_size), strict=True):
        results.append(_finish(doc, ids, offsets, config, bos_id, eos_id, stops))
    out: list[TokenizedDoc] = []
    rejected: list[tuple[str, str]] = []
    truncated = 0
    for doc in docs:
        result = results[position[(doc.text, doc.train_char_spans)]]
        if result.reject is not None:
            rejected.append((doc.source, result.reject))
            continue
        truncated += result.truncated
        out.append(TokenizedDoc(result.ids, result.spans_S2, doc.source, doc.tag))
    return out, rejected, truncated, "hf" if fast is None else "tiktoken", len(docs) - len(unique)


def _finish(
    doc: RenderedDoc, ids, offsets, config: SpansConfig, bos_id: int | None, eos_id: int | None, stops
) -> _Tokenized:
    """One document's ids and offsets → its trained mask, BOS/EOS and length policies applied."""
    mask = token_mask(offsets, doc.train_char_spans, len(doc.text))
    add_eos = eos_id is not None and _adds_eos(config.eos, doc.text, ids, offsets, mask, eos_id, stops)
    if bos_id is not None and (len(ids) == 0 or ids[0] != bos_id):
        ids = np.concatenate(([bos_id], ids))
        mask = np.concatenate(([False], mask))
    if add_eos:
        ids = np.concatenate((ids, [eos_id]))
        mask = np.concatenate((mask, [True]))
    if not mask.any():
        return _Tokenized(None, None, reject="no_trained_tokens")
    truncated = False
    if config.max_length is not None and len(ids) > config.max_length:
        if config.length_policy == "drop" or not mask[: config.max_length].any():
            return _Tokenized(None, None, reject="too_long")
        ids, mask = ids[: config.max_length], mask[: config.max_length]
        truncated = True
    return _Tokenized(ids, mask_to_spans(mask), truncated)


def tokenize_docs(docs: list[RenderedDoc], tokenizer, config: SpansConfig) -> tuple[list[TokenizedDoc], dict[str, int]]:
    """Tokenize rendered docs; return the kept docs and the count of rejected docs per reason.

    Reasons: `no_trained_tokens`, `too_long` (dropped, or nothing trained left after truncation).
    """
    out, rejected, _, _, _ = _tokenize(docs, tokenizer, config)
    return out, dict(Counter(reason for _, reason in rejected))


# transformers imports its modules lazily, and not thread-safely: two shards tokenized at once on the thread runner,
# the first to import it, fail with "cannot import name 'AutoTokenizer' from 'transformers'". Loading is serialised.
_TRANSFORMERS_LOCK = threading.Lock()


def _load_tokenizer(tokenizer_or_path):
    if isinstance(tokenizer_or_path, (str, Path)):
        with _TRANSFORMERS_LOCK:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(tokenizer_or_path))
    return tokenizer_or_path


def tokenize_rendered_shard(
    rendered_jsonl_path: str | Path, tokenizer_path, config: SpansConfig, out_path: str | Path
) -> TokenizeStats:
    """Tokenize a rendered JSONL shard into an `.npz` (no pickle) of CSR arrays; written atomically.

    Arrays: `input_ids` int32 (N,), `doc_ptr` int64 (D+1,), `loss_spans` int32 (S, 2) relative to each doc,
    `span_ptr` int64 (D+1,), `sources` uint8 (UTF-8 JSON list of `file:line` strings), `format_version` int64 (1,),
    and `tags` uint8 (a UTF-8 JSON list of each document's tag or null) when a document has a tag.
    `tokenizer_path` may also be a loaded fast tokenizer.
    """
    from sftflow.tasks.data.render import read_rendered_shard

    tokenizer = _load_tokenizer(tokenizer_path)
    docs, rejects, truncated, backend, repeats = _tokenize(read_rendered_shard(rendered_jsonl_path), tokenizer, config)
    out_path = Path(out_path)
    rejects_path = None
    if rejects:  # every rejected document by its source, so that it can be found
        rejects_path = out_path.with_name(out_path.name + ".rejects.jsonl")
        with atomic_writer(rejects_path) as f:
            for source, reason in rejects:
                f.write((json.dumps({"source": source, "reason": reason}, ensure_ascii=False) + "\n").encode())
    lengths = np.array([len(d.input_ids) for d in docs], dtype=np.int64)
    span_counts = np.array([len(d.loss_spans_S2) for d in docs], dtype=np.int64)
    doc_ptr = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    span_ptr = np.concatenate(([0], np.cumsum(span_counts))).astype(np.int64)
    input_ids = np.concatenate([d.input_ids for d in docs]).astype(np.int32) if docs else np.zeros(0, np.int32)
    loss_spans = np.concatenate([d.loss_spans_S2 for d in docs]) if docs else np.zeros((0, 2), np.int32)
    sources = np.frombuffer(json.dumps([d.source for d in docs], ensure_ascii=False).encode(), dtype=np.uint8)
    tags = [d.tag for d in docs]
    extra = {}
    if any(t is not None for t in tags):
        extra["tags"] = np.frombuffer(json.dumps(tags, ensure_ascii=False).encode(), dtype=np.uint8)
    with atomic_writer(out_path) as f:
        np.savez(
            f,
            **extra,
            input_ids=input_ids,
            doc_ptr=doc_ptr,
            loss_spans=loss_spans.astype(np.int32).reshape(-1, 2),
            span_ptr=span_ptr,
            sources=sources,
            format_version=np.array([SHARD_FORMAT_VERSION], dtype=np.int64),
        )
    return TokenizeStats(
        out_path=str(out_path),
        docs=len(docs),
        tokens=int(lengths.sum()),
        loss_tokens=int(sum(d.loss_token_count for d in docs)),
        truncated=truncated,
        rejected=dict(Counter(reason for _, reason in rejects)),
        tokenizer_backend=backend,
        rejects_path=str(rejects_path) if rejects_path is not None else None,
        repeated_docs=repeats,
    )


def load_tokenized_shard(path: str | Path) -> list[TokenizedDoc]:
    """Read a shard written by `tokenize_rendered_shard` back into `TokenizedDoc`s (int64 ids)."""
    with np.load(path, allow_pickle=False) as shard:
        version = int(shard["format_version"][0])
        if version != SHARD_FORMAT_VERSION:
            raise ValueError(f"{path}: tokenized shard format version {version}; expected {SHARD_FORMAT_VERSION}")
        input_ids = shard["input_ids"].astype(np.int64)
        doc_ptr, span_ptr, loss_spans = shard["doc_ptr"], shard["span_ptr"], shard["loss_spans"]
        sources = json.loads(shard["sources"].tobytes().decode("utf-8"))
        tags = json.loads(shard["tags"].tobytes().decode("utf-8")) if "tags" in shard.files else [None] * len(sources)
    return [
        TokenizedDoc(
            input_ids=input_ids[doc_ptr[i] : doc_ptr[i + 1]],
            loss_spans_S2=loss_spans[span_ptr[i] : span_ptr[i + 1]],
            source=sources[i],
            tag=tags[i],
        )
        for i in range(len(sources))
    ]
