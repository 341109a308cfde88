"""bpe_fast: tiktoken ids and character offsets equal Hugging Face's `encode(text, add_special_tokens=False)`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from sftflow.tasks.data.bpe_fast import DIGITS_GPT2_PATTERN, GPT2_PATTERN, FastBPE, why_unsupported
from tests.conftest import TINY_CORPUS

# Llama-3's split regex, one alternative per item.
LLAMA3_SPLIT = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Pieces that stress pre-tokenization and offsets: whitespace runs before digits and letters, non-ASCII digits
# (Nd, No, Nl), contractions, CJK, emoji with ZWJ and variation selectors, combining marks, added-token text.
PIECES = [
    " ", "  ", "   ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "0", "7", "42", "٣", "½", "Ⅻ", "'", "'s", "'T", "n't",
    "'ll", "日", "本語", "🙂", "👨\u200d👩\u200d👧", "🏳\ufe0f\u200d🌈", "e\u0301", "\u0301", "é", "ß", "Hello", "hello",
    "world", "the", "-", "{", '"', "...", "<|im_start|>", "<|im_end|>", "<|im_", "im_st", "<s>", "café", "русский",
]  # fmt: skip
TEXTS = st.lists(
    st.one_of(st.sampled_from(PIECES), st.text(alphabet="a1 \n'日🙂é٣\u0301\t", max_size=4)), max_size=24
).map("".join)
FIXED = [
    "",
    " ",
    "a  1 x",
    "  12  ٣٤ 5\n\n  6",
    " Hello  world 🙂x<|im_start|>im_start 123\n\n  ",
    "don't DON'T  '\t's",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n  Hello!<|im_end|>\n",
    "👨\u200d👩\u200d👧 e\u0301 日本語のテキスト",
    "\u00a0 \u3000x\u2028y   ",
]
CORPUS = TINY_CORPUS + ["".join(PIECES), " ".join(PIECES), "  1  22   333 ٣ ½ \n\n x  y", "it's we'll DON'T"]


def _same_as_hf(tokenizer, fast: FastBPE, text: str) -> None:
    reference = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    ours = fast.encode(text)
    assert ours is not None, text
    ids, offsets = ours
    assert ids.dtype == np.int64 and offsets.dtype == np.int64 and offsets.shape == (len(ids), 2)
    assert ids.tolist() == reference.ids, text
    assert [tuple(o) for o in offsets.tolist()] == reference.offsets, text


def _train(pre_tokenizer, *, ignore_merges=False, post_processor=None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    if post_processor is not None:
        tok.post_processor = post_processor
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer=trainer)
    # A normalized, non-special added token that overlaps "<|im_start|>": HF splits special tokens out first.
    tok.add_tokens([AddedToken("im_st", normalized=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict:
    """One tokenizer per reproduced structure: (a) ByteLevel regex, (b) Digits + ByteLevel, (c) Split + ByteLevel."""
    from tokenizers import Regex, pre_tokenizers, processors
    from transformers import AutoTokenizer

    from sftflow.tasks.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("gpt2")
    train_tokenizer(CORPUS * 10, out, vocab_size=600)
    digits = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return {
        "gpt2": AutoTokenizer.from_pretrained(out),
        "digits": _train(digits),
        "split": _train(split, ignore_merges=True, post_processor=processors.ByteLevel(trim_offsets=True)),
    }


def test_each_variant_is_supported_with_its_structure(variants):
    specs = {name: json.loads(t.backend_tokenizer.to_str()) for name, t in variants.items()}
    assert specs["digits"]["pre_tokenizer"]["pretokenizers"][0]["type"] == "Digits"
    assert specs["split"]["model"]["ignore_merges"] and specs["split"]["post_processor"]["type"] == "ByteLevel"
    for name, tokenizer in variants.items():
        assert why_unsupported(tokenizer) is None, name
        assert FastBPE.from_tokenizer(tokenizer) is not None


@pytest.mark.parametrize("text", FIXED)
@pytest.mark.parametrize("variant", ["gpt2", "digits", "split"])
def test_fixed_texts_match_hf(variants, variant, text):
    tokenizer = variants[variant]
    _same_as_hf(tokenizer, FastBPE.from_tokenizer(tokenizer), text)


@pytest.mark.parametrize("variant", ["gpt2", "digits", "split"])
@settings(max_examples=60, deadline=None)
@given(text=TEXTS)
def test_fuzzed_texts_match_hf(variants, variant, text):
    tokenizer = variants[variant]
    _same_as_hf(tokenizer, FastBPE.from_tokenizer(tokenizer), text)


def test_offsets_are_trimmed_only_where_hf_trims(variants):
    text = " Hello  world \n 12"
    for name, trims in [("gpt2", False), ("split", True)]:
        offsets = FastBPE.from_tokenizer(variants[name]).encode(text)[1]
        covered = offsets[:, 1] - offsets[:, 0]
        assert (covered.sum() < len(text)) == trims, name  # trimming leaves the spaces in no token


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_one_pass_patterns_split_like_hf_pre_tokenizers(text):
    """Each one-pass pattern cuts where its HF pre-tokenizers cut (Digits then ByteLevel: both in sequence)."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    digits = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    for pattern, pre_tokenizer in [(GPT2_PATTERN, byte_level), (DIGITS_GPT2_PATTERN, digits)]:
        expected = [span for _, span in pre_tokenizer.pre_tokenize_str(text)]
        assert [m.span() for m in regex.finditer(pattern, text)] == expected, text


