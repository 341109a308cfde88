from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from sftflow.tasks.train.collate import collate, packed_collator, trainable_target_count
from sftflow.tasks.train.mock import MockConfig, MockDataset, sample_lengths, write_mock_index


def test_lognormal_lengths_clipped_and_near_median():
    cfg = MockConfig(num_docs=20000, median_length=600, sigma=1.0, min_length=16, max_length=8192, seed=3)
    lengths = sample_lengths(cfg)
    assert lengths.dtype == np.int32 and lengths.shape == (20000,)
    assert lengths.min() >= 16 and lengths.max() <= 8192
    assert 560 < np.median(lengths) < 640
    assert (lengths == 8192).any()  # the tail is clipped, not dropped


def test_fixed_and_uniform_lengths():
    fixed = sample_lengths(MockConfig(num_docs=50, length_distribution="fixed", median_length=77))
    assert (fixed == 77).all()
    uniform = sample_lengths(MockConfig(num_docs=5000, length_distribution="uniform", min_length=5, max_length=9))
    assert set(uniform.tolist()) == {5, 6, 7, 8, 9}


def test_deterministic_and_order_independent():
    cfg = MockConfig(num_docs=100, vocab_size=1000, median_length=50, loss_spans=True, seed=11)
    a, b = MockDataset(cfg), MockDataset(cfg)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.loss_token_counts, b.loss_token_counts)
    late = b[97]
    for i in range(100):
        ids_a, spans_a = a[i]
        ids_b, spans_b = b[i]
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(spans_a, spans_b)
    np.testing.assert_array_equal(late[0], a[97][0])
    other = MockDataset(cfg.model_copy(update={"seed": 12}))
    assert not np.array_equal(other.lengths, a.lengths)


@pytest.mark.parametrize("loss_spans", [False, True])
@pytest.mark.parametrize("tokens", ["random", "arithmetic"])
def test_docs_match_lengths_and_counts(loss_spans, tokens):
    cfg = MockConfig(
        num_docs=300, vocab_size=500, min_token_id=5, median_length=40, min_length=1, max_length=200,
        loss_spans=loss_spans, tokens=tokens, seed=1,
    )  # fmt: skip
    ds = MockDataset(cfg)
    assert len(ds) == 300
    for i in range(len(ds)):
        ids, spans = ds[i]
        assert ids.shape == (ds.lengths[i],)
        assert ids.min() >= 5 and ids.max() < 500
        assert spans.dtype == np.int32 and spans.ndim == 2 and spans.shape[1] == 2
        assert (spans[:, 0] < spans[:, 1]).all() and (spans[:, 1] <= len(ids)).all()
        assert (spans[1:, 0] >= spans[:-1, 1]).all()  # sorted, disjoint
        assert ds.loss_token_counts[i] == trainable_target_count(len(ids), spans)
        if not loss_spans:
            assert spans.tolist() == [[0, len(ids)]]


def test_spans_train_only_part_when_on():
    ds = MockDataset(MockConfig(num_docs=200, median_length=100, min_length=20, loss_spans=True))
    assert (ds.loss_token_counts < ds.lengths - 1).all()
    assert (ds.loss_token_counts > 0).all()


def test_collated_loss_tokens_equal_counts():
    ds = MockDataset(MockConfig(num_docs=12, vocab_size=100, median_length=30, loss_spans=True, seed=5))
    out = collate([ds[i] for i in range(12)], packed_collator())
    assert out["num_loss_tokens"] == int(ds.loss_token_counts.sum())


@pytest.mark.parametrize("loss_spans", [False, True])
def test_written_index_reads_back_as_the_mock(tmp_path, loss_spans):
    """Training reads mock data through the dataset index: every document, in order, with its spans and counts, even
    duplicates and documents whose only trained token is their first (nothing filtered, nothing held out)."""
    from sftflow.tasks.data.pbin import spans_to_mask
    from sftflow.tasks.data.reader import IndexedDataset

    cfg = MockConfig(num_docs=300, vocab_size=50, median_length=3, min_length=1, max_length=9, loss_spans=loss_spans)
    mock = MockDataset(cfg)
    data = IndexedDataset(write_mock_index(cfg, tmp_path / "data"), verify=True)
    assert len(data) == len(mock) and data.vocab_size == 50
    np.testing.assert_array_equal(data.lengths, mock.lengths)
    np.testing.assert_array_equal(data.trainable_target_counts(), mock.loss_token_counts)
    for i in range(len(mock)):
        (want_ids, want_spans), (ids, spans) = mock[i], data[i]
        np.testing.assert_array_equal(ids, want_ids)
        # Touching spans are merged in the shard: the same trained tokens.
        np.testing.assert_array_equal(spans_to_mask(spans, len(ids)), spans_to_mask(want_spans, len(ids)))


def test_out_of_range_and_bad_config():
    ds = MockDataset(MockConfig(num_docs=3))
    with pytest.raises(IndexError, match="mock document 3"):
        ds[3]
    with pytest.raises(ValidationError, match="min_length"):
        MockConfig(min_length=10, max_length=5)
    with pytest.raises(ValidationError, match="min_token_id"):
        MockConfig(min_token_id=10, vocab_size=10)


def test_million_docs_is_cheap():
    ds = MockDataset(MockConfig(num_docs=1_000_000, loss_spans=True))
    assert ds.lengths.nbytes + ds._num_spans.nbytes + ds._fractions.nbytes < 16_000_000
    assert ds[999_999][0].shape == (ds.lengths[999_999],)
