"""spans `tokenizer_backend`: tiktoken when exact, HF otherwise, and the same output whichever runs."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from sftflow.tasks.data.bpe_fast import FastBPE
from sftflow.tasks.data.records import RenderedDoc
from sftflow.tasks.data.spans import SpansConfig, tokenize_docs, tokenize_rendered_shard
from tests.tasks.data.test_bpe_fast import FIXED, PIECES

CHAT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n  The answer is 42.<|im_end|>\n"
ODD = "".join(PIECES)
DOCS = [
    RenderedDoc(text=CHAT, train_char_spans=((CHAT.index("  The"), len(CHAT) - 1),), source="mem:1"),
    *(RenderedDoc(text=t, train_char_spans=((0, len(t)),), source=f"fixed:{i}") for i, t in enumerate(FIXED) if t),
    RenderedDoc(text=ODD, train_char_spans=((3, len(ODD) // 3), (len(ODD) // 2, len(ODD))), source="pieces:1"),
]


def _arrays(docs) -> list[tuple[list[int], list[list[int]], str]]:
    return [(d.input_ids.tolist(), d.loss_spans_S2.tolist(), d.source) for d in docs]


def _nfc(tiny_tokenizer_dir):
    """The tiny tokenizer with an NFC normalizer, which tiktoken cannot reproduce."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    backend.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


@pytest.mark.parametrize("eos", ["auto", "always"])
def test_auto_and_tiktoken_equal_hf_on_the_tiny_tokenizer(tiny_tokenizer, eos):
    assert FastBPE.from_tokenizer(tiny_tokenizer) is not None
    outputs = {}
    for backend in ["hf", "auto", "tiktoken"]:
        docs, rejected = tokenize_docs(DOCS, tiny_tokenizer, SpansConfig(eos=eos, tokenizer_backend=backend))
        outputs[backend] = (_arrays(docs), rejected)
    assert outputs["auto"] == outputs["hf"] == outputs["tiktoken"]


def test_unsupported_tokenizer_falls_back_under_auto_and_errors_under_tiktoken(tiny_tokenizer_dir, tmp_path, caplog):
    tokenizer = _nfc(tiny_tokenizer_dir)
    rendered = tmp_path / "rendered.jsonl"
    rendered.write_text(
        "".join(
            json.dumps({"text": d.text, "train_char_spans": d.train_char_spans, "source": d.source}) + "\n"
            for d in DOCS
        )
    )
    with caplog.at_level(logging.INFO, logger="sftflow.tasks.data.spans"):
        auto = tokenize_rendered_shard(rendered, tokenizer, SpansConfig(), tmp_path / "auto.npz")
    assert auto.tokenizer_backend == "hf"
    hf = tokenize_rendered_shard(rendered, tokenizer, SpansConfig(tokenizer_backend="hf"), tmp_path / "hf.npz")
    assert auto.model_dump(exclude={"out_path"}) == hf.model_dump(exclude={"out_path"})
    with pytest.raises(ValueError, match=r"tokenizer_backend: tiktoken cannot reproduce .*normalizer NFC"):
        tokenize_docs(DOCS, tokenizer, SpansConfig(tokenizer_backend="tiktoken"))


def test_a_difference_in_the_checked_texts_sends_the_shard_to_hf(tiny_tokenizer, monkeypatch, caplog):
    """The per-shard check against HF: a wrong id in one checked text makes `auto` use HF for every text."""
    expected, _ = tokenize_docs(DOCS, tiny_tokenizer, SpansConfig(tokenizer_backend="hf"))
    encode_batch = FastBPE.encode_batch

    def wrong_id_in_one_text(self, texts):
        out = encode_batch(self, texts)
        return [(ids + (text == DOCS[2].text), offsets) for text, (ids, offsets) in zip(texts, out, strict=True)]

    monkeypatch.setattr(FastBPE, "encode_batch", wrong_id_in_one_text)
    with caplog.at_level(logging.WARNING, logger="sftflow.tasks.data.spans"):
        docs, _ = tokenize_docs(DOCS, tiny_tokenizer, SpansConfig())
    assert _arrays(docs) == _arrays(expected)
    assert f"{DOCS[2].source}: tiktoken and Hugging Face tokenize this text differently" in caplog.text
    with pytest.raises(ValueError, match=DOCS[2].source):
        tokenize_docs(DOCS, tiny_tokenizer, SpansConfig(tokenizer_backend="tiktoken"))


def test_shard_is_identical_on_shared_tokenizers_and_sharegpt(shared_data, tmp_path):
    """render → spans on 200 sharegpt-zh-1k conversations: every array of the shard is equal under hf and auto."""
    from sftflow.tasks.data.render import RenderConfig, render_source, resolve_template

    source = shared_data / "datasets/sharegpt-zh-1k/sharegpt_zh_1K_format.jsonl"
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(source.read_text(encoding="utf-8").splitlines()[:200]) + "\n", encoding="utf-8")
    render_config = RenderConfig(format="sharegpt", template="chatml", on_bad_record="reject")
    for tokenizer_dir in sorted(p for p in (shared_data / "tokenizers").iterdir() if p.is_dir()):
        rendered = tmp_path / tokenizer_dir.name / "rendered.jsonl"
        rendered.parent.mkdir()
        render_source(sample, rendered, render_config, resolve_template(render_config, tokenizer_dir))
        stats, shards = {}, {}
        for backend in ["hf", "auto"]:
            out = rendered.parent / f"{backend}.npz"
            stats[backend] = tokenize_rendered_shard(
                rendered, tokenizer_dir, SpansConfig(tokenizer_backend=backend), out
            )
            with np.load(out, allow_pickle=False) as shard:
                shards[backend] = {key: (shard[key].dtype, shard[key].tobytes()) for key in shard.files}
        assert shards["auto"] == shards["hf"], tokenizer_dir.name
        assert stats["auto"].tokens == stats["hf"].tokens > 0
        expected_backend = "hf" if "tinyllama" in tokenizer_dir.name else "tiktoken"
        assert stats["auto"].tokenizer_backend == expected_backend, tokenizer_dir.name


def test_the_check_looks_past_texts_that_tiktoken_hands_to_hf(tiny_tokenizer, monkeypatch, caplog):
    """Texts tiktoken gives back to HF (`None`) verify nothing: the check goes on to later texts of the shard."""
    many = [
        RenderedDoc(text=f"{CHAT} #{i}", train_char_spans=((CHAT.index("  The"), len(CHAT)),), source=f"many:{i}")
        for i in range(40)
    ]
    expected, _ = tokenize_docs(many, tiny_tokenizer, SpansConfig(tokenizer_backend="hf"))
    encode_batch = FastBPE.encode_batch
    handed_back = {doc.text for doc in many[:20]}
    wrong = many[25].text

    def first_twenty_to_hf_and_one_wrong(self, texts):
        out = encode_batch(self, texts)
        return [
            None if text in handed_back else (ours[0] + (text == wrong), ours[1])
            for text, ours in zip(texts, out, strict=True)
        ]

    monkeypatch.setattr(FastBPE, "encode_batch", first_twenty_to_hf_and_one_wrong)
    with caplog.at_level(logging.WARNING, logger="sftflow.tasks.data.spans"):
        docs, _ = tokenize_docs(many, tiny_tokenizer, SpansConfig())
    assert "many:25: tiktoken and Hugging Face tokenize this text differently" in caplog.text
    assert _arrays(docs) == _arrays(expected)
