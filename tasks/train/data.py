"""What one rank trains on at each step: the plan's rows, read from the dataset and collated.

The plan (`plan.npz`, see `sftflow.tasks.plan.planner`) lists rows step-major, then micro-batch, then plan rank:
row `(step * micro_batches_per_step + m) * num_ranks + r` holds `doc_ids[row_ptr[row]:row_ptr[row + 1]]`.

The plan's `num_ranks` need not equal the world size: it must be a multiple of it, and each worker then trains the
rows of `num_ranks / world_size` consecutive plan ranks as extra micro-batches. The loss is normalised by the step's
global trained-token count either way, so a plan made for 2 ranks trains the same model on 1 rank (up to float
summation order). This is what lets a 2-rank checkpoint resume on 1 rank and back, on the same plan.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from sftflow.tasks.plan.planner import PlanArrays
from sftflow.tasks.plan.planner import load_plan as _load_plan
from sftflow.tasks.train.breakdown import Breakdown, doc_of_target
from sftflow.tasks.train.collate import collate, packed_collator, padded_collator

PLAN_FILE = "plan.npz"


def plan_path(plan: str | Path) -> Path:
    """`plan.npz` itself, or the plan stage's output folder holding it."""
    path = Path(plan)
    if path.is_dir():
        path = path / PLAN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no plan; run the plan stage first (sftflow plan)")
    return path


def load_plan(plan: str | Path) -> PlanArrays:
    path = plan_path(plan)
    try:
        return _load_plan(path)
    except (zipfile.BadZipFile, EOFError, KeyError, OSError, ValueError) as err:  # a damaged zip or array in it
        if isinstance(err, ValueError) and str(path) in str(err):
            raise
        raise ValueError(f"{path}: not a readable plan ({err}); rerun the plan stage (sftflow plan)") from None


def plan_row(plan: PlanArrays, step: int, micro_batch: int, plan_rank: int) -> np.ndarray:
    row = (step * plan.micro_batches_per_step + micro_batch) * plan.num_ranks + plan_rank
    return plan.doc_ids[plan.row_ptr[row] : plan.row_ptr[row + 1]]


def open_dataset(data: str | Path, split: str):
    """The document source: one split of a dataset index folder."""
    from sftflow.tasks.data.reader import IndexedDataset

    return IndexedDataset(data, split=split)


def dataset_vocab_size(dataset) -> int | None:
    value = getattr(dataset, "vocab_size", None)
    return None if value is None else int(value)


class RankBatches:
    """The collated micro-batches of one rank for a step. With a `breakdown`, each also carries `loss_row_cells`:
    the source and tag cells of its trained targets (`sftflow.tasks.train.breakdown`)."""

    def __init__(
        self,
        plan: PlanArrays,
        dataset,
        *,
        rank: int,
        world_size: int,
        pad_id: int = 0,
        breakdown: Breakdown | None = None,
    ):
        if plan.num_ranks % world_size != 0:
            raise ValueError(
                f"the plan is for {plan.num_ranks} ranks, which the world size {world_size} does not "
                "divide; re-plan for this world size or run with a divisor of it"
            )
        if plan.mode not in ("packed", "padded", "iterative"):
            raise ValueError(f"unknown plan mode {plan.mode!r}")
        per_worker = plan.num_ranks // world_size
        self.plan_ranks = range(rank * per_worker, (rank + 1) * per_worker)
        self.plan = plan
        self.dataset = dataset
        self.packed = plan.mode != "padded"
        self.fns = packed_collator(pad_id) if self.packed else padded_collator(pad_id)
        self.breakdown = breakdown

    def __call__(self, step: int) -> list[dict]:
        batches = []
        for m in range(self.plan.micro_batches_per_step):
            for r in self.plan_ranks:
                ids = plan_row(self.plan, step, m, r)
                batch = collate([self.dataset[int(i)] for i in ids], self.fns)
                if self.breakdown is not None:
                    batch["loss_row_cells"] = self.breakdown.row_cells(ids, doc_of_target(batch))
                batches.append(batch)
        return batches


def trained_tokens_by_source(plan, dataset) -> tuple[list[str], np.ndarray] | None:
    """Per planned step, the trained targets of each data source, `(names, int64 (steps, sources))`; None for data
    of one source (or without sources, as the mock data). Read from the plan and the index on the host, once."""
    names = getattr(dataset, "source_names", None)
    if not names or len(names) < 2:
        return None
    rows_per_step = plan.num_ranks * plan.micro_batches_per_step
    row_of_doc = np.repeat(np.arange(len(plan.row_ptr) - 1), np.diff(plan.row_ptr))
    step_of_doc = row_of_doc // rows_per_step
    source = np.asarray(dataset.source_ids)[plan.doc_ids]
    targets = dataset.trainable_target_counts()[plan.doc_ids]
    cell = step_of_doc * len(names) + source
    counts = np.bincount(cell, weights=targets, minlength=plan.num_steps * len(names))
    return list(names), counts.astype(np.int64).reshape(plan.num_steps, len(names))
