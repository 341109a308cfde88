"""Near-duplicate documents by MinHash and LSH, with numpy only.

A document's shingles are its word `shingle`-grams (`sftflow.tasks.data.ngrams`; a text shorter than that is one
shingle of all its words). Its MinHash signature holds, for each of `num_perm` seeded hash functions
`h_k(x) = a_k·x + b_k mod 2**64`, the minimum of `h_k` over the shingles; the fraction of equal entries between two
signatures estimates the Jaccard similarity of their shingle sets.

LSH cuts a signature into `bands` bands of `rows` entries; two documents that agree on a whole band are candidates.
`bands × rows ≤ num_perm` is chosen, as `datasketch` does, to minimise the weighted areas of false positives below
the threshold and false negatives above it. A candidate is a near-duplicate when its estimated Jaccard similarity
reaches the threshold.

Documents arrive in index order (source order, then record order). The first of a group is kept; a later one is
dropped when it is near one already kept. Only kept documents enter the buckets, so a chain a~b~c where a and c are
apart keeps a and c and drops b, and the outcome depends on the order alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sftflow.tasks.data.index_config import NearDedupConfig
from sftflow.tasks.data.ngrams import mix64, ngram_hashes

_MAX_CELLS = 1 << 22  # shingles × permutations hashed at a time


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising the false-positive area below `threshold` plus the false-negative area above it."""
    s = np.linspace(0.0, 1.0, 1001)

    def area(f: np.ndarray) -> float:  # trapezoid rule on the uniform grid (np.trapezoid needs numpy 2)
        return float((f.sum() - 0.5 * (f[0] + f[-1])) * (s[1] - s[0]))

    best, best_error = (1, num_perm), np.inf
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            p = 1.0 - (1.0 - s**rows) ** bands  # probability that two documents of similarity s become candidates
            fp = area(np.where(s < threshold, p, 0.0))
            fn = area(np.where(s >= threshold, 1.0 - p, 0.0))
            if fp + fn < best_error - 1e-12:
                best, best_error = (bands, rows), fp + fn
    return best


def permutation_seeds(num_perm: int, seed: int) -> np.ndarray:
    """uint64 (2, num_perm): per hash function k, an odd multiplier `a_k` and an offset `b_k`."""
    base = np.arange(2 * num_perm, dtype=np.uint64) + np.uint64(seed) * np.uint64(2 * num_perm) + np.uint64(1)
    ab = mix64(base).reshape(2, num_perm)
    ab[0] |= np.uint64(1)
    return ab


def minhash(shingles: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """uint64 (num_perm,): per k, the minimum of `a_k·x + b_k` (mod 2**64) over the shingle hashes x (non-empty).

    A 2-universal family, as `datasketch` uses (there modulo a Mersenne prime); the shingle hashes are already
    mixed (`ngram_hashes`), and the minimum is decided by the high bits, which depend on every bit of x."""
    a, b = seeds[0][:, None], seeds[1][:, None]
    out = np.full(seeds.shape[1], np.iinfo(np.uint64).max, dtype=np.uint64)
    step = max(1, _MAX_CELLS // seeds.shape[1])
    with np.errstate(over="ignore"):
        for i in range(0, len(shingles), step):
            out = np.minimum(out, (a * shingles[None, i : i + step] + b).min(axis=1))
    return out


@dataclass(frozen=True)
class NearMatch:
    kept: int  # the caller's id of the kept document this one is near
    jaccard: float  # their estimated Jaccard similarity


@dataclass
class NearDuplicates:
    """Feed documents in order with `check`; each answers None (kept, and remembered) or the kept one it is near."""

    config: NearDedupConfig
    _buckets: list[dict[bytes, list[int]]] = field(default_factory=list)
    _signatures: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        self.bands, self.rows = lsh_params(self.config.threshold, self.config.num_perm)
        self._seeds = permutation_seeds(self.config.num_perm, self.config.seed)
        self._buckets = [{} for _ in range(self.bands)]

    def signature(self, word_hashes: np.ndarray) -> np.ndarray | None:
        """The MinHash signature of a document's word hashes (`WordHasher.text`); None without words."""
        if not len(word_hashes):
            return None  # no words: nothing to compare
        shingles = np.unique(ngram_hashes(word_hashes, min(self.config.shingle, len(word_hashes))))
        return minhash(shingles, self._seeds)

    def check(self, doc_id: int, sig: np.ndarray | None) -> NearMatch | None:
        """A document, by its `signature`: None when kept (or without words), else the kept one it is near."""
        if sig is None:
            return None
        keys = [sig[b * self.rows : (b + 1) * self.rows].tobytes() for b in range(self.bands)]
        candidates = sorted({c for b, key in enumerate(keys) for c in self._buckets[b].get(key, ())})
        for c in candidates:  # the earliest kept document that is near enough
            jaccard = float(np.mean(self._signatures[c] == sig))
            if jaccard >= self.config.threshold:
                return NearMatch(c, jaccard)
        self._signatures[doc_id] = sig
        for b, key in enumerate(keys):
            self._buckets[b].setdefault(key, []).append(doc_id)
        return None