def test_shared_tokenizers(shared_data):
    """Supported tokenizers match HF on real chat text; the others say why (TinyLlama).

    Each is checked as transformers loads it and as its tokenizer.json defines it: transformers 5 rebuilds SmolLM2
    with a plain ByteLevel pre-tokenizer, while the file has Digits then ByteLevel.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    rows = (shared_data / "datasets/sharegpt-zh-1k/sharegpt_zh_1K_format.jsonl").read_text().splitlines()[:40]
    texts = FIXED + ["\n".join(turn["value"] for turn in json.loads(row)["conversations"]) for row in rows]
    checked = 0
    for tokenizer_dir in sorted(p for p in (shared_data / "tokenizers").iterdir() if p.is_dir()):
        as_file = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")))
        for tokenizer in [AutoTokenizer.from_pretrained(tokenizer_dir), as_file]:
            fast = FastBPE.from_tokenizer(tokenizer)
            if "tinyllama" in tokenizer_dir.name:  # SentencePiece-style: "▁" normalizer, byte fallback
                assert fast is None
                assert "byte_fallback" in why_unsupported(tokenizer) or "normalizer" in why_unsupported(tokenizer)
                continue
            assert fast is not None, why_unsupported(tokenizer)
            for text in texts:
                _same_as_hf(tokenizer, fast, text)
            checked += 1
    assert checked


def test_smollm2_vocabulary_outside_the_merges_is_its_added_tokens(shared_data):
    """Why ignore_merges=False is safe for SmolLM2: the 17 tokens HF's BPE cannot build from their own text are made
    by no merge (so tiktoken never emits them either) and are all added tokens (split off before BPE runs)."""
    from tokenizers import Tokenizer

    spec = json.loads((shared_data / "tokenizers/smollm2-135m-chatml/tokenizer.json").read_text())
    model = Tokenizer.from_str(json.dumps(spec)).model
    merged = {a + b for a, b in (m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"])}
    not_self = {t for t in spec["model"]["vocab"] if len(model.tokenize(t)) != 1}
    assert not_self and not_self.isdisjoint(merged)
    assert not_self <= {a["content"] for a in spec["added_tokens"]}


def _edited(tokenizer, edit):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    edit(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def _set(path: str, value):
    def edit(spec):
        *parents, key = path.split(".")
        node = spec
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[key] = value

    return edit


@pytest.mark.parametrize(
    "edit, reason",
    [
        (_set("normalizer", {"type": "NFC"}), "normalizer"),
        (_set("model.dropout", 0.1), "dropout"),
        (_set("pre_tokenizer.add_prefix_space", True), "pre-tokenizer"),
        (_set("pre_tokenizer", {"type": "Whitespace"}), "pre-tokenizer"),
        (_set("added_tokens.0.lstrip", True), "lstrip"),
        (_set("post_processor", {"type": "BertProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]}), "BertProcessing"),
    ],
)
def test_unreproduced_structures_are_refused_with_a_reason(variants, edit, reason):
    tokenizer = _edited(variants["gpt2"], edit)
    assert FastBPE.from_tokenizer(tokenizer) is None
    assert reason in why_unsupported(tokenizer)


def _hand_made(merges: list[tuple[str, str]], ignore_merges: bool = False):
    """A ByteLevel BPE over the given merges; bytes "x" and "y" are left out of the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sftflow.tasks.data.bpe_fast import _byte_level_chars

    vocab = {c: i for i, c in enumerate(c for c in _byte_level_chars() if c not in "xy")}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("ignore_merges", [False, True])
