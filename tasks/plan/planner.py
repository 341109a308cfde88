"""The `plan` stage: every optimizer step × micro-batch × rank → the documents of one packed row.

`plan(lengths, loss_token_counts, config)` is a pure function: the same inputs give the same arrays, and
`save_plan` writes them byte-identically. Training reads row `(step * M + micro_batch) * num_ranks + rank`, so resuming
at step k is just reading from row `k * M * num_ranks`: nothing in the plan depends on what training consumed.

Packing (mode `packed`), per epoch, from a permutation seeded by `(seed, epoch)`:

1. **Rows.** LPT with a capacity check over windows of the permuted stream (`sftflow.tasks.plan.packing.lpt_pack_rows`):
   rows come out ~99.8% full, documents that do not fit carry to the next round.
2. **Micro-batches.** Rows are sorted by cost `a·L + b·L²` (summed over the row's documents) and cut into groups of
   `num_ranks` neighbours, so the ranks of one micro-batch get rows of near-equal cost *and* near-equal tokens
   (the rows are full). The order of micro-batches is then shuffled, and ranks are shuffled within a micro-batch.
3. **Steps.** `micro_batches_per_step` consecutive micro-batches. The cheapest `rows mod (num_ranks · M)` rows
   (the partly filled tail) are not left as a ragged step: their documents are LPT-spread over a full final step so
   every rank has work, or dropped with `drop_last`. A rank may still get an empty row when there are fewer
   documents than rows; the collator turns it into one untrained pad token.

`padded` rows hold documents whose `count × longest` fits `tokens_per_rank`; `iterative` rows hold one document each,
in permutation order (`shuffle=False`: index order), for evaluation and debugging.
"""

from __future__ import annotations

import io
import logging
import time
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.plan.config import PlanConfig, PlanStats
from sftflow.tasks.plan.mixture import DocSources, Mixture, resolve_mixture, source_stats
from sftflow.tasks.plan.packing import lpt_pack_rows, lpt_redistribute, padded_pack_rows, row_sums

log = logging.getLogger(__name__)

PLAN_FORMAT_VERSION = 1


def cost_coefficients_from_model(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    num_kv_heads: int | None = None,
) -> tuple[float, float]:
    """Training FLOPs (forward + backward = 3× forward) of a Llama-style decoder, as `(a, b)`.

    `a`: matmul FLOPs per token: q/k/v/o projections, the gated MLP (3 matrices) and the LM head, ×2 for
    multiply-add, ×3 for forward and backward. `b`: causal attention FLOPs per token pair: `QKᵀ` and `PV` are
    `2·2·L²·heads·head_dim` per layer, halved by the causal mask, ×3 for forward and backward.
    For Llama-3.2-1B this gives `b/a ≈ 1/37,700`: attention is a few percent at 8k tokens.
    """
    kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
    attention_proj = hidden_size * head_dim * (2 * num_heads + 2 * kv_heads)
    mlp = 3 * hidden_size * intermediate_size
    a = 6.0 * (num_layers * (attention_proj + mlp) + hidden_size * vocab_size)
    b = 6.0 * num_layers * num_heads * head_dim
    return a, b


