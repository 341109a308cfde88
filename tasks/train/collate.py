"""Composable collators: turn the documents of one planned row into the tensors a training step consumes.

A collator is a list of small pure functions, each `dict -> dict`, applied in order by `collate(docs, fns)`. Each
function reads a few keys and returns a *new* dict with a few keys added or replaced; no tensor is modified in place.
The input dict is `{"docs": [(ids, loss_spans), ...]}` where `ids` is an integer array `(L,)` and `loss_spans` an
int `(S, 2)` array of half-open token ranges whose tokens are trained (as returned by the dataset index reader and by
`sftflow.tasks.train.mock.MockDataset`).

Labels convention: **pre-shifted, aligned to positions.** `labels[t]` is the target predicted from position `t`,
i.e. `input_ids[t + 1]`, or -100 when position `t` has no trained target. We compute the loss ourselves from the
hidden states (`sftflow.kernels` fused linear cross-entropy over `hidden[t]` vs `labels[t]`), so no further shift
happens anywhere. Do NOT pass these labels to a Hugging Face model's `forward(labels=...)`: HF shifts internally
and would be off by one.

A token `j` is trained iff `j` lies inside a loss span of its document and `j` is not the document's first token
(nothing in the same document precedes it). So the target of position `t` is kept iff `t + 1` is in the same
document and is inside a loss span. This is also the count `num_loss_tokens` reports, and the count the planner's
`step_loss_tokens` must sum (see `trainable_target_count`).

An empty row (a rank with nothing to do in the final partial step) becomes a single padding token with no target,
so forward and backward still run (with a zero, graph-connected loss) and collectives stay in step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

IGNORE_INDEX = -100

Batch = dict
CollateFn = Callable[[Batch], Batch]


def trainable_target_count(length: int, loss_spans: np.ndarray) -> int:
    """Number of tokens of one document that are trained targets: in a loss span, and not the document's token 0."""
    spans = np.asarray(loss_spans, dtype=np.int64).reshape(-1, 2)
    starts = np.clip(spans[:, 0], 1, length)
    ends = np.clip(spans[:, 1], 1, length)
    return int(np.maximum(ends - starts, 0).sum())


def _loss_mask(length: int, loss_spans: np.ndarray) -> np.ndarray:
    """Bool `(L,)`: token is inside a loss span (token level, before any shift)."""
    mask = np.zeros(length, dtype=bool)
    for start, end in np.asarray(loss_spans, dtype=np.int64).reshape(-1, 2):
        if not 0 <= start <= end <= length:
            raise ValueError(f"loss span [{start}, {end}) is outside a document of {length} tokens")
        mask[start:end] = True
    return mask


# ---------------------------------------------------------------------------------------------------------------------
# packed mode
# ---------------------------------------------------------------------------------------------------------------------


def pack_docs(batch: Batch, *, pad_id: int = 0) -> Batch:
    """Concatenate the row's documents into one `(1, T)` row.

    Adds `input_ids` (1, T) long, `loss_mask` (1, T) bool (token inside a loss span) and `doc_lengths` (n,) long.
    The full pipeline (`packed_collator()`) turns a three-document row, A = a0..a2 (trains a1 a2), B = b0 b1
    (trains both), C = c0..c3 (trains c2 c3), into::

        t             0     1     2     3     4     5     6     7     8
        input_ids    a0    a1    a2  | b0    b1  | c0    c1    c2    c3
        position_ids  0     1     2  |  0     1  |  0     1     2     3
        loss_mask     .     x     x  |  x     x  |  .     .     x     x      (token inside a loss span)
        labels       a1    a2  -100  | b1  -100  | -100  c2    c3  -100
        cu_seqlens   [0, 3, 5, 9]      max_seqlen 4      num_loss_tokens 5

    `labels[t]` is the target of position `t` (pre-shifted). The last position of each document gets -100, so no
    target crosses a document boundary: b0 is in a loss span but is never a target, since nothing in B precedes it.
    Attention is block-diagonal over `cu_seqlens`; the row holds no padding.

    An empty row becomes a single `pad_id` token with no target (`doc_lengths == [1]`, `cu_seqlens == [0, 1]`).
    """
    docs = batch["docs"]
    if len(docs) == 0:
        docs = [(np.array([pad_id]), np.zeros((0, 2), dtype=np.int32))]
    ids = [np.asarray(d[0], dtype=np.int64) for d in docs]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    if (lengths == 0).any():
        raise ValueError(f"row holds an empty document (doc position {int(np.argmin(lengths))} has 0 tokens)")
    mask = np.concatenate([_loss_mask(len(x), d[1]) for x, d in zip(ids, docs, strict=True)])
    return {
        **batch,
        "input_ids": torch.from_numpy(np.concatenate(ids))[None, :],
        "loss_mask": torch.from_numpy(mask)[None, :],
        "doc_lengths": torch.from_numpy(lengths),
    }


def add_position_ids(batch: Batch) -> Batch:
    """From `doc_lengths`: `position_ids` (1, T) resetting to 0 at each document, `cu_seqlens` (int32, n+1) and
    `max_seqlen` (a Python int, so attention kernels need no `.item()` sync)."""
    lengths = batch["doc_lengths"].to(torch.long)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    total = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.long), lengths)
    position_ids = torch.arange(total, dtype=torch.long) - starts
    return {
        **batch,
        "position_ids": position_ids[None, :],
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(lengths.max()) if len(lengths) else 0,
    }