def test_a_merged_token_that_hf_cannot_build_from_its_own_text_is_refused(ignore_merges):
    """ "ab" and "cd" form first and only ("a", "bcd") makes "abcd", so HF never builds it from text; tiktoken merges
    any two adjacent tokens whose bytes are a token, and would. ignore_merges=True only helps a whole piece."""
    tokenizer = _hand_made([("a", "b"), ("c", "d"), ("b", "cd"), ("a", "bcd")], ignore_merges)
    assert tokenizer.backend_tokenizer.encode(" abcd").tokens == ["Ġ", "ab", "cd"]
    assert "not built by HF's merges from their own text" in why_unsupported(tokenizer)


def test_text_with_a_byte_missing_from_the_vocabulary_is_left_to_hf():
    tokenizer = _hand_made([("a", "b"), ("c", "d"), ("ab", "cd")])
    fast = FastBPE.from_tokenizer(tokenizer)
    for text in ["abcd", " abcd abc bcd", "aabcdd z"]:
        _same_as_hf(tokenizer, fast, text)
    assert fast.encode("abc x") is None  # HF drops the byte; tiktoken cannot
    assert fast.encode("\ud800") is None  # a lone surrogate has no UTF-8 form


def test_added_tokens_that_start_one_another_split_leftmost_longest():
    """Two added tokens where one starts the other: HF takes the longest at the leftmost match."""
    from tokenizers import AddedToken

    tokenizer = _hand_made([("a", "b"), ("c", "d"), ("ab", "cd")])
    tokenizer.backend_tokenizer.add_tokens([AddedToken("<a>"), AddedToken("<a>b"), AddedToken("cd<")])
    fast = FastBPE.from_tokenizer(tokenizer)
    assert fast.added_passes  # split in Python, not by tiktoken's leftmost-first special-token regex
    for text in ["<a>bcd", "abcd<a>b <a> <a", "cd<a>b", "<a><a>bb"]:
        _same_as_hf(tokenizer, fast, text)


def test_characters_newer_than_pythons_unicode_tables_are_left_to_hf(variants):
    """HF's Digits (Rust's tables) and tiktoken's regex disagree on Unicode 17's Tolong Siki digit U+11DE0."""
    import unicodedata

    fast = FastBPE.from_tokenizer(variants["digits"])
    text = "a\U00011de0\U00011de0 1"
    if unicodedata.category(text[1]) != "Cn":
        pytest.skip(f"this Python's Unicode {unicodedata.unidata_version} knows U+11DE0")
    assert fast.encode(text) is None
    _same_as_hf(variants["digits"], fast, "a\u0661\u0662 1")  # Arabic-Indic digits: old, known to every engine


@pytest.mark.parametrize("variant", ["gpt2", "split"])
def test_a_batch_gives_what_each_text_gives_alone(variants, variant):
    """Texts HF must take (lone surrogate, unknown character) in the middle of a batch leave the others intact."""
    fast = FastBPE.from_tokenizer(variants[variant])
    texts = [*FIXED, "bad \ud800 surrogate", "unassigned \U000e0080 here", *PIECES, ""]
    alone = [fast.encode(t) for t in texts]
    assert alone[len(FIXED)] is None and alone[len(FIXED) + 1] is None
    for one, batched in zip(alone, fast.encode_batch(texts), strict=True):
        assert (one is None) == (batched is None)
        if one is not None:
            assert one[0].tolist() == batched[0].tolist() and one[1].tolist() == batched[1].tolist()
