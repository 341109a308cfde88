"""spans: token ids and loss spans, checked against Hugging Face's assistant masks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.data.formats import RecordError, normalize_record
from sftflow.tasks.data.records import RenderedDoc
from sftflow.tasks.data.render import RenderConfig, render_record
from sftflow.tasks.data.spans import (
    SpansConfig,
    load_tokenized_shard,
    mask_to_spans,
    text_batches,
    token_mask,
    tokenize_docs,
    tokenize_rendered_shard,
)

RAW = SpansConfig(bos="never", eos="never")

CONVERSATIONS = {
    "multi_turn": {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 + 30?"},
            {"role": "assistant", "content": "The answer is 42."},
            {"role": "user", "content": "Reverse 'hello'."},
            {"role": "assistant", "content": "'olleh'"},
        ]
    },
    "tool_call": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees."},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    },
    "unicode": {
        "messages": [
            {"role": "user", "content": "Ünïcödé: naïve café, 日本語のテキスト?"},
            {"role": "assistant", "content": "emoji 🙂🚀, Ελληνικά, русский. 日本語"},
            {"role": "user", "content": "  spaces\t\tand\n\nnewlines  "},
            {"role": "assistant", "content": " leading space and trailing \n"},
        ]
    },
}


def _hf(tokenizer, record):
    out = tokenizer.apply_chat_template(
        record["messages"],
        tools=record.get("tools"),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _ours(tokenizer, record, template_text):
    template = ChatTemplate(template_text, tokenizer.special_tokens_map)
    doc = render_record(record, template, RenderConfig(), "mem:1")
    [tokenized], rejected = tokenize_docs([doc], tokenizer, RAW)
    assert rejected == {}
    return list(tokenized.input_ids), list(tokenized.loss_mask())


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_hugging_face_on_tiny_tokenizer(tiny_tokenizer, name):
    record = CONVERSATIONS[name]
    ids, mask = _ours(tiny_tokenizer, record, tiny_tokenizer.chat_template)
    hf_ids, hf_mask = _hf(tiny_tokenizer, record)
    assert ids == hf_ids
    assert mask == hf_mask
    assert sum(mask) > 0


def _shared_records(shared_data):
    records = list(CONVERSATIONS.values())
    for rel, limit in [
        ("datasets/glaive-toolcall-en-demo/glaive_toolcall_en_demo.json", 12),
        ("datasets/fastchat-dummy-conversation/dummy_conversation.json", 6),
    ]:
        path = shared_data / rel
        if path.exists():
            for i, raw in enumerate(json.loads(path.read_text())[:limit]):
                conv = normalize_record(raw, "sharegpt", f"{rel}:{i}")
                records.append({"messages": conv.messages, "tools": conv.tools})
    path = shared_data / "datasets/sharegpt-zh-1k/sharegpt_zh_1K_format.jsonl"
    if path.exists():
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()[:8]):
            try:
                conv = normalize_record(json.loads(line), "sharegpt", f"zh:{i}")
            except RecordError:
                continue
            records.append({"messages": conv.messages, "tools": conv.tools})
    return records


def test_matches_hugging_face_on_shared_tokenizers_and_templates(shared_data):
    from transformers import AutoTokenizer

    index = json.loads((shared_data / "templates/index.json").read_text())
    templates = [e["file"] for e in index if e.get("has_generation_tags")]
    tokenizer_dirs = sorted(p for p in (shared_data / "tokenizers").iterdir() if p.is_dir())
    assert templates and tokenizer_dirs
    records = _shared_records(shared_data)
    compared = 0
    for tokenizer_dir in tokenizer_dirs:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        for file in templates:
            text = (shared_data / "templates" / file).read_text()
            tokenizer.chat_template = text
            for record in records:
                try:
                    ours = _ours(tokenizer, record, text)
                except RecordError as err:  # the template refuses this conversation (e.g. gemma: no system role)
                    assert "template failed to render" in str(err)
                    with pytest.raises(Exception):  # noqa: B017 - Hugging Face raises the template's own error
                        _hf(tokenizer, record)
                    continue
                assert ours == _hf(tokenizer, record), (tokenizer_dir.name, file, record["messages"][0])
                compared += 1
    assert compared > 50


def _trimming_tokenizer(tiny_tokenizer_dir):
    """The tiny tokenizer with a byte-level post-processor that trims whitespace out of token offsets."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    backend.post_processor = processors.ByteLevel(trim_offsets=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


