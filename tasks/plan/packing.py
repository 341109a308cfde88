"""Bin-packing cores for the planner: vectorised LPT rows, padded rows, and cost-balanced redistribution.

Every function here is a pure function of its arguments (no global RNG), so the plan built from them is
reproducible. Rows are described as parallel arrays `(doc_ids, row_of_doc)`: doc `doc_ids[i]` lives in row
`row_of_doc[i]`; row ids are dense `0..num_rows-1`.

Why "lockstep" windows and not the published multipack V2 loop: V2 takes the remaining stream, binary-searches the
longest prefix that LPT can pack into `n` bins, emits it, and repeats. Each batch starts where the previous one ended,
so 1,000,000 documents mean ~15,000 sequential Python iterations of a binary search, which does not fit the 2 s budget
without numba. Here the stream is cut into fixed windows holding a little *more* than the window's rows can take
(`over_supply`), every window runs LPT with a capacity check at the same time (one numpy step per document rank,
vectorised over windows), and a document that does not fit is carried, in stream order, to the next round.
The capacity check plays the role of V2's binary search: it finds, per window, which documents fit, but it keeps
filling gaps with the smaller documents after the first one that does not fit, so rows end fuller.
"""

from __future__ import annotations

import numpy as np

from sftflow.tasks.plan.cost import DocCost

WINDOW_ROWS = 32  # rows per LPT window: larger fills rows better, smaller runs fewer lockstep iterations
OVER_SUPPLY = 1.25  # a window holds this many rows' worth of tokens; the excess carries to the next round


