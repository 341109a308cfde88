"""A mock document source: random-token documents with configured lengths, so training and benchmarks run without I/O.

`MockDataset` has the interface of the dataset index reader (`sftflow.tasks.data.reader.IndexedDataset`): `len()`,
`lengths`, `loss_token_counts` and `ds[i] -> (ids, loss_spans)`. Training does not read it directly: benchmarks and
tests write it out with `write_mock_index` as a real dataset index folder, which `TrainConfig.data` names like any
other data, so the production config and the worker know one data source only.

Lengths and span parameters for all documents are drawn once, vectorised (a few bytes per document); the tokens of
document `i` are derived from `(seed, i)` on access, so reading a document is O(its length) and independent of every
other document.

Loss spans are off by default: each document is then one span `[0, L)`, i.e. every token is trained. With
`loss_spans=True` a document is cut into 1..`max_spans` equal "turns" and the trailing 20-80% of each turn is trained,
like assistant replies that follow prompts.

`loss_token_counts[i]` counts the *trainable targets* of document `i`: tokens inside a span other than token 0,
which is never a target (nothing precedes it in its document). This equals what the collators report as
`num_loss_tokens` (see `sftflow.tasks.train.collate.trainable_target_count`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class MockConfig(BaseModel):
    """Mock data. Lengths: `lognormal` (median `median_length`, log-std `sigma`), `uniform` in
    [`min_length`, `max_length`] or `fixed` (= `median_length`); always clipped to [`min_length`, `max_length`].
    Tokens: `random` (uniform ids in [`min_token_id`, `vocab_size`)) or `arithmetic` (`ids[t] = (a + k t) mod V`
    from a random start and step, which a model can learn to continue)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_docs: int = Field(1000, ge=0)
    vocab_size: int = Field(32000, ge=2)
    min_token_id: int = Field(0, ge=0)
    length_distribution: Literal["lognormal", "uniform", "fixed"] = "lognormal"
    median_length: int = Field(600, ge=1)
    sigma: float = Field(1.0, ge=0)
    min_length: int = Field(1, ge=1)
    max_length: int = Field(8192, ge=1)
    tokens: Literal["random", "arithmetic"] = "random"
    loss_spans: bool = False
    max_spans: int = Field(4, ge=1, le=64)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_ranges(self) -> MockConfig:
        if self.min_length > self.max_length:
            raise ValueError(f"min_length={self.min_length} is greater than max_length={self.max_length}")
        if self.min_token_id >= self.vocab_size:
            raise ValueError(f"min_token_id={self.min_token_id} must be below vocab_size={self.vocab_size}")
        return self


def sample_lengths(config: MockConfig) -> np.ndarray:
    """The `(num_docs,)` int32 document lengths of `config` (the same draw `MockDataset` uses)."""
    rng = np.random.default_rng([config.seed, 0])
    n = config.num_docs
    if config.length_distribution == "lognormal":
        raw = np.rint(rng.lognormal(mean=np.log(config.median_length), sigma=config.sigma, size=n))
    elif config.length_distribution == "uniform":
        raw = rng.integers(config.min_length, config.max_length, size=n, endpoint=True)
    else:
        raw = np.full(n, config.median_length)
    return np.clip(raw, config.min_length, config.max_length).astype(np.int32)


def _span_bounds(lengths: np.ndarray, num_spans: np.ndarray, fractions: np.ndarray, max_spans: int):
    """`(N, max_spans)` start/end arrays; turn j of doc i trains the trailing `fractions[i]` of its segment.

    Unused turns (j >= num_spans[i]) and empty spans have start == end. One vectorised code path serves both the
    bulk counts and single-document access, so the two can never disagree.
    """
    lengths = lengths.astype(np.int64)[:, None]
    j = np.arange(max_spans, dtype=np.int64)[None, :]
    n = num_spans.astype(np.int64)[:, None]
    seg_end = (j + 1) * lengths // n
    seg_start = j * lengths // n
    width = np.ceil(fractions[:, None] * (seg_end - seg_start)).astype(np.int64)
    starts = np.where(j < n, seg_end - width, 0)
    ends = np.where(j < n, seg_end, 0)
    return starts, ends


class MockDataset:
    """Random-token documents; see the module docstring. Deterministic from `config` alone."""

    def __init__(self, config: MockConfig):
        self.config = config
        self.lengths = sample_lengths(config)
        if config.loss_spans:
            rng = np.random.default_rng([config.seed, 1])
            self._num_spans = rng.integers(1, config.max_spans, size=config.num_docs, endpoint=True).astype(np.int8)
            self._fractions = rng.uniform(0.2, 0.8, size=config.num_docs)
            starts, ends = _span_bounds(self.lengths, self._num_spans, self._fractions, config.max_spans)
            self.loss_token_counts = np.maximum(ends - np.maximum(starts, 1), 0).sum(axis=1)
        else:
            self.loss_token_counts = self.lengths.astype(np.int64) - 1

    def __len__(self) -> int:
        return self.config.num_docs

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"mock document {i} is out of range for {len(self)} documents")
        cfg = self.config
        length = int(self.lengths[i])
        rng = np.random.default_rng([cfg.seed, 2, i])
        if cfg.tokens == "random":
            ids = rng.integers(cfg.min_token_id, cfg.vocab_size, size=length, dtype=np.int64)
        else:
            span = cfg.vocab_size - cfg.min_token_id
            start, step = rng.integers(0, span), rng.integers(1, max(2, min(span, 17)))
            ids = cfg.min_token_id + (start + step * np.arange(length, dtype=np.int64)) % span
        if not cfg.loss_spans:
            return ids, np.array([[0, length]], dtype=np.int32)
        one = slice(i, i + 1)
        starts, ends = _span_bounds(self.lengths[one], self._num_spans[one], self._fractions[one], cfg.max_spans)
        keep = ends[0] > starts[0]
        return ids, np.stack([starts[0][keep], ends[0][keep]], axis=1).astype(np.int32)


def write_mock_index(config: MockConfig, folder: str | Path) -> Path:
    """`config`'s documents as a dataset index folder (`folder/index.json`, one shard in `folder/shard.pbin`).

    Nothing is filtered, deduplicated or held out, so item `i` of the index's train split is `MockDataset(config)[i]`
    and a plan made from `MockDataset(config)` trains on it unchanged. Needs numpy only (no prefect, no torch), so the
    GPU benchmarks can call it.
    """
    from sftflow.tasks.data.index import build_index
    from sftflow.tasks.data.pbin import write_pbin
    from sftflow.tasks.data.records import TokenizedDoc

    dataset = MockDataset(config)
    docs = [TokenizedDoc(*dataset[i], source=f"mock:{i}") for i in range(len(dataset))]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    provenance = {"mock": config.model_dump_json()}
    write_pbin(folder / "shard.pbin", docs, vocab_size=config.vocab_size, provenance=provenance)
    build_index([folder / "shard.pbin"], folder, dedup=False, eval_fraction=0.0)
    return folder