def test_trimmed_offsets_where_hugging_face_leaves_a_character_in_no_token(tiny_tokenizer, tiny_tokenizer_dir):
    """HF maps spans through trimmed offsets, so a trained leading space can leave its token untrained.

    The token holding the space before "answer" has trimmed offsets that start after the space. The trained span
    below is exactly that space: the token holds a trained character, so we train it (as HF does with untrimmed
    offsets), while HF's rule over the trimmed offsets trains nothing.
    """
    trimming = _trimming_tokenizer(tiny_tokenizer_dir)
    text = "The answer is 42."
    encoding = trimming(text, add_special_tokens=False, return_offsets_mapping=True)
    plain = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == plain["input_ids"]
    assert encoding["offset_mapping"] != plain["offset_mapping"], "the post-processor should trim offsets"
    space = text.index(" answer")
    doc = RenderedDoc(text=text, train_char_spans=((space, space + 1),), source="t:1")
    [ours], _ = tokenize_docs([doc], trimming, RAW)
    [reference], _ = tokenize_docs([doc], tiny_tokenizer, RAW)
    assert list(ours.loss_mask()) == list(reference.loss_mask())
    trained = [tiny_tokenizer.decode([int(i)]) for i, m in zip(ours.input_ids, ours.loss_mask(), strict=True) if m]
    assert len(trained) == 1 and trained[0].startswith(" ")  # the one token holding the space
    # What HF's rule gives on the trimmed offsets: nothing.
    offsets = np.asarray(encoding["offset_mapping"])
    hf_rule = (offsets[:, 0] < space + 1) & (offsets[:, 1] > space)
    assert not hf_rule.any()


def test_token_mask_rules():
    # Overlapping offsets (byte-fallback pieces of one character) are all trained when the character is.
    offsets = np.array([[0, 2], [2, 3], [2, 3], [2, 3], [3, 5]])
    assert token_mask(offsets, [(2, 3)], 5).tolist() == [False, True, True, True, False]
    # A zero-width token is trained only strictly inside a span (HF: s < a < e).
    offsets = np.array([[0, 2], [2, 2], [2, 4], [4, 4]])
    assert token_mask(offsets, [(0, 4)], 4).tolist() == [True, True, True, False]
    assert token_mask(offsets, [(2, 4)], 4).tolist() == [False, False, True, False]
    assert token_mask(offsets, [], 4).tolist() == [False] * 4
    assert mask_to_spans(np.array([1, 1, 0, 1, 0, 0, 1])).tolist() == [[0, 2], [3, 4], [6, 7]]


def _bos_tokenizer(tiny_tokenizer_dir):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    bos_id = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>")


def _doc(text, spans):
    return RenderedDoc(text=text, train_char_spans=tuple(spans), source="t:1")


def test_bos_policy(tiny_tokenizer, tiny_tokenizer_dir):
    adds_bos = _bos_tokenizer(tiny_tokenizer_dir)
    bos = adds_bos.bos_token_id
    plain, prefixed = _doc("Hi there", [(0, 8)]), _doc("<s>Hi there", [(3, 11)])
    (a, b), _ = tokenize_docs([plain, prefixed], adds_bos, SpansConfig(bos="auto", eos="never"))
    assert a.input_ids[0] == bos and a.loss_mask()[0] == 0
    assert b.input_ids[0] == bos and b.input_ids[1] != bos  # never two
    assert list(a.input_ids) == list(b.input_ids)
    (c,), _ = tokenize_docs([plain], adds_bos, SpansConfig(bos="never", eos="never"))
    assert c.input_ids[0] != bos
    # The tiny tokenizer declares <s> but never adds it itself, so `auto` leaves it out.
    (d,), _ = tokenize_docs([plain], tiny_tokenizer, SpansConfig(bos="auto", eos="never"))
    assert d.input_ids[0] != tiny_tokenizer.bos_token_id


