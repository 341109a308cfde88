from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sftflow.tasks.train.collate import (
    IGNORE_INDEX,
    add_padded_position_ids,
    add_position_ids,
    apply_loss_spans,
    collate,
    count_loss_tokens,
    mask_doc_boundaries,
    mask_padding,
    pack_docs,
    packed_collator,
    pad_docs,
    padded_collator,
    shift_labels,
    trainable_target_count,
)


def _doc(ids, spans):
    return np.array(ids, dtype=np.int64), np.array(spans, dtype=np.int32).reshape(-1, 2)


# The row drawn in the `pack_docs` docstring: a0..a2 trains a1 a2, b0 b1 trains both, c0..c3 trains c2 c3.
A, B, C = _doc([10, 11, 12], [[1, 3]]), _doc([20, 21], [[0, 2]]), _doc([30, 31, 32, 33], [[2, 4]])


def test_docstring_example():
    out = collate([A, B, C], packed_collator())
    assert out["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 33]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert out["labels"].tolist() == [[11, 12, -100, 21, -100, -100, 32, 33, -100]]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["max_seqlen"] == 4 and type(out["max_seqlen"]) is int
    assert out["num_loss_tokens"] == 5 and type(out["num_loss_tokens"]) is int
    assert out["input_ids"].dtype == torch.long and out["labels"].dtype == torch.long
    assert "docs" not in out and "loss_mask" not in out


def test_pack_docs_alone():
    out = pack_docs({"docs": [A, B]})
    assert out["input_ids"].shape == (1, 5)
    assert out["loss_mask"].tolist() == [[False, True, True, True, True]]
    assert out["doc_lengths"].tolist() == [3, 2]


def test_pack_docs_rejects_span_outside_doc():
    with pytest.raises(ValueError, match=r"loss span \[1, 9\)"):
        pack_docs({"docs": [_doc([1, 2, 3], [[1, 9]])]})


def test_add_position_ids_alone():
    out = add_position_ids({"doc_lengths": torch.tensor([2, 1, 3])})
    assert out["position_ids"].tolist() == [[0, 1, 0, 0, 1, 2]]
    assert out["cu_seqlens"].tolist() == [0, 2, 3, 6]
    assert out["max_seqlen"] == 3


def test_shift_labels_alone():
    out = shift_labels({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]])})
    assert out["labels"].tolist() == [[6, 7, -100], [9, 0, -100]]


def test_apply_loss_spans_alone():
    batch = {"labels": torch.tensor([[6, 7, 8, -100]]), "loss_mask": torch.tensor([[True, False, True, True]])}
    # target of position t is token t+1: trained for t=1 (token 2) and t=2 (token 3), not for t=0 (token 1).
    assert apply_loss_spans(batch)["labels"].tolist() == [[-100, 7, 8, -100]]


def test_mask_doc_boundaries_alone():
    batch = {"labels": torch.tensor([[1, 2, 3, 4, 5]]), "cu_seqlens": torch.tensor([0, 2, 5], dtype=torch.int32)}
    assert mask_doc_boundaries(batch)["labels"].tolist() == [[1, -100, 3, 4, -100]]


def test_count_loss_tokens_alone():
    assert count_loss_tokens({"labels": torch.tensor([[1, -100, 3]])})["num_loss_tokens"] == 2


def test_functions_do_not_mutate_input():
    batch = pack_docs({"docs": [A, B, C]})
    batch = add_position_ids(shift_labels(batch))
    before = batch["labels"].clone()
    apply_loss_spans(batch)
    mask_doc_boundaries(batch)
    assert torch.equal(batch["labels"], before)


def test_empty_row_is_one_untrained_pad_token():
    out = collate([], packed_collator(pad_id=7))
    assert out["input_ids"].tolist() == [[7]]
    assert out["labels"].tolist() == [[IGNORE_INDEX]]
    assert out["cu_seqlens"].tolist() == [0, 1]
    assert out["num_loss_tokens"] == 0


