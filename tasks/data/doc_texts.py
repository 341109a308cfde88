"""The rendered text of a pbin shard's documents, for the text scan of the filters that read words, not token ids.

The render stage writes one `{"text", "source", ...}` line per record; the spans stage drops some (nothing trained,
too long) and keeps the others in order, each with the same `source` (`file:line`). So walking both in order and
pairing equal sources recovers each document's text. Under `spans.length_policy: truncate`, the text is the whole
rendered record, of which the document holds a prefix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sftflow.tasks.data.pbin import PbinFile


def shard_texts(rendered_path: str | Path, pbin_path: str | Path, docs: np.ndarray) -> Iterator[tuple[int, str, str]]:
    """`(doc, source, text)` for each document number in `docs` (ascending) of the pbin shard."""
    wanted = set(docs.tolist())
    with PbinFile(pbin_path) as pbin, open(rendered_path, encoding="utf-8") as rendered:
        lines = enumerate(rendered, start=1)
        for doc in range(len(pbin)):
            source = pbin.source(doc)
            for _, line in lines:
                row = json.loads(line)
                if row["source"] == source:
                    break
            else:
                raise ValueError(
                    f"{rendered_path}: no rendered record for document {doc} ({source}) of {pbin_path}; the index "
                    "was given the rendered shard of another source, or a changed one"
                )
            if doc in wanted:
                yield doc, source, row["text"]
