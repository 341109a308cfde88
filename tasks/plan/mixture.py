"""Data mixtures: how many trained tokens each source gives an epoch, and which whole documents make them up.

A source's request `R` (trained tokens, i.e. prediction targets, per epoch) comes from its `SourceShare`, with `A`
the source's trained tokens in the train split (one pass):

- `epochs` e: `R = e·A`; a source without a share is taken once (`e = 1`);
- `max_tokens` m: `R = min(m, A)` (a cap: a smaller source is taken once, not repeated);
- `weight` w: a share of the whole mix. When every source has a weight, the mix is as large as one pass over all of
  them, `T = ΣA`, and `R = T·w/Σw`. When other sources have fixed amounts (`F`, the sum of their `R`), the weights
  are shares of the whole and must sum below 1: `T = F/(1 − Σw)`, `R = T·w`.
- a `weight` or `epochs` of 0 leaves a source out: `R = 0`, and it is no part of `T`.

Each epoch draws, per source, `⌊R/A⌋` whole passes plus the prefix of a seeded permutation of its documents whose
trained tokens come closest to the rest, so that an epoch's planned tokens of a source are within half a document
of its request. Documents are drawn whole: up-sampling repeats them, down-sampling leaves some out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sftflow.tasks.plan.config import SourceShare, SourceStats


@dataclass(frozen=True)
class DocSources:
    """Which source each document of the planned split came from: `names[source_of_doc[i]]`."""

    names: list[str]
    source_of_doc: np.ndarray  # int (D,)


@dataclass(frozen=True)
class Mixture:
    sources: DocSources
    targets: np.ndarray  # int64 (D,): trained targets per document
    available: np.ndarray  # int64 (S,): trained targets per source, one pass
    requested: np.ndarray  # float64 (S,): trained targets asked for per epoch

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """One epoch's documents (ids, repeats allowed), grouped by source; the caller shuffles them."""
        parts = []
        for s in range(len(self.sources.names)):
            docs = np.flatnonzero(self.sources.source_of_doc == s)
            if self.requested[s] <= 0 or len(docs) == 0:
                continue
            passes = int(self.requested[s] // self.available[s])
            rest = self.requested[s] - passes * self.available[s]
            order = rng.permutation(docs)
            reached = np.concatenate([[0], np.cumsum(self.targets[order])])
            take = int(np.argmin(np.abs(reached - rest)))
            parts += [docs] * passes + [order[:take]]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def resolve_mixture(shares: Sequence[SourceShare], sources: DocSources, targets: np.ndarray) -> Mixture:
    """The per-epoch request of every source of the index (see the module docstring)."""
    names = sources.names
    by_name = {s.name: s for s in shares}
    unknown = sorted(set(by_name) - set(names))
    if unknown:
        raise ValueError(f"mixture: no source named {unknown} in the dataset index; its sources are {names}")
    targets = np.asarray(targets, dtype=np.int64)
    available = np.bincount(sources.source_of_doc, weights=targets, minlength=len(names)).astype(np.int64)
    requested = np.zeros(len(names))
    weights = np.zeros(len(names))
    excluded = np.zeros(len(names), dtype=bool)
    for s, name in enumerate(names):
        share = by_name.get(name, SourceShare(name=name))
        if share.weight == 0 or share.epochs == 0:
            excluded[s] = True  # left out: requested stays 0
            continue
        asked = share.weight is not None or share.max_tokens is not None or share.epochs is not None
        if asked and available[s] == 0:
            raise ValueError(
                f"mixture: source {name!r} has no trained tokens in the train split, so it cannot be sampled (its "
                "records were rejected, dropped as duplicates of an earlier source's, or all went to eval); drop its "
                "weight, max_tokens or epochs, or check the data stage's rejects and dropped counts"
            )
        if share.weight is not None:
            weights[s] = share.weight
        elif share.max_tokens is not None:
            requested[s] = min(share.max_tokens, available[s])
        else:
            requested[s] = (1.0 if share.epochs is None else share.epochs) * available[s]
    weighted = weights > 0
    # A source without a share and without trained tokens takes no part in the mix; it does not turn the weights
    # into shares of a fixed part that is 0.
    if weighted.any() and (weighted | excluded | (available == 0)).all():
        requested = available[~excluded].sum() * weights / weights.sum()
    elif weighted.any():
        total_weight = weights.sum()
        if total_weight >= 1:
            raise ValueError(
                f"mixture: the weights sum to {total_weight:g}, but sources with epochs or max_tokens take a fixed "
                "part of the mix, so the weights are shares of the whole and must sum below 1 (or weight every source)"
            )
        total = requested[~weighted].sum() / (1 - total_weight)
        requested[weighted] = total * weights[weighted]
    return Mixture(sources=sources, targets=targets, available=available, requested=requested)


def source_stats(
    sources: DocSources,
    targets: np.ndarray,
    planned_doc_ids: np.ndarray,
    requested_per_epoch: np.ndarray | None,
    epochs: int,
) -> list[SourceStats]:
    """Per source: trained tokens asked for (all epochs) and planned. Without a mixture, one pass each is asked."""
    names, of_doc = sources.names, sources.source_of_doc
    targets = np.asarray(targets, dtype=np.int64)
    available = np.bincount(of_doc, weights=targets, minlength=len(names)).astype(np.int64)
    docs = np.bincount(of_doc, minlength=len(names))
    requested = (available if requested_per_epoch is None else requested_per_epoch) * float(epochs)
    planned = np.bincount(of_doc[planned_doc_ids], weights=targets[planned_doc_ids], minlength=len(names))
    visits = np.bincount(of_doc[planned_doc_ids], minlength=len(names))
    total_requested, total_planned = max(float(requested.sum()), 1e-12), max(int(planned.sum()), 1)
    return [
        SourceStats(
            name=name,
            docs=int(docs[s]),
            available_tokens=int(available[s]),
            requested_tokens=float(requested[s]),
            planned_tokens=int(planned[s]),
            planned_docs=int(visits[s]),
            requested_share=float(requested[s]) / total_requested,
            planned_share=int(planned[s]) / total_planned,
        )
        for s, name in enumerate(names)
    ]
