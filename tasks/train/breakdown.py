"""The training loss and token accuracy broken down by the data's groups: each document's source, and its `tag`.

The fused loss returns one sum per micro-batch; with `row_stats` it also hands back each trained token's loss and
whether its target was the top logit. Each trained token belongs to one cell per grouping (its document's source,
its document's tag), so one `index_add` per grouping sums them into a `(3, cells)` table on the device: loss sum,
hits and trained tokens per cell. The table rides along with the step's other totals in the one all-reduce the step
already makes, so the breakdown adds no host sync and no collective.

Cells are numbered across groupings (sources first, then tags), so one table holds both::

    groupings  source: [chat, code]          tag: [math, (none)]
    cells       0 chat  1 code                2 math  3 (none)
    doc_cells  (2, documents): row 0 a document's source cell, row 1 its tag cell
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sftflow.tasks.data.reader import UNTAGGED


@dataclass(frozen=True)
class Breakdown:
    groupings: tuple[tuple[str, tuple[str, ...]], ...]  # ("source", names), ("tag", names)
    doc_cells: np.ndarray  # int64 (groupings, documents of the split): each document's cell per grouping

    @property
    def num_cells(self) -> int:
        return sum(len(names) for _, names in self.groupings)

    def row_cells(self, doc_ids: np.ndarray, doc_of_target: np.ndarray) -> torch.Tensor:
        """int64 (groupings, n): the cells of a row's n trained targets, given the row's documents (split ids) and
        the position in the row of each target's document."""
        docs = np.asarray(doc_ids, dtype=np.int64)[np.asarray(doc_of_target, dtype=np.int64)]
        return torch.from_numpy(np.ascontiguousarray(self.doc_cells[:, docs]))

    def report(self, table: list[float]) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """`{grouping: {name: {loss, token_accuracy, trained_tokens}}}` from the summed `(3, cells)` table, flat."""
        cells = np.asarray(table, dtype=np.float64).reshape(3, self.num_cells)
        out, first = {}, 0
        for kind, names in self.groupings:
            rows = {}
            for k, name in enumerate(names):
                loss_sum, hits, count = cells[:, first + k]
                rows[name] = {
                    "loss": loss_sum / count if count else None,
                    "token_accuracy": hits / count if count else None,
                    "trained_tokens": int(count),
                }
            out[kind] = rows
            first += len(names)
        return out


def breakdown_of(dataset) -> Breakdown | None:
    """The groupings the data has: its sources when there are several, its tags when any document has one; None
    when there is nothing to break down (one source, no tags, or data without either, such as the mock data)."""
    groupings, rows = [], []
    sources = list(getattr(dataset, "source_names", None) or [])
    if len(sources) >= 2:
        groupings.append(("source", tuple(sources)))
        rows.append(np.asarray(dataset.source_ids, dtype=np.int64))
    tags = list(getattr(dataset, "tag_names", None) or [])
    if tags:
        tag_ids = np.asarray(dataset.tag_ids, dtype=np.int64)
        if (tag_ids < 0).any():
            tags.append(UNTAGGED)
            tag_ids = np.where(tag_ids < 0, len(tags) - 1, tag_ids)
        groupings.append(("tag", tuple(tags)))
        rows.append(tag_ids)
    if not groupings:
        return None
    offsets = np.cumsum([0] + [len(names) for _, names in groupings[:-1]])
    doc_cells = np.stack([row + offset for row, offset in zip(rows, offsets, strict=True)])
    return Breakdown(groupings=tuple(groupings), doc_cells=doc_cells)


def doc_of_target(batch: dict) -> np.ndarray:
    """For each trained target of a collated micro-batch (`loss_rows`, flat positions), its document's position in
    the row: packed rows by `cu_seqlens`, padded ones by the row (one document per row)."""
    rows = batch["loss_rows"].numpy()
    if "cu_seqlens" in batch:
        return np.searchsorted(batch["cu_seqlens"][1:].numpy(), rows, side="right")
    return rows // batch["labels"].shape[-1]


def add_cells(table: torch.Tensor, cells: torch.Tensor, stats: torch.Tensor) -> None:
    """Sum one micro-batch's per-token `stats` ((2, n): loss, hit) and counts into `table` ((3, cells), fp64)."""
    values = torch.cat([stats.to(table.dtype), torch.ones_like(stats[:1], dtype=table.dtype)])
    for grouping in cells:
        table.index_add_(1, grouping, values)