@dataclass(frozen=True)
class PlanArrays:
    """The plan. Row `i = (step·M + micro_batch)·num_ranks + rank` holds `doc_ids[row_ptr[i]:row_ptr[i+1]]`."""

    doc_ids: np.ndarray  # int64 (D,): indices into the lengths / the index's train split
    row_ptr: np.ndarray  # int64 (rows + 1,)
    row_tokens: np.ndarray  # int64 (rows,): real tokens per row
    row_loss_tokens: np.ndarray  # int64 (rows,): trainable targets per row
    row_max_seqlen: np.ndarray  # int64 (rows,): longest document in the row (0 for an empty row)
    step_loss_tokens: np.ndarray  # int64 (steps,): global trainable targets per step (the loss denominator)
    step_tokens: np.ndarray  # int64 (steps,): real tokens per step
    epoch_of_step: np.ndarray  # int64 (steps,)
    dropped_doc_ids: np.ndarray  # int64: documents of dropped final steps (drop_last), all epochs
    num_ranks: int
    steps_per_epoch: int  # steps of epoch 0 (later epochs may differ by a step or so; `epoch_of_step` is exact)
    micro_batches_per_step: int
    tokens_per_rank: int
    mode: str

    @property
    def num_steps(self) -> int:
        return len(self.step_loss_tokens)

    def step_rows(self, step: int) -> list[list[np.ndarray]]:
        """`[micro_batch][rank] -> doc ids` of one step: what training reads to run `step` (and to resume at it)."""
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} is out of range for a plan of {self.num_steps} steps")
        first = step * self.micro_batches_per_step * self.num_ranks
        return [
            [
                self.doc_ids[self.row_ptr[row] : self.row_ptr[row + 1]]
                for row in range(first + m * self.num_ranks, first + (m + 1) * self.num_ranks)
            ]
            for m in range(self.micro_batches_per_step)
        ]


def _check_inputs(lengths: np.ndarray, loss_token_counts: np.ndarray, config: PlanConfig, describe) -> None:
    config.require_resolved()
    if lengths.ndim != 1 or loss_token_counts.shape != lengths.shape:
        raise ValueError(
            f"lengths {lengths.shape} and loss_token_counts {loss_token_counts.shape} must be 1-D of equal length"
        )
    if len(lengths) == 0:
        raise ValueError("nothing to plan: the dataset has 0 documents")
    if lengths.min() < 1:
        doc = int(np.argmin(lengths))
        raise ValueError(f"{describe(doc)} has length {int(lengths[doc])}; every document needs at least 1 token")
    too_long = lengths > config.tokens_per_rank
    if too_long.any() and (config.too_long == "error" or too_long.all()):
        doc = int(np.argmax(lengths))
        every = " (every document is)" if too_long.all() else ""
        raise ValueError(
            f"{describe(doc)} has {int(lengths[doc])} tokens, more than a row holds (tokens_per_rank="
            f"{config.tokens_per_rank}){every}; raise plan.tokens_per_rank (--tokens-per-rank), or drop or truncate "
            "long documents with data.spans.max_length (--max-length)"
            + ("" if too_long.all() else ", or set plan.too_long: drop to leave them out")
        )
    if (loss_token_counts < 0).any() or (loss_token_counts > lengths).any():
        doc = int(np.argmax((loss_token_counts < 0) | (loss_token_counts > lengths)))
        raise ValueError(f"{describe(doc)}: loss_token_counts={int(loss_token_counts[doc])} is outside [0, length]")


def _epoch_stream(num_docs: int, config: PlanConfig, mixture: Mixture | None, rng: np.random.Generator):
    """The documents of one epoch in visiting order: each once, or the mixture's draw (repeats allowed)."""
    if mixture is None:
        return rng.permutation(num_docs) if config.shuffle else np.arange(num_docs)
    docs = mixture.draw(rng)
    return rng.permutation(docs) if config.shuffle else np.sort(docs, kind="stable")


def _epoch_rows(lengths: np.ndarray, stream: np.ndarray, config: PlanConfig):
    """Rows of one epoch before grouping: `(doc_ids, row_of_doc, num_rows)`."""
    if config.mode == "packed":
        return lpt_pack_rows(lengths, stream, config.tokens_per_rank)
    if config.mode == "padded":
        return padded_pack_rows(lengths, stream, config.tokens_per_rank)
    return stream.astype(np.int64), np.arange(len(stream), dtype=np.int64), len(stream)


def _resolve_micro_batches(config: PlanConfig, total_loss_tokens: int, num_rows: int) -> int:
    if config.micro_batches_per_step is not None:
        return config.micro_batches_per_step
    if config.target_tokens_per_step is None:
        return 1
    if total_loss_tokens == 0:
        raise ValueError("target_tokens_per_step needs trainable tokens, but the dataset has none")
    loss_per_micro_batch = total_loss_tokens / num_rows * config.num_ranks
    return max(1, round(config.target_tokens_per_step / loss_per_micro_batch))


