"""Word n-grams of text as uint64 hashes, for the index's text filters (decontamination and near-duplicates).

Words are the `\\w+` runs of the NFKC-normalised, lower-cased text, so punctuation, spacing and case do not matter:

    "The cat, the HAT!"  ->  words  the  cat  the  hat
                         ->  word hashes  w0 w1 w0 w2           (blake2b-64 of the word's UTF-8)
                         ->  2-grams  g(w0,w1) g(w1,w0) g(w0,w2)

An n-gram's hash is `mix64(((w_0·P + w_1)·P + …)·P + w_{n-1})` in uint64 arithmetic (wrapping), computed for all
positions at once; `mix64` is splitmix64's finaliser. Everything is integer arithmetic, so the hashes are the same on
every machine.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np

_WORD = re.compile(r"\w+")
_P = np.uint64(0x100000001B3)  # an odd multiplier (FNV-1a's prime)


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    z = x.astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class WordHasher:
    """blake2b-64 per word, remembered (a corpus repeats its words)."""

    def __init__(self, max_cached: int = 1 << 21):
        self._cache: dict[str, int] = {}
        self._max = max_cached

    def __call__(self, ws: list[str]) -> np.ndarray:
        try:  # the common case once the vocabulary has been seen: one C-level pass
            return np.fromiter(map(self._cache.__getitem__, ws), dtype=np.uint64, count=len(ws))
        except KeyError:
            pass
        cache, out = self._cache, np.empty(len(ws), dtype=np.uint64)
        for i, w in enumerate(ws):
            h = cache.get(w)
            if h is None:
                h = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
                if len(cache) < self._max:
                    cache[w] = h
            out[i] = h
        return out

    def text(self, text: str) -> np.ndarray:
        """The hashes of `text`'s words, in order."""
        return self(words(text))


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of every n-gram, in order of position (empty when there are fewer than n words)."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    acc = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc = acc * _P + word_hashes[j : j + count]
    return mix64(acc)


def distinct_ngrams(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """The distinct n-gram hashes of a text's word hashes, sorted."""
    return np.unique(ngram_hashes(word_hashes, n))
