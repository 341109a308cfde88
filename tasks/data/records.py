"""In-memory records that cross stage boundaries inside one process.

Each stage writes these to disk (JSONL for rendered text, pbin for tokens) and the next stage reads them back;
nothing here is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RenderedDoc:
    """A conversation rendered to text by the chat template.

    `train_char_spans` are half-open `[start, end)` character ranges of `text` whose tokens are trained.
    `source` is `"path:line"` (JSONL) or `"path:record N"` (JSON array, Parquet, datasets), both counting from 1,
    for error messages and provenance. `tag` is the record's tag field (`render.tag_field`), if it has one: metrics
    are broken down by it.
    """

    text: str
    train_char_spans: tuple[tuple[int, int], ...]
    source: str
    tag: str | None = None


@dataclass(frozen=True)
class TokenizedDoc:
    """Token ids plus half-open token-level loss spans (`loss_spans_S2[i] = [start, end)`), sorted and disjoint."""

    input_ids: np.ndarray  # int64 (L,)
    loss_spans_S2: np.ndarray  # int32 (S, 2)
    source: str
    tag: str | None = None

    @property
    def loss_token_count(self) -> int:
        if len(self.loss_spans_S2) == 0:
            return 0
        return int((self.loss_spans_S2[:, 1] - self.loss_spans_S2[:, 0]).sum())

    def loss_mask(self) -> np.ndarray:
        mask = np.zeros(len(self.input_ids), dtype=np.uint8)
        for start, end in self.loss_spans_S2:
            mask[start:end] = 1
        return mask