def _arrange_epoch(lengths, doc_ids, row_of_doc, num_rows, config: PlanConfig, m: int, rng: np.random.Generator):
    """Order the epoch's rows into steps; returns `(doc_ids, slot_of_doc, num_slots, dropped_doc_ids)` where a slot
    is a row position in the epoch's step-major layout."""
    n = config.num_ranks
    per_step = n * m
    doc_cost = config.doc_cost
    padded = config.mode == "padded"
    if config.mode == "iterative":
        full = num_rows // per_step * per_step
        slot = np.arange(num_rows, dtype=np.int64)
        if config.drop_last and full < num_rows:
            return doc_ids[:full], slot[:full], full, doc_ids[full:]
        num_slots = -(-num_rows // per_step) * per_step
        return doc_ids, slot, num_slots, np.zeros(0, dtype=np.int64)

    _, _, cost = row_sums(lengths, doc_ids, row_of_doc, num_rows, doc_cost, padded)
    by_cost = np.lexsort((np.arange(num_rows), cost))  # cheapest first; row id breaks ties
    rest = num_rows % per_step
    tail_rows, body_rows = by_cost[:rest], by_cost[rest:]
    # body: neighbours in cost order form a micro-batch; shuffle micro-batches, then ranks within each
    num_groups = len(body_rows) // n
    groups = body_rows.reshape(num_groups, n)
    groups = groups[rng.permutation(num_groups)]
    groups = np.take_along_axis(groups, np.argsort(rng.random((num_groups, n)), axis=1), axis=1)
    slot_of_row = np.empty(num_rows, dtype=np.int64)
    slot_of_row[groups.reshape(-1)] = np.arange(num_groups * n)
    num_slots = num_groups * n
    in_tail = np.zeros(num_rows, dtype=bool)
    in_tail[tail_rows] = True
    tail_doc = in_tail[row_of_doc]
    body_docs, body_slots = doc_ids[~tail_doc], slot_of_row[row_of_doc[~tail_doc]]
    tail_docs = doc_ids[tail_doc]
    if rest == 0:
        return body_docs, body_slots, num_slots, np.zeros(0, dtype=np.int64)
    if config.drop_last:
        return body_docs, body_slots, num_slots, tail_docs
    # final step: spread the tail's documents over all num_ranks × M rows, balancing cost
    tail_row = lpt_redistribute(lengths[tail_docs].astype(np.int64), per_step, config.tokens_per_rank, doc_cost, padded)
    if tail_row is None:  # LPT could not fit them: keep their original rows
        tail_row = np.searchsorted(np.sort(tail_rows), row_of_doc[tail_doc])
    _, _, tail_cost = row_sums(lengths, tail_docs, tail_row, per_step, doc_cost, padded)
    tail_slot_of_row = np.empty(per_step, dtype=np.int64)
    tail_slot_of_row[np.lexsort((np.arange(per_step), tail_cost))] = np.arange(per_step)
    return (
        np.concatenate([body_docs, tail_docs]),
        np.concatenate([body_slots, num_slots + tail_slot_of_row[tail_row]]),
        num_slots + per_step,
        np.zeros(0, dtype=np.int64),
    )


def plan(
    lengths: np.ndarray,
    loss_token_counts: np.ndarray,
    config: PlanConfig,
    describe=lambda doc: f"doc {doc}",
    sources: DocSources | None = None,
) -> tuple[PlanArrays, PlanStats]:
    """Plan `config.epochs` epochs over documents with the given lengths and trainable-target counts.

    `loss_token_counts[i]` must count the targets the collator will train for doc `i` (tokens in loss spans other
    than the doc's first token), so `step_loss_tokens` equals the sum of the step's `num_loss_tokens`. `describe(i)`
    names doc `i` in error messages (its `file:line`, when the caller knows it). `sources` (each document's source)
    is needed for `config.mixture` and adds per-source statistics.
    """
    start = time.perf_counter()
    lengths = np.asarray(lengths).astype(np.int64)
    loss_token_counts = np.asarray(loss_token_counts).astype(np.int64)
    _check_inputs(lengths, loss_token_counts, config, describe)
    if config.mixture and sources is None:
        raise ValueError("a mixture needs each document's source (plan from a dataset index)")
    mixture = resolve_mixture(config.mixture, sources, loss_token_counts) if config.mixture else None
    too_long = lengths > config.tokens_per_rank
    if too_long.any():  # `too_long: drop` (`error` raised above): left out of every epoch, with a warning
        doc = int(np.argmax(lengths))
        log.warning(
            "plan: %d document(s) longer than a row (tokens_per_rank=%d) left out, the longest %s with %d tokens; "
            "raise plan.tokens_per_rank to train them, or set plan.too_long: error to stop instead",
            int(too_long.sum()),
            config.tokens_per_rank,
            describe(doc),
            int(lengths[doc]),
        )
    n = config.num_ranks
    doc_parts, slot_parts, dropped_parts, epoch_slots = [], [], [], []
    m = None
    slot_base = 0
    for epoch in range(config.epochs):
        rng = np.random.default_rng([config.seed, epoch])
        stream = _epoch_stream(len(lengths), config, mixture, rng)
        if too_long.any():
            stream = stream[~too_long[stream]]
        if len(stream) == 0:
            raise ValueError("nothing to plan: the mixture draws no documents")
        doc_ids, row_of_doc, num_rows = _epoch_rows(lengths, stream, config)
        if m is None:
            m = _resolve_micro_batches(config, int(loss_token_counts[stream].sum()), num_rows)
        docs, slots, num_slots, dropped = _arrange_epoch(lengths, doc_ids, row_of_doc, num_rows, config, m, rng)
        doc_parts.append(docs)
        slot_parts.append(slots + slot_base)
        dropped_parts.append(dropped)
        epoch_slots.append(num_slots)
        slot_base += num_slots
    rows_per_step = n * m
    steps_per_epoch = [s // rows_per_step for s in epoch_slots]
    epoch_of_step = np.repeat(np.arange(config.epochs, dtype=np.int64), steps_per_epoch)
    all_docs, all_slots = np.concatenate(doc_parts), np.concatenate(slot_parts)
    num_rows = slot_base
    if config.max_steps is not None and config.max_steps < len(epoch_of_step):
        num_rows = config.max_steps * rows_per_step
        keep = all_slots < num_rows
        all_docs, all_slots = all_docs[keep], all_slots[keep]
        epoch_of_step = epoch_of_step[: config.max_steps]
        steps_per_epoch = np.bincount(epoch_of_step, minlength=config.epochs).tolist()
    order = np.argsort(all_slots, kind="stable")
    doc_ids, slot_of_doc = all_docs[order], all_slots[order]
    row_ptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(slot_of_doc, minlength=num_rows), out=row_ptr[1:])
    row_tokens = np.bincount(slot_of_doc, weights=lengths[doc_ids], minlength=num_rows).astype(np.int64)
    row_loss = np.bincount(slot_of_doc, weights=loss_token_counts[doc_ids], minlength=num_rows).astype(np.int64)
    row_max = np.zeros(num_rows, dtype=np.int64)
    np.maximum.at(row_max, slot_of_doc, lengths[doc_ids])
    arrays = PlanArrays(
        doc_ids=doc_ids,
        row_ptr=row_ptr,
        row_tokens=row_tokens,
        row_loss_tokens=row_loss,
        row_max_seqlen=row_max,
        step_loss_tokens=row_loss.reshape(-1, rows_per_step).sum(axis=1),
        step_tokens=row_tokens.reshape(-1, rows_per_step).sum(axis=1),
        epoch_of_step=epoch_of_step,
        dropped_doc_ids=np.concatenate(dropped_parts).astype(np.int64),
        num_ranks=n,
        steps_per_epoch=int(steps_per_epoch[0]),
        micro_batches_per_step=m,
        tokens_per_rank=config.tokens_per_rank,
        mode=config.mode,
    )
    stats = plan_stats(arrays, lengths, config, steps_per_epoch, time.perf_counter() - start)
    stats = stats.model_copy(update={"too_long_docs": int(too_long.sum())})
    if sources is not None:
        requested = mixture.requested if mixture is not None else None
        per_source = source_stats(sources, loss_token_counts, doc_ids, requested, config.epochs)
        stats = stats.model_copy(update={"sources": per_source})
    return arrays, stats


def _imbalance(per_row: np.ndarray, num_ranks: int) -> tuple[float, float]:
    per_mb = per_row.reshape(-1, num_ranks)
    mean = per_mb.mean(axis=1)
    busy = mean > 0
    if not busy.any():
        return 1.0, 1.0
    ratio = per_mb[busy].max(axis=1) / mean[busy]
    return float(ratio.mean()), float(np.percentile(ratio, 99))


def plan_stats(
    arrays: PlanArrays, lengths: np.ndarray, config: PlanConfig, steps_per_epoch: list[int], seconds: float
) -> PlanStats:
    """Efficiency and balance of a plan (compute tokens and cost count padding in `padded` mode)."""
    doc_cost = config.doc_cost
    num_rows = len(arrays.row_ptr) - 1
    slot = np.repeat(np.arange(num_rows), np.diff(arrays.row_ptr))
    _, compute, cost = row_sums(lengths, arrays.doc_ids, slot, num_rows, doc_cost, config.mode == "padded")
    token_mean, token_p99 = _imbalance(compute, arrays.num_ranks)
    cost_mean, cost_p99 = _imbalance(cost, arrays.num_ranks)
    total = int(arrays.row_tokens.sum())
    return PlanStats(
        efficiency=total / max(1, num_rows * config.tokens_per_rank),
        token_imbalance=token_mean,
        token_imbalance_p99=token_p99,
        cost_imbalance=cost_mean,
        cost_imbalance_p99=cost_p99,
        num_steps=arrays.num_steps,
        steps_per_epoch=list(steps_per_epoch),
        num_rows=num_rows,
        num_empty_rows=int((np.diff(arrays.row_ptr) == 0).sum()),
        micro_batches_per_step=arrays.micro_batches_per_step,
        total_tokens=total,
        total_loss_tokens=int(arrays.row_loss_tokens.sum()),
        avg_doc_length=total / max(1, len(arrays.doc_ids)),
        planning_seconds=seconds,
        dropped_docs=len(arrays.dropped_doc_ids),
    )


def save_plan(arrays: PlanArrays, path: str | Path) -> None:
    """Write `plan.npz` byte-deterministically (fixed zip timestamps; `np.savez` stamps the current time)."""
    path = Path(path)
    entries = {f.name: getattr(arrays, f.name) for f in fields(arrays)}
    entries["format_version"] = PLAN_FORMAT_VERSION
    with atomic_writer(path) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, value in entries.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.asarray(value), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buffer.getvalue())


def load_plan(path: str | Path) -> PlanArrays:
    """Read a `plan.npz` written by `save_plan` (no pickle)."""
    with np.load(path, allow_pickle=False) as data:
        version = int(data["format_version"])
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"{path}: plan format_version {version}; this sftflow reads {PLAN_FORMAT_VERSION}")
        values = {}
        for f in fields(PlanArrays):
            if f.name not in data:
                raise ValueError(f"{path}: plan is missing the array {f.name!r}")
            values[f.name] = data[f.name]
    for name in ("num_ranks", "steps_per_epoch", "micro_batches_per_step", "tokens_per_rank"):
        values[name] = int(values[name])
    values["mode"] = str(values["mode"])
    return PlanArrays(**values)