def shift_labels(batch: Batch) -> Batch:
    """`labels[..., t] = input_ids[..., t + 1]`; the last position of each row gets -100. Works for (B, T)."""
    input_ids = batch["input_ids"]
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[..., :-1] = input_ids[..., 1:]
    return {**batch, "labels": labels}


def apply_loss_spans(batch: Batch) -> Batch:
    """-100 where the *target* token is outside the loss spans: keep `labels[t]` iff `loss_mask[t + 1]`."""
    target_trained = torch.zeros_like(batch["loss_mask"])
    target_trained[..., :-1] = batch["loss_mask"][..., 1:]
    labels = batch["labels"].masked_fill(~target_trained, IGNORE_INDEX)
    return {**batch, "labels": labels}


def mask_doc_boundaries(batch: Batch) -> Batch:
    """-100 at the last position of every document: its target would be the next document's first token."""
    labels = batch["labels"].clone()
    last = batch["cu_seqlens"][1:].to(torch.long) - 1
    labels[0, last] = IGNORE_INDEX
    return {**batch, "labels": labels}


def count_loss_tokens(batch: Batch) -> Batch:
    """`loss_rows`: the flat positions (into `labels.reshape(-1)`) that have a target, int64; `num_loss_tokens`: how
    many (a Python int). Found here, on the CPU, so the loss need not look for them on the device (a host sync)."""
    rows = (batch["labels"].reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    return {**batch, "loss_rows": rows, "num_loss_tokens": int(rows.numel())}


def drop_keys(batch: Batch, *, keys: Sequence[str] = ("docs", "loss_mask")) -> Batch:
    """Remove intermediates the training step does not need (the raw docs, the token-level loss mask)."""
    return {k: v for k, v in batch.items() if k not in keys}


# ---------------------------------------------------------------------------------------------------------------------
# padded mode
# ---------------------------------------------------------------------------------------------------------------------


def pad_docs(batch: Batch, *, pad_id: int = 0) -> Batch:
    """One document per row, right-padded with `pad_id` to the longest document of the micro-batch.

    Adds `input_ids` (B, Lmax) long, `attention_mask` (B, Lmax) long (1 on real tokens), `loss_mask` (B, Lmax)
    bool and `doc_lengths` (B,) long. Example, A = a0..a2 (trains a1 a2), B = b0 b1 (trains b1)::

        input_ids       a0    a1    a2        attention_mask  1 1 1    position_ids  0 1 2
                        b0    b1   pad                        1 1 0                  0 1 2
        labels          a1    a2  -100
                        b1  -100  -100

    An empty micro-batch becomes one row of a single `pad_id` token (attention_mask 1, so softmax stays finite)
    with no target.
    """
    docs = batch["docs"]
    if len(docs) == 0:
        docs = [(np.array([pad_id]), np.zeros((0, 2), dtype=np.int32))]
    lengths = np.array([len(d[0]) for d in docs], dtype=np.int64)
    if (lengths == 0).any():
        raise ValueError(f"micro-batch holds an empty document (doc position {int(np.argmin(lengths))} has 0 tokens)")
    width = int(lengths.max())
    input_ids = np.full((len(docs), width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(docs), width), dtype=bool)
    for i, (ids, spans) in enumerate(docs):
        input_ids[i, : len(ids)] = ids
        loss_mask[i, : len(ids)] = _loss_mask(len(ids), spans)
    attention_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    return {
        **batch,
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "loss_mask": torch.from_numpy(loss_mask),
        "doc_lengths": torch.from_numpy(lengths),
    }


def add_padded_position_ids(batch: Batch) -> Batch:
    """`position_ids` (B, Lmax): 0..Lmax-1 on every row (pads are masked by `attention_mask` and `labels`)."""
    batch_size, width = batch["input_ids"].shape
    position_ids = torch.arange(width, dtype=torch.long).expand(batch_size, width).contiguous()
    return {**batch, "position_ids": position_ids}


def mask_padding(batch: Batch) -> Batch:
    """-100 where the target is a pad: keep `labels[:, t]` only if `attention_mask[:, t + 1]` is 1."""
    target_real = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    target_real[:, :-1] = batch["attention_mask"][:, 1:].bool()
    return {**batch, "labels": batch["labels"].masked_fill(~target_real, IGNORE_INDEX)}


# ---------------------------------------------------------------------------------------------------------------------
# factories
# ---------------------------------------------------------------------------------------------------------------------


def packed_collator(pad_id: int = 0) -> list[CollateFn]:
    """Packed row `(1, T)` with `input_ids, position_ids, cu_seqlens, max_seqlen, labels, doc_lengths, loss_rows,
    num_loss_tokens`."""
    return [
        partial(pack_docs, pad_id=pad_id),
        add_position_ids,
        shift_labels,
        apply_loss_spans,
        mask_doc_boundaries,
        count_loss_tokens,
        drop_keys,
    ]


def padded_collator(pad_id: int = 0) -> list[CollateFn]:
    """Padded micro-batch `(B, Lmax)` with `input_ids, attention_mask, position_ids, labels, doc_lengths, loss_rows,
    num_loss_tokens`."""
    return [
        partial(pad_docs, pad_id=pad_id),
        add_padded_position_ids,
        shift_labels,
        apply_loss_spans,
        mask_padding,
        count_loss_tokens,
        drop_keys,
    ]


def collate(docs: Sequence[tuple[np.ndarray, np.ndarray]], fns: Sequence[CollateFn]) -> Batch:
    """Apply the collate functions in order to `{"docs": docs}`."""
    batch: Batch = {"docs": list(docs)}
    for fn in fns:
        batch = fn(batch)
    return batch