def test_eos_policy(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    chat = _doc("<|im_start|>assistant\nHi<|im_end|>\n", [(22, 34)])  # ends in an untrained newline
    ends_with_eos = _doc("Hi<|im_end|>", [(0, 12)])
    trained_tail = _doc("Q: 2+2? A: 4", [(11, 12)])
    docs = [chat, ends_with_eos, trained_tail]
    base, _ = tokenize_docs(docs, tiny_tokenizer, RAW)

    def added(config):
        out, _ = tokenize_docs(docs, tiny_tokenizer, config)
        for before, after in zip(base, out, strict=True):
            assert list(after.input_ids[: len(before.input_ids)]) == list(before.input_ids)
        return [len(o.input_ids) - len(b.input_ids) for o, b in zip(out, base, strict=True)], out

    assert added(SpansConfig(bos="never", eos="never"))[0] == [0, 0, 0]
    counts, out = added(SpansConfig(bos="never", eos="auto"))
    assert counts == [0, 0, 1]
    assert out[2].input_ids[-1] == eos and out[2].loss_mask()[-1] == 1
    counts, out = added(SpansConfig(bos="never", eos="always"))
    assert counts == [0, 0, 1]  # the chat's last visible token is EOS already: a second would double the stop
    assert out[2].input_ids[-1] == eos and out[2].loss_mask()[-1] == 1
    prose = _doc("A closing line.\n", [(0, 16)])
    (before,), _ = tokenize_docs([prose], tiny_tokenizer, RAW)
    (after,), _ = tokenize_docs([prose], tiny_tokenizer, SpansConfig(bos="never", eos="always"))
    assert after.input_ids.tolist() == [*before.input_ids.tolist(), eos]


def test_length_policies_and_rejects(tiny_tokenizer):
    long_answer = _doc("Q? " + "The answer is 42. " * 5, [(3, 93)])
    late_answer = _doc("The quick brown fox jumps over the lazy dog. A: 42", [(47, 50)])
    untrained = _doc("nothing to learn here", [])
    docs = [long_answer, late_answer, untrained]
    full, rejected = tokenize_docs(docs, tiny_tokenizer, RAW)
    assert rejected == {"no_trained_tokens": 1} and len(full) == 2
    assert min(len(d.input_ids) for d in full) > 4
    late_start = int(full[1].loss_spans_S2[0, 0])
    assert late_start >= 4

    kept, rejected = tokenize_docs(docs, tiny_tokenizer, SpansConfig(bos="never", eos="never", max_length=4))
    assert kept == [] and rejected == {"no_trained_tokens": 1, "too_long": 2}

    config = SpansConfig(bos="never", eos="never", max_length=4, length_policy="truncate")
    kept, rejected = tokenize_docs(docs, tiny_tokenizer, config)
    assert rejected == {"no_trained_tokens": 1, "too_long": 1}  # the late answer has nothing trained in 4 tokens
    assert [len(d.input_ids) for d in kept] == [4]
    assert list(kept[0].input_ids) == list(full[0].input_ids[:4])
    assert kept[0].loss_spans_S2.tolist() == full[0].loss_spans_S2.clip(max=4).tolist()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_character_spans_round_trip_on_token_boundaries(tiny_tokenizer, data):
    words = ["hello", " world", " 42", "日本語", " 🙂", "\n", " café", '{"a": 1}', "<|im_end|>", " the"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), min_size=1, max_size=20)))
    encoding = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    # Token boundaries that are character boundaries (multi-token characters share offsets).
    cuts = sorted({0, len(text)} | {s for s, _ in offsets if all(not (a < s < b) for a, b in offsets)})
    picks = data.draw(st.lists(st.sampled_from(cuts), max_size=6))
    bounds = sorted(set(picks))
    spans = [(bounds[i], bounds[i + 1]) for i in range(0, len(bounds) - 1, 2)]
    record = {"text": text, "spans": [list(s) for s in spans]}
    doc = render_record(record, None, RenderConfig(), "t:1")
    out, rejected = tokenize_docs([doc], tiny_tokenizer, RAW)
    expected = "".join(text[s:e] for s, e in spans)
    if not expected:
        assert rejected == {"no_trained_tokens": 1}
        return
    [tokenized] = out
    assert list(tokenized.input_ids) == ids
    pieces = [tiny_tokenizer.decode(tokenized.input_ids[s:e].tolist()) for s, e in tokenized.loss_spans_S2]
    assert "".join(pieces) == expected


