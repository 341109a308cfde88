"""A tiktoken encoder that reproduces a Hugging Face byte-level BPE tokenizer exactly: ids and character offsets.

tiktoken's BPE, one thread, is ~4x faster than `tokenizers`' `encode_batch` on chat text, and the spans stage spends
most of its time tokenizing. `FastBPE.from_tokenizer` accepts only structures it reproduces; anything else returns
None, and `why_unsupported` says why:

- model: BPE without dropout, byte fallback or subword prefix/suffix, each merge making a distinct token, so that
  tiktoken's rank of a token (bytes 0..255, then 256 + its merge index) is HF's merge priority;
- no normalizer (tiktoken does not normalize), no truncation or padding;
- pre-tokenizer: ByteLevel with its regex; Digits(individual_digits) then ByteLevel; or Split(regex, Isolated) then
  ByteLevel without regex (Llama-3 style). Each becomes one tiktoken pattern;
- added tokens without lstrip/rstrip/single_word; they are split out of the text first, as HF does (by
  tiktoken itself when its leftmost-first special-token match gives the same split);
- post-processor: none, TemplateProcessing (a no-op without special tokens), or ByteLevel, whose `trim_offsets` is
  reproduced.

`FastBPE.encode` returns None for a text it cannot reproduce (a byte missing from the vocabulary, a character newer
than this Python's Unicode tables, a lone surrogate); the caller encodes that text with HF.

tiktoken merges two adjacent tokens whenever their bytes form a token, while HF merges only the listed pair, and a
token can have other two-token splits (35,684 of SmolLM2's do). A merged token that HF's merges cannot build from its
own text makes them differ, so such tokenizers are refused. With that check no difference has been found (every code
point in several contexts, 2.2M tokens of sharegpt-zh-1k, all short strings over random merge lists), but it is not
proven sufficient, so callers verify a sample against HF (`sftflow.tasks.data.spans` does, per shard).
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version

import numpy as np

# HF's ByteLevel regex, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, in the form
# tiktoken uses for GPT-2 (~15% faster, same pieces): nothing follows a branch, so possessive quantifiers change no
# match, and the last `\s+` is reached only for a single whitespace character before a non-space.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Digits(individual_digits) first cuts the text at every digit, then the GPT-2 regex runs on each non-digit run. In
# one pass: a digit is always its own piece, and a digit ends a run, so `\s+(?!\S)` must accept one after it as it
# accepts the end of the text.
DIGITS_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""

# Rust's `char::is_whitespace` (Unicode White_Space), which HF's offset trimming counts besides the byte-level space.
_WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
_BYTE_LEVEL_SPACE = "\u0120"  # "Ġ"


@cache
def _byte_level_chars() -> tuple[str, ...]:
    """GPT-2's byte → printable character map, indexed by byte value."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(0x100 + i) for i, b in enumerate(others)})
    return tuple(chars[b] for b in range(256))


@cache
def _unassigned_code_points() -> np.ndarray:
    r"""Code points that this Python's Unicode tables leave unassigned, as a bool table over all code points.

    Each engine involved carries its own Unicode version (Oniguruma in HF's regexes, Rust's `char` tables in its
    Digits pre-tokenizer, fancy-regex in tiktoken), and they disagree on recently assigned characters: Unicode 17's
    Tolong Siki digits (U+11DE0..) are digits to HF's Digits but not to tiktoken's `\p{N}`. A text with a character
    newer than these tables goes to HF; this assumes each engine knows at least this Python's Unicode version.
    """
    return np.fromiter((unicodedata.category(chr(c)) == "Cn" for c in range(0x110000)), dtype=bool, count=0x110000)


def _edge_spaces(token: str) -> tuple[int, int]:
    """Leading and trailing characters HF's `process_offsets` trims from a token's offsets."""

    def is_space(c: str) -> bool:
        return c == _BYTE_LEVEL_SPACE or c in _WHITE_SPACE

    lead = next((i for i, c in enumerate(token) if not is_space(c)), len(token))
    trail = next((i for i, c in enumerate(reversed(token)) if not is_space(c)), len(token))
    return lead, trail