def _lpt_windows(lengths: np.ndarray, window: np.ndarray, num_windows: int, rows: int, capacity: int) -> np.ndarray:
    """LPT with a capacity check inside every window at once.

    `lengths` (D,) and `window` (D,) give each document's length and window. In each window, documents go in
    decreasing length to the least-loaded of `rows` rows if it has room, else they are deferred (-1).
    Returns the row (0..rows-1) of each document, or -1. Ties keep the input order (stable sorts throughout).
    """
    order = np.lexsort((-lengths, window))  # by window, then longest first
    counts = np.bincount(window, minlength=num_windows)
    starts = np.zeros(num_windows, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    by_count = np.argsort(-counts, kind="stable")  # fullest windows first, so step j touches a prefix
    slot_of_window = np.empty(num_windows, dtype=np.int64)
    slot_of_window[by_count] = np.arange(num_windows)
    sorted_window = window[order]
    rank_in_window = np.arange(len(order)) - starts[sorted_window]
    width = int(counts.max())
    length_2d = np.zeros((num_windows, width), dtype=np.int64)
    slot = slot_of_window[sorted_window]
    length_2d[slot, rank_in_window] = lengths[order]
    row_2d = np.full((num_windows, width), -1, dtype=np.int64)
    loads = np.zeros((num_windows, rows), dtype=np.int64)
    active_windows = np.searchsorted(-counts[by_count], -np.arange(width), side="left")  # windows with count > j
    window_index = np.arange(num_windows)
    for j in range(width):
        k = int(active_windows[j])
        load = loads[:k]
        idx = window_index[:k]
        best = load.argmin(axis=1)
        current = load[idx, best]
        doc_length = length_2d[:k, j]
        fits = current + doc_length <= capacity
        load[idx, best] = current + np.where(fits, doc_length, 0)
        row_2d[:k, j] = np.where(fits, best, -1)
    row = np.empty(len(order), dtype=np.int64)
    row[order] = row_2d[slot, rank_in_window]
    return row


def lpt_pack_rows(
    lengths: np.ndarray,
    stream: np.ndarray,
    capacity: int,
    window_rows: int = WINDOW_ROWS,
    over_supply: float = OVER_SUPPLY,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Pack the documents `stream` (ids into `lengths`, in visiting order) into rows of at most `capacity` tokens.

    Rounds: cut the stream into windows of `over_supply * window_rows * capacity` tokens, LPT-pack every window into
    `window_rows` rows (`_lpt_windows`), and carry the deferred documents plus the last, partly filled window to the
    next round in stream order. When the stream fits in one window, the window gets just enough rows for its tokens.
    Every round places at least the longest document of each window, so the loop ends.
    Returns `(doc_ids, row_of_doc, num_rows)`; empty rows never appear.
    """
    budget = over_supply * window_rows * capacity
    placed_docs, placed_rows = [], []
    num_rows = 0
    while len(stream):
        doc_length = lengths[stream].astype(np.int64)
        total = int(doc_length.sum())
        before = np.cumsum(doc_length) - doc_length
        window = (before // budget).astype(np.int64)
        num_windows = int(window[-1])  # windows 0..num_windows-1 are fully supplied; the last one is not
        if num_windows == 0:  # the tail: one window, just enough rows for its tokens
            window[:] = 0
            num_windows, rows = 1, max(1, -(-total // capacity))
        else:
            rows = window_rows
        row = np.full(len(stream), -1, dtype=np.int64)
        supplied = window < num_windows  # the partly supplied last window carries whole to the next round
        row[supplied] = _lpt_windows(doc_length[supplied], window[supplied], num_windows, rows, capacity)
        keep = row >= 0
        global_row = window[keep] * rows + row[keep]
        used, dense = np.unique(global_row, return_inverse=True)
        placed_docs.append(stream[keep])
        placed_rows.append(dense + num_rows)
        num_rows += len(used)
        stream = stream[~keep]
    if not placed_docs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
    return np.concatenate(placed_docs).astype(np.int64), np.concatenate(placed_rows), num_rows


def padded_pack_rows(
    lengths: np.ndarray, stream: np.ndarray, capacity: int, window_docs: int = 4096
) -> tuple[np.ndarray, np.ndarray, int]:
    """Rows for `padded` mode: `count * max_length <= capacity`.

    Within each window of `window_docs` documents (stream order), sort by decreasing length and cut greedily: a row
    starting at a document of length `L` takes the next `capacity // L` documents (all no longer than `L`).
    """
    doc_ids, row_of_doc = [], []
    num_rows = 0
    for begin in range(0, len(stream), window_docs):
        chunk = stream[begin : begin + window_docs]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        chunk_lengths = lengths[chunk]
        rows = np.empty(len(chunk), dtype=np.int64)
        i = 0
        while i < len(chunk):
            take = capacity // int(chunk_lengths[i])
            rows[i : i + take] = num_rows
            num_rows += 1
            i += take
        doc_ids.append(chunk)
        row_of_doc.append(rows)
    if not doc_ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
    return np.concatenate(doc_ids).astype(np.int64), np.concatenate(row_of_doc), num_rows


def row_sums(
    lengths: np.ndarray, doc_ids: np.ndarray, row_of_doc: np.ndarray, num_rows: int, cost: DocCost, padded: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: real tokens, compute tokens (padded: `count * max_length`) and the summed cost of its documents
    (padded: each document costs what one of the row's longest does)."""
    doc_length = lengths[doc_ids].astype(np.int64)
    tokens = np.bincount(row_of_doc, weights=doc_length, minlength=num_rows).astype(np.int64)
    if padded:
        count = np.bincount(row_of_doc, minlength=num_rows)
        longest = np.zeros(num_rows, dtype=np.int64)
        np.maximum.at(longest, row_of_doc, doc_length)
        compute = count * longest
        return tokens, compute, count * cost(longest)
    row_cost = np.bincount(row_of_doc, weights=cost(doc_length), minlength=num_rows)
    return tokens, tokens.copy(), row_cost


def lpt_redistribute(
    doc_length: np.ndarray, num_rows: int, capacity: int, doc_cost: DocCost, padded: bool
) -> np.ndarray | None:
    """Spread a few documents over `num_rows` rows, balancing cost: longest first, each to the cheapest row that has
    room (tokens, or `count * max_length` when `padded`). Returns each document's row, or None if one did not fit.
    Used for the final partial step, whose documents would otherwise leave some ranks idle."""
    order = np.argsort(-doc_length, kind="stable")
    cost = np.zeros(num_rows)
    tokens = np.zeros(num_rows, dtype=np.int64)
    count = np.zeros(num_rows, dtype=np.int64)
    longest = np.zeros(num_rows, dtype=np.int64)
    row = np.empty(len(doc_length), dtype=np.int64)
    for i in order:
        length = int(doc_length[i])
        if padded:
            new_longest = np.maximum(longest, length)
            room = (count + 1) * new_longest <= capacity
            new_cost = (count + 1) * doc_cost(new_longest)
        else:
            room = tokens + length <= capacity
            new_cost = cost + doc_cost(length)
        if not room.any():
            return None
        r = int(np.argmin(np.where(room, cost, np.inf)))
        row[i] = r
        cost[r] = new_cost[r]
        tokens[r] += length
        count[r] += 1
        longest[r] = max(longest[r], length)
    return row