def test_padded_example():
    a, b = _doc([10, 11, 12], [[1, 3]]), _doc([20, 21], [[1, 2]])
    out = collate([a, b], padded_collator(pad_id=0))
    assert out["input_ids"].tolist() == [[10, 11, 12], [20, 21, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert out["labels"].tolist() == [[11, 12, -100], [21, -100, -100]]
    assert out["num_loss_tokens"] == 3


def test_mask_padding_alone():
    batch = {"labels": torch.tensor([[1, 2, -100]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    assert mask_padding(batch)["labels"].tolist() == [[1, -100, -100]]


def test_pad_docs_and_positions_alone():
    out = add_padded_position_ids(pad_docs({"docs": [A, B]}, pad_id=3))
    assert out["input_ids"].tolist() == [[10, 11, 12], [20, 21, 3]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_padded_without_spans_masks_pads():
    # every token in a span: the pad targets must still be -100
    out = collate([_doc([1, 2, 3, 4], [[0, 4]]), _doc([5, 6], [[0, 2]])], padded_collator())
    assert out["labels"].tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]


@st.composite
def docs_strategy(draw):
    n = draw(st.integers(0, 6))
    docs = []
    for _ in range(n):
        length = draw(st.integers(1, 12))
        ids = np.array(draw(st.lists(st.integers(0, 50), min_size=length, max_size=length)), dtype=np.int64)
        cuts = sorted(draw(st.lists(st.integers(0, length), max_size=6)))
        spans = np.array([[cuts[i], cuts[i + 1]] for i in range(0, len(cuts) - 1, 2)], dtype=np.int32).reshape(-1, 2)
        docs.append((ids, spans))
    return docs


def _reference_labels(docs):
    """Per-document labels computed independently: target j of a doc is kept iff j >= 1 and j in a span."""
    labels = []
    for ids, spans in docs:
        trained = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            trained[s:e] = True
        labels += [int(ids[t + 1]) if t + 1 < len(ids) and trained[t + 1] else IGNORE_INDEX for t in range(len(ids))]
    return labels


@settings(max_examples=200, deadline=None)
@given(docs_strategy())
def test_packed_properties(docs):
    out = collate(docs, packed_collator())
    if not docs:
        assert out["num_loss_tokens"] == 0
        return
    labels = out["labels"][0].tolist()
    assert labels == _reference_labels(docs)
    cu = out["cu_seqlens"].tolist()
    assert cu == [0, *np.cumsum([len(d[0]) for d in docs]).tolist()]
    # labels never cross documents: each kept label equals the next token of the same document
    ids = out["input_ids"][0].tolist()
    pos = out["position_ids"][0].tolist()
    for t, lab in enumerate(labels):
        if lab != IGNORE_INDEX:
            assert t + 1 < len(ids) and lab == ids[t + 1] and pos[t + 1] == pos[t] + 1
    # position ids reset at each document start and count up inside it
    for d, (s, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        assert pos[s:e] == list(range(e - s)), d
    assert out["max_seqlen"] == max(len(d[0]) for d in docs)
    assert out["num_loss_tokens"] == sum(trainable_target_count(len(i), s) for i, s in docs)


@settings(max_examples=100, deadline=None)
@given(docs_strategy())
def test_padded_matches_packed_per_doc(docs):
    out = collate(docs, padded_collator())
    if not docs:
        assert out["num_loss_tokens"] == 0
        return
    for row, (ids, spans) in enumerate(docs):
        n = len(ids)
        assert out["labels"][row, :n].tolist() == _reference_labels([(ids, spans)])
        assert (out["labels"][row, n:] == IGNORE_INDEX).all()
        assert out["attention_mask"][row].sum() == n
    assert out["num_loss_tokens"] == sum(trainable_target_count(len(i), s) for i, s in docs)