def test_npz_shard_round_trip(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    rendered = tmp_path / "r.jsonl"
    docs = [
        _doc("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n", [(44, 60)]),
        _doc("nothing", []),
        _doc("Ünïcödé 日本語 🙂", [(0, 7), (8, 11)]),
    ]
    with open(rendered, "w") as f:
        for i, d in enumerate(docs):
            row = {"text": d.text, "train_char_spans": [list(s) for s in d.train_char_spans], "source": f"src:{i + 1}"}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    config = SpansConfig(bos="never", eos="auto")
    stats = tokenize_rendered_shard(rendered, tiny_tokenizer_dir, config, tmp_path / "out" / "t.npz")
    expected, rejected = tokenize_docs(docs, tiny_tokenizer, config)
    assert stats.docs == 2 and stats.rejected == rejected == {"no_trained_tokens": 1}
    assert stats.tokens == sum(len(d.input_ids) for d in expected)
    assert stats.loss_tokens == sum(d.loss_token_count for d in expected)
    with np.load(stats.out_path, allow_pickle=False) as shard:
        assert shard["input_ids"].dtype == np.int32 and shard["loss_spans"].dtype == np.int32
        assert shard["doc_ptr"].tolist()[-1] == stats.tokens
    loaded = load_tokenized_shard(stats.out_path)
    assert [d.source for d in loaded] == ["src:1", "src:3"]
    listed = [json.loads(line) for line in Path(stats.rejects_path).read_text().splitlines()]
    assert listed == [{"source": "src:2", "reason": "no_trained_tokens"}]  # a rejected document can be found
    for a, b in zip(loaded, expected, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_spans_S2.tolist() == b.loss_spans_S2.tolist()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t.npz", "t.npz.rejects.jsonl"]


def test_repeated_documents_are_tokenized_once_with_the_same_output(tmp_path, tiny_tokenizer, tiny_tokenizer_dir):
    """A document whose text and spans repeat an earlier one's reuses its tokens; each keeps its own source and tag,
    and the shard is what tokenizing every document alone gives (repeated rejects included)."""
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    long = "Q? " + "The answer is 42. " * 5
    docs = [
        _doc(chat, [(44, 60)]),
        _doc("nothing", []),
        _doc(long, [(3, 93)]),
        RenderedDoc(chat, ((44, 60),), "", tag="b"),  # a repeat with another tag
        _doc(chat, [(44, 50)]),  # same text, other spans: not a repeat
        _doc("nothing", []),
        _doc(long, [(3, 93)]),
        _doc(chat, [(44, 60)]),
    ]
    rendered = tmp_path / "r.jsonl"
    with open(rendered, "w") as f:
        for i, d in enumerate(docs):
            row = {"text": d.text, "train_char_spans": [list(s) for s in d.train_char_spans], "source": f"src:{i + 1}"}
            f.write(json.dumps(row | ({"tag": d.tag} if d.tag else {}), ensure_ascii=False) + "\n")
    config = SpansConfig(bos="never", eos="auto", max_length=12, length_policy="truncate")
    stats = tokenize_rendered_shard(rendered, tiny_tokenizer_dir, config, tmp_path / "t.npz")

    assert stats.repeated_docs == 4
    alone = [tokenize_docs([d], tiny_tokenizer, config)[0] for d in docs]  # one call each: nothing to reuse
    expected = [(f"src:{i + 1}", d.tag, out[0]) for i, (d, out) in enumerate(zip(docs, alone, strict=True)) if out]
    loaded = load_tokenized_shard(stats.out_path)
    assert [(d.source, d.tag) for d in loaded] == [(s, t) for s, t, _ in expected]
    for got, (_, _, want) in zip(loaded, expected, strict=True):
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.loss_spans_S2.tolist() == want.loss_spans_S2.tolist()
    assert stats.truncated == 6 and stats.rejected == {"no_trained_tokens": 2}  # each repeat counted
    listed = [json.loads(line)["source"] for line in Path(stats.rejects_path).read_text().splitlines()]
    assert listed == ["src:2", "src:6"]  # every repeat of a rejected document is listed by its own line


def test_spans_config_validation_names_the_field(tiny_tokenizer):
    with pytest.raises(pydantic.ValidationError, match="max_length"):
        SpansConfig(max_length=0)
    with pytest.raises(pydantic.ValidationError, match="eos"):
        SpansConfig(eos="sometimes")
    with pytest.raises(pydantic.ValidationError, match="length_policy"):
        SpansConfig(length_policy="wrap")


# Real tokenizers and templates from ../shared/data: (tokenizer folder, template file or None for the tokenizer's own,
# mask policy). Each template ends an assistant turn with a stop and a newline.
STOP_CASES = [
    ("smollm2-135m-chatml", "trl-qwen2_5_training.jinja", "generation"),
    ("smollm2-135m-chatml", None, "roles"),
    ("smollm2-135m-chatml", "smollm2-trl-chatml.jinja", "roles"),
    ("tinyllama-1.1b-chat-v1.0", None, "roles"),
]
STOP_RECORD = {
    "messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
}


@pytest.mark.parametrize(("folder", "template_file", "policy"), STOP_CASES)
@pytest.mark.parametrize("eos", ["auto", "always"])
def test_a_trained_stop_is_never_doubled(folder, template_file, policy, eos, shared_data):
    from transformers import AutoTokenizer

    from sftflow.tasks.data.spans import _end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / folder)
    if template_file is None:
        template = ChatTemplate(tokenizer.chat_template, dict(eos_token=tokenizer.eos_token, bos_token="<s>"))
    else:
        text = (shared_data / "templates" / template_file).read_text()
        template = ChatTemplate(text, dict(eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token or ""))
    doc = render_record(STOP_RECORD, template, RenderConfig(mask_policy=policy), "chat.jsonl:1")
    (out,), _ = tokenize_docs([doc], tokenizer, SpansConfig(bos="never", eos=eos))
    ids, mask = out.input_ids.tolist(), out.loss_mask().astype(bool).tolist()
    stops = _end_of_turn_ids(tokenizer)
    # Each trained run (one assistant turn) holds exactly one stop, and no stop follows it: the model learns to say
    # its stop once. The last turn ends the record, so it teaches the stop too.
    runs = mask_to_spans(np.asarray(mask)).tolist()
    assert len(runs) == 2
    for start, end in runs:
        assert sum(i in stops for i in ids[start:end]) == 1, tokenizer.convert_ids_to_tokens(ids[start:end])
    assert sum(i in stops for i in ids[runs[-1][0] :]) == 1, tokenizer.convert_ids_to_tokens(ids[runs[-1][0] :])


def test_eos_auto_masks_equal_hugging_face_on_a_tagged_template(shared_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "smollm2-135m-chatml")
    text = (shared_data / "templates" / "trl-qwen2_5_training.jinja").read_text()
    template = ChatTemplate(text, dict(eos_token=tokenizer.eos_token))
    doc = render_record(STOP_RECORD, template, RenderConfig(), "chat.jsonl:1")
    (out,), _ = tokenize_docs([doc], tokenizer, SpansConfig(bos="never"))  # eos: auto, the default
    hf = tokenizer.apply_chat_template(
        STOP_RECORD["messages"], chat_template=text, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert out.input_ids.tolist() == hf["input_ids"]
    assert out.loss_mask().tolist() == hf["assistant_masks"]


def test_text_batches_bound_both_the_number_of_texts_and_their_characters():
    """The tokenizer's memory grows with a call's text, not its count: a few huge documents get calls of their own."""
    texts = ["a" * 5, "b" * 5, "c" * 20, "d", "e", "f"]
    assert list(text_batches(texts, batch_size=2, max_chars=12)) == [texts[0:2], texts[2:3], texts[3:5], texts[5:6]]
    assert list(text_batches(texts, batch_size=256, max_chars=12)) == [texts[0:2], texts[2:3], texts[3:6]]
    assert list(text_batches([], batch_size=2)) == []