def _pattern(pre_tokenizer: dict | None) -> str:
    """The tiktoken pattern equal to the pre-tokenizer's splits; ValueError names what is not reproduced."""

    def byte_level(p: dict, use_regex: bool) -> bool:
        return p.get("type") == "ByteLevel" and p.get("use_regex", True) == use_regex and not p.get("add_prefix_space")

    if pre_tokenizer is None:
        raise ValueError("no pre-tokenizer")
    if byte_level(pre_tokenizer, use_regex=True):
        return GPT2_PATTERN
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else None
    if steps and len(steps) == 2:
        first, second = steps
        if first.get("type") == "Digits" and first.get("individual_digits") and byte_level(second, use_regex=True):
            return DIGITS_GPT2_PATTERN
        split = first.get("type") == "Split" and first.get("behavior") == "Isolated" and not first.get("invert")
        if split and "Regex" in first.get("pattern", {}) and byte_level(second, use_regex=False):
            return first["pattern"]["Regex"]
    raise ValueError(f"pre-tokenizer {json.dumps(pre_tokenizer)[:200]} is not one of the byte-level forms reproduced")


def _trimming(post_processor: dict | None) -> tuple[bool, bool]:
    """(trim offsets, with add_prefix_space) for the post-processor; ValueError when its offsets are not reproduced."""
    steps = [post_processor] if post_processor is not None else []
    if steps and steps[0].get("type") == "Sequence":
        steps = steps[0]["processors"]
    trims = []
    for step in steps:
        if step.get("type") == "ByteLevel":
            if step.get("trim_offsets", True):
                trims.append(bool(step.get("add_prefix_space", True)))
        elif step.get("type") != "TemplateProcessing":  # adds nothing without special tokens
            raise ValueError(f"post-processor {step.get('type')} is not reproduced")
    if len(trims) > 1:
        raise ValueError("more than one offset-trimming post-processor")
    return bool(trims), bool(trims and trims[0])


