"""MinHash/LSH near-duplicates: the band choice, the Jaccard estimate, and which document is kept."""

from __future__ import annotations

import numpy as np

from sftflow.tasks.data.index_config import NearDedupConfig
from sftflow.tasks.data.near_dup import NearDuplicates, lsh_params, minhash, permutation_seeds
from sftflow.tasks.data.ngrams import WordHasher, mix64
from tests.tasks.text_filter_data import change_words, sentence


def test_bands_and_rows_are_datasketchs_choice():
    # datasketch.lsh._optimal_param(threshold, num_perm, 0.5, 0.5) for these, written down
    assert lsh_params(0.8, 128) == (9, 13)
    assert lsh_params(0.5, 128) == (25, 5)
    assert lsh_params(0.9, 64) == (3, 21)


def test_minhash_estimates_jaccard():
    seeds = permutation_seeds(256, seed=0)
    hashes = mix64(np.arange(2000, dtype=np.uint64))  # shingle hashes are mixed, as `ngram_hashes` gives them
    base = hashes[:1000]
    for shared in (900, 500, 100):  # |A ∩ B| of two 1000-sets
        other = np.concatenate([base[:shared], hashes[1000 + shared :]])
        jaccard = shared / (2000 - shared)
        estimate = float(np.mean(minhash(base, seeds) == minhash(other, seeds)))
        assert abs(estimate - jaccard) < 0.1, (shared, estimate, jaccard)
    assert np.array_equal(minhash(base, seeds), minhash(base[::-1].copy(), seeds))


def test_first_document_of_a_group_is_kept_and_far_ones_stay():
    rng = np.random.default_rng(0)
    original = sentence(rng, 100)
    near = NearDuplicates(NearDedupConfig(enabled=True, threshold=0.8))
    docs = [
        original,
        change_words(original, [50]),  # Jaccard of the 5-shingles: 91/101
        sentence(rng, 100),  # unrelated
        change_words(original, list(range(0, 100, 4))),  # a quarter of the words changed: far
        original.upper(),  # the same words
        "",  # no words: never a duplicate
        "",
    ]
    results = [near.check(i, near.signature(WordHasher().text(text))) for i, text in enumerate(docs)]
    assert [r.kept if r is not None else None for r in results] == [None, 0, None, None, 0, None, None]
    assert 0.85 < results[1].jaccard < 0.95 and results[4].jaccard == 1.0


def test_a_chain_keeps_its_ends():
    """a ~ b and b ~ c but a and c apart: b goes, c stays (it is compared with kept documents only)."""
    rng = np.random.default_rng(3)
    a = sentence(rng, 200)
    b = change_words(a, [30, 90, 150])  # Jaccard of the 5-shingles: 181/211 with a
    c = change_words(b, [60, 120, 180])  # 181/211 with b, 166/226 with a
    near = NearDuplicates(NearDedupConfig(enabled=True, threshold=0.8, num_perm=256))
    assert [near.check(i, near.signature(WordHasher().text(t))) is None for i, t in enumerate([a, b, c])] == [
        True,
        False,
        True,
    ]
