"""Random access to documents across pbin shards, safe to build in a parent and use in worker processes.

`DocumentReader` reads (shard, doc) or a global doc number over a list of shards. `IndexedDataset` puts a dataset
index in front of it: item `i` of the train (or eval) split is row `index.train_ids[i]`, which names a shard and a doc.
That is the doc-id space of the plan (`plan.npz` doc ids index the train split).

Process safety and memory:
- Shards are mapped lazily and per process: each access checks `os.getpid()`, so a reader inherited through `fork`
  (DataLoader workers) re-opens its own mappings instead of sharing the parent's; pickling (spawn workers) carries
  only paths and small arrays, never mapped data.
- `get` returns *copies* (ids as int64, spans as int32), never views, and nothing caches documents: memory does not
  grow with the number of documents read. The only resident memory is the OS page cache behind the mapping, which
  the kernel reclaims.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sftflow.tasks.core.fingerprint import sha256_file
from sftflow.tasks.data.index import IndexData, load_index
from sftflow.tasks.data.pbin import PbinFile


class DocumentReader:
    """Documents of one or more pbin shards. Global doc `g` is doc `g - doc_starts[s]` of shard `s`."""

    def __init__(self, pbin_paths: Sequence[str | Path]):
        self.paths = [str(p) for p in pbin_paths]
        self._pid: int | None = None
        self._files: list[PbinFile] = []
        files = self._open()
        self.num_docs_per_shard = np.array([len(f) for f in files], dtype=np.int64)
        self.doc_starts = np.zeros(len(files) + 1, dtype=np.int64)
        np.cumsum(self.num_docs_per_shard, out=self.doc_starts[1:])

    def _open(self) -> list[PbinFile]:
        pid = os.getpid()
        if self._pid != pid:
            # First use in this process (including a forked child): map the shards here. Objects inherited from the
            # parent are only dropped; that unmaps the child's copy and leaves the parent's mapping alone.
            self._files = [PbinFile(p) for p in self.paths]
            self._pid = pid
        return self._files

    def __len__(self) -> int:
        return int(self.doc_starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.paths)

    def locate(self, global_id: int) -> tuple[int, int]:
        """(shard, doc) of a global doc number."""
        if not 0 <= global_id < len(self):
            raise IndexError(f"document {global_id} out of range (the reader has {len(self)})")
        shard = int(np.searchsorted(self.doc_starts, global_id, side="right")) - 1
        return shard, global_id - int(self.doc_starts[shard])

    def get_doc(self, shard: int, doc: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64 (L,), loss_spans int32 (S, 2)) of `doc` in `shard`, as fresh copies."""
        f = self._open()[shard]
        return f.doc(doc).astype(np.int64), np.array(f.loss_spans(doc), dtype=np.int32)

    def get(self, global_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.get_doc(*self.locate(global_id))

    def source(self, shard: int, doc: int) -> str:
        return self._open()[shard].source(doc)

    @property
    def lengths(self) -> np.ndarray:
        """int32 tokens per global doc."""
        files = self._open()
        return np.concatenate([f.doc_lengths for f in files]) if files else np.zeros(0, np.int32)

    @property
    def loss_token_counts(self) -> np.ndarray:
        """int64 trained tokens per global doc."""
        files = self._open()
        return np.concatenate([f.loss_token_counts for f in files]) if files else np.zeros(0, np.int64)

    def close(self) -> None:
        if self._pid == os.getpid():
            for f in self._files:
                f.close()
        self._files, self._pid = [], None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"], state["_pid"] = [], None  # the receiving process maps the shards itself
        return state


UNTAGGED = "(none)"  # the tag label of untagged documents in a breakdown, when other documents have tags


class IndexedDataset:
    """One split of a dataset index as a map-style dataset: `ds[i] -> (input_ids int64, loss_spans int32 (S, 2))`.

    `lengths` (int32) and `loss_token_counts` (int32) are per item, in the same order, for the planner;
    `vocab_size` comes from the shards. Works as a
    `torch.utils.data.Dataset` (duck-typed: `__len__` and `__getitem__`), including in forked or spawned workers.
    """

    def __init__(self, index: str | Path | IndexData, split: str = "train", verify: bool = False):
        """`verify=True` checks, before anything is read, that every index array and every shard file is byte for
        byte what the index recorded (sha256): one read of the data, once per process."""
        self.index = index if isinstance(index, IndexData) else load_index(index, verify=verify)
        if verify:
            self._verify_shards()
        self.split = split
        self.vocab_size: int | None = self.index.meta.get("vocab_size")
        self.ids = np.asarray(self.index.ids(split))
        self._shard = np.asarray(self.index.shard)[self.ids]
        self._doc = np.asarray(self.index.doc)[self.ids]
        self.lengths = np.asarray(self.index.length)[self.ids]
        self.loss_token_counts = np.asarray(self.index.loss_tokens)[self.ids]
        # Which data source each item came from: `source_names[source_ids[i]]`.
        self.source_names = self.index.source_names
        self.source_ids = self.index.source[self.ids]
        # Each item's tag: `tag_names[tag_ids[i]]`, -1 for an untagged one.
        self.tag_names = self.index.tag_names
        self.tag_ids = np.asarray(self.index.tag)[self.ids]
        self.reader = DocumentReader(self.index.shard_paths)
        self._check_shards()

    def _verify_shards(self) -> None:
        for path, meta in zip(self.index.shard_paths, self.index.meta["shards"], strict=True):
            if sha256_file(path) != meta["sha256"]:
                raise ValueError(
                    f"{path}: the shard changed since the dataset index {self.index.dir} was built (sha256 "
                    "mismatch); rerun the data stage (sftflow data, or sftflow run --force data)"
                )

    def _check_shards(self) -> None:
        """Cheap consistency check: the shards still have the documents and lengths the index recorded."""
        for s, (path, meta) in enumerate(zip(self.reader.paths, self.index.meta["shards"], strict=True)):
            f = self.reader._open()[s]
            rows = np.flatnonzero(np.asarray(self.index.shard) == s)
            if len(f) != meta["num_docs"] or not np.array_equal(
                f.doc_lengths[np.asarray(self.index.doc)[rows]], np.asarray(self.index.length)[rows]
            ):
                raise ValueError(f"{path}: shard no longer matches the dataset index in {self.index.dir}; rebuild it")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.split} item {i} out of range (split has {len(self)})")
        return self.reader.get_doc(int(self._shard[i]), int(self._doc[i]))

    get = __getitem__

    def source(self, i: int) -> str:
        """`"path:line"` of item `i`, for error messages and inspection."""
        return self.reader.source(int(self._shard[i]), int(self._doc[i]))

    def tag(self, i: int) -> str | None:
        k = int(self.tag_ids[i])
        return None if k < 0 else self.tag_names[k]

    def tag_labels(self, items: np.ndarray) -> list[str] | None:
        """The tags of `items` for a per-tag breakdown, `UNTAGGED` for an untagged one; None when no item of the
        dataset has a tag."""
        if not self.tag_names:
            return None
        return [UNTAGGED if k < 0 else self.tag_names[k] for k in self.tag_ids[np.asarray(items, dtype=np.int64)]]

    def trainable_target_counts(self) -> np.ndarray:
        """Per item: trained tokens that are real targets, i.e. not a document's first token (nothing predicts it).

        This is what the collator counts, so a plan built from these has per-step denominators equal to the tokens
        the loss sums over. The index stores them, so nothing here reads the shards.
        """
        return np.asarray(self.index.targets, dtype=np.int64)[self.ids]