def _not_self_producible(spec: dict, tokens: list[str]) -> list[str]:
    """Tokens that HF's merges do not build from their own text.

    tiktoken merges any two adjacent tokens whose bytes form a token (and emits a whole piece that is a token as
    is), while HF applies only the listed merge pairs. Such a token would come out of tiktoken but not out of HF's
    merges, in a piece of its own or inside a longer one (with ignore_merges=True too: " abcd" is not in the
    vocabulary, so HF merges it). SmolLM2's 17 vocabulary entries that HF cannot build are made by no merge, so they
    are not ranked and not checked here: neither side produces them from text (they are its added tokens).
    """
    from tokenizers import Tokenizer

    bare = {key: None for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding")}
    merges_only = Tokenizer.from_str(
        json.dumps({**spec, **bare, "added_tokens": [], "model": {**spec["model"], "ignore_merges": False}})
    )
    encodings = merges_only.encode_batch(tokens, add_special_tokens=False)  # each text is one word
    return [t for t, e in zip(tokens, encodings, strict=True) if len(e.ids) != 1]


def _check_ignore_merges(vocab: dict[str, int], ranked: set[str], added: list[dict]) -> None:
    """With ignore_merges=True HF emits any piece found in the vocabulary, tiktoken only ranked ones. An unranked
    entry is harmless when no piece can equal it: it is an added token (split off the text before pieces are formed)
    or it holds a character outside the byte-level alphabet."""
    byte_of = {c: b for b, c in enumerate(_byte_level_chars())}
    added_bytes = {a["content"].encode("utf-8") for a in added}
    for token in vocab:
        if token in ranked or not all(c in byte_of for c in token):
            continue
        if bytes(byte_of[c] for c in token) not in added_bytes:
            raise ValueError(f"ignore_merges=True and token {token!r} is neither made by a merge nor an added token")


def _build(spec: dict) -> FastBPE:
    import tiktoken

    if spec.get("normalizer") is not None:
        raise ValueError(f"normalizer {spec['normalizer'].get('type')} (tiktoken does not normalize)")
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"model {model.get('type')} is not BPE")
    for flag in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(flag):
            raise ValueError(f"BPE {flag}={model[flag]!r}")
    pattern = _pattern(spec.get("pre_tokenizer"))
    trim, trim_prefix_space = _trimming(spec.get("post_processor"))
    added = spec.get("added_tokens", [])
    for a in added:
        for flag in ("lstrip", "rstrip", "single_word"):
            if a.get(flag):
                raise ValueError(f"added token {a['content']!r} has {flag}=True")

    # Ranks: the 256 bytes, then one per merge in merge order, which is HF's merge priority.
    byte_of = {c: b for b, c in enumerate(_byte_level_chars())}
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    merged: list[str] = []
    merged_byte_lengths: list[int] = []
    for index, merge in enumerate(model["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        try:
            token = bytes(byte_of[c] for c in left + right)
        except KeyError:
            raise ValueError(f"merge {merge!r} is not over byte-level characters") from None
        if token in ranks:
            raise ValueError(f"merge {index} ({merge!r}) makes a token that an earlier merge already makes")
        ranks[token] = 256 + index
        merged.append(left + right)
        merged_byte_lengths.append(len(token))
    vocab: dict[str, int] = model["vocab"]
    if model.get("ignore_merges"):
        _check_ignore_merges(vocab, set(merged) | set(_byte_level_chars()), added)
    bad = _not_self_producible(spec, merged)
    if bad:
        raise ValueError(f"{len(bad)} merged tokens are not built by HF's merges from their own text, e.g. {bad[0]!r}")

    # Added tokens get ranks after the merges. HF splits the text with the non-normalized ones first, then with the
    # normalized ones, each pass leftmost-longest (longest-first alternation is that).
    texts = [*_byte_level_chars(), *merged]
    ids = [vocab.get(t, -1) for t in texts]
    byte_lengths = [1] * 256 + merged_byte_lengths
    passes = []
    for normalized in (False, True):
        group = sorted((a for a in added if bool(a.get("normalized")) == normalized), key=lambda a: -len(a["content"]))
        if group:
            pattern_re = re.compile("|".join(re.escape(a["content"]) for a in group))
            passes.append((pattern_re, {a["content"]: len(texts) + i for i, a in enumerate(group)}))
            texts += [a["content"] for a in group]
            ids += [a["id"] for a in group]
            byte_lengths += [len(a["content"].encode("utf-8")) for a in group]
    # tiktoken can split them out itself (no Python pass over the text) when one pass does and no added token
    # starts another: its leftmost-first match is then HF's leftmost-longest.
    contents = sorted(a["content"] for a in added)
    native = len(passes) == 1 and not any(b.startswith(a) for a, b in zip(contents, contents[1:], strict=False))
    try:
        encoding = tiktoken.Encoding(
            "sftflow-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=passes[0][1] if native else {}
        )
    except ValueError as err:
        raise ValueError(f"tiktoken cannot compile the pre-tokenizer regex: {err}") from None
    edges_R2 = np.array([_edge_spaces(t) for t in texts], dtype=np.int64) if trim else None
    return FastBPE(
        encoding=encoding,
        rank_to_id=np.array(ids, dtype=np.int64),
        byte_lengths=np.array(byte_lengths, dtype=np.int64),
        edge_spaces_R2=edges_R2,
        trim_prefix_space=trim_prefix_space,
        added_passes=() if native else tuple(passes),
        description=f"tiktoken {version('tiktoken')}: {len(merged)} merges, {len(added)} added tokens"
        + (", trimmed offsets" if trim else ""),
        unassigned=_unassigned_code_points(),
    )


@dataclass(frozen=True, eq=False)
class FastBPE:
    """tiktoken plus the tables that turn its ranks into HF ids and character offsets.

    Ranks below 256 + merges are tiktoken's mergeable ranks; the added tokens follow, as tiktoken special tokens or,
    when `added_passes` is not empty, split out in Python first. `edge_spaces_R2` (leading, trailing trimmable
    characters per rank) is None when the tokenizer does not trim offsets.
    """

    encoding: object  # tiktoken.Encoding
    rank_to_id: np.ndarray  # (R,) int64; -1 where the vocabulary lacks the token
    byte_lengths: np.ndarray  # (R,) int64
    edge_spaces_R2: np.ndarray | None
    trim_prefix_space: bool
    added_passes: tuple[tuple[re.Pattern, dict[str, int]], ...]
    description: str
    unassigned: np.ndarray  # (0x110000,) bool, see `_unassigned_code_points`

    @classmethod
    def from_tokenizer(cls, tokenizer) -> FastBPE | None:
        """The fast encoder for a HF fast tokenizer, or None when it cannot be exact (see `why_unsupported`)."""
        built = _analyse(tokenizer)
        return built if isinstance(built, FastBPE) else None

    def _segments(self, text: str) -> list[tuple[str, int | None]]:
        pieces: list[tuple[str, int | None]] = [(text, None)]
        for pattern, rank_of in self.added_passes:
            split: list[tuple[str, int | None]] = []
            for piece, rank in pieces:
                if rank is not None:
                    split.append((piece, rank))
                    continue
                last = 0
                for match in pattern.finditer(piece):
                    if match.start() > last:
                        split.append((piece[last : match.start()], None))
                    split.append((match.group(), rank_of[match.group()]))
                    last = match.end()
                if last < len(piece):
                    split.append((piece[last:], None))
            pieces = split
        return pieces

    def _ranks(self, text: str) -> np.ndarray:
        if not self.added_passes:
            return self.encoding.encode_to_numpy(text, allowed_special="all")  # uint32, no Python list
        ranks: list[int] = []
        for segment, rank in self._segments(text):
            if rank is None:
                ranks += self.encoding.encode_ordinary(segment)
            else:
                ranks.append(rank)
        return np.array(ranks, dtype=np.uint32)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray] | None:
        """HF's `encode(text, add_special_tokens=False)` `.ids` (int64) and `.offsets` (L, 2) in characters.

        None when this text cannot be reproduced (a token missing from the vocabulary, a lone surrogate, a character
        newer than this Python's Unicode tables, a split regex that leaves text unmatched): encode it with HF instead.
        """
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """`encode` of each text, with the numpy work done once for the whole batch rather than once per text.

        Token byte offsets come from cumulative byte lengths, within each text; character offsets from a byte →
        character index over the batch's UTF-8 bytes, where a token that starts or ends inside a character covers
        all of it, as HF's offsets do.
        """
        datas, rank_arrays = [], []
        for text in texts:
            try:
                datas.append(text.encode("utf-8"))
                rank_arrays.append(self._ranks(text))
            except UnicodeEncodeError:  # a lone surrogate
                datas.append(None)
                rank_arrays.append(np.zeros(0, np.uint32))
        usable_D = np.array([d is not None for d in datas], dtype=bool)
        byte_counts_D = np.array([len(d) if d is not None else 0 for d in datas], dtype=np.int64)
        char_counts_D = np.array([len(t) if d is not None else 0 for t, d in zip(texts, datas, strict=True)])
        token_counts_D = np.array([len(r) for r in rank_arrays], dtype=np.int64)
        rank_N = np.concatenate([np.zeros(0, np.uint32), *rank_arrays])
        doc_N = np.repeat(np.arange(len(texts)), token_counts_D)
        ids_N = self.rank_to_id[rank_N]
        lengths_N = self.byte_lengths[rank_N]
        cumulative = np.concatenate(([0], np.cumsum(lengths_N)))
        token_ptr = np.concatenate(([0], np.cumsum(token_counts_D)))
        bytes_before_D = cumulative[token_ptr[:-1]]
        covered_D = cumulative[token_ptr[1:]] - bytes_before_D

        joined = b"".join(d for d in datas if d is not None)
        joined_text = "".join(t for t, d in zip(texts, datas, strict=True) if d is not None)
        code_points = np.frombuffer(joined_text.encode("utf-32-le"), dtype=np.uint32)
        unassigned_at = np.flatnonzero(self.unassigned[code_points])
        unassigned_D = np.bincount(
            np.searchsorted(np.cumsum(char_counts_D), unassigned_at, side="right"), minlength=len(texts)
        )
        missing_D = np.bincount(doc_N[ids_N < 0], minlength=len(texts))
        valid_D = usable_D & (covered_D == byte_counts_D) & (missing_D == 0) & (unassigned_D == 0)

        keep_N = valid_D[doc_N]
        doc_K = doc_N[keep_N]
        byte_end_K = cumulative[1:][keep_N] - bytes_before_D[doc_K]  # within its text
        byte_start_K = byte_end_K - lengths_N[keep_N]
        byte_base_D = np.concatenate(([0], np.cumsum(byte_counts_D)[:-1]))
        char_base_D = np.concatenate(([0], np.cumsum(char_counts_D)[:-1]))
        index_dtype = np.int32 if len(joined) < 2**31 else np.int64  # one entry per byte: keep it small
        char_of_byte = np.cumsum((np.frombuffer(joined, dtype=np.uint8) & 0xC0) != 0x80, dtype=index_dtype) - 1
        starts = char_of_byte[byte_base_D[doc_K] + byte_start_K] - char_base_D[doc_K]
        ends = char_of_byte[byte_base_D[doc_K] + byte_end_K - 1] + 1 - char_base_D[doc_K]
        if self.edge_spaces_R2 is not None:
            first_K = np.concatenate(([True], doc_K[1:] != doc_K[:-1]))
            starts, ends = self._trim(rank_N[keep_N], first_K, starts, ends)

        cuts = np.cumsum(token_counts_D[valid_D])[:-1]
        ids = iter(np.split(ids_N[keep_N], cuts))
        offsets = iter(np.split(np.stack([starts, ends], axis=1), cuts))
        return [(next(ids), next(offsets)) if valid else None for valid in valid_D]

    def _trim(
        self, rank_K: np.ndarray, first_K: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        # tokenizers' `byte_level::process_offsets`, on character offsets; `first_K` marks each text's first token.
        lead, trail = self.edge_spaces_R2[rank_K].T
        if self.trim_prefix_space:
            lead = np.where((first_K | (starts == 0)) & (lead == 1), 0, lead)
        starts = np.minimum(starts + lead, ends)
        ends = np.where((trail > 0) & (ends >= trail), np.maximum(ends - trail, starts), ends)
        return starts, ends


_ANALYSED: dict[str, FastBPE | str] = {}
_ANALYSING = threading.Lock()  # shard tasks on the threads runner share the cache


def _analyse(tokenizer) -> FastBPE | str:
    """The encoder, or why there is none; cached per tokenizer definition (a shard task loads its own tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    # Runtime settings, not all of which the definition below records.
    if backend.truncation or backend.padding:
        return "truncation or padding is set on the tokenizer"
    if backend.encode_special_tokens:
        return "encode_special_tokens is set"
    definition = backend.to_str()
    with _ANALYSING:
        if definition not in _ANALYSED:
            try:
                _ANALYSED[definition] = _build(json.loads(definition))
            except ValueError as err:
                _ANALYSED[definition] = str(err)
            if len(_ANALYSED) > 8:
                del _ANALYSED[next(iter(_ANALYSED))]
        return _ANALYSED[definition]


def why_unsupported(tokenizer) -> str | None:
    """Why `FastBPE.from_tokenizer` returns None for this tokenizer, or None when it is supported."""
    built = _analyse(tokenizer)
    return None if isinstance(built, FastBPE) else built
