"""One stage run on folders, as the `sftflow plan`, `train` and `eval` commands run it: the command parses its options
into a config, calls one function here, and prints what it returns.

Prefect is imported only where a flow runs (`plan_folder` on a `sftflow data` output): a GPU image without it plans
a bare dataset index and trains (`tests/flows/test_bare_image.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Session = Callable[[Path], AbstractContextManager]


def data_result(data: Path):
    """What `sftflow data` wrote in `data`."""
    from sftflow.flows.data import load_data_result

    if not (data / "data.json").is_file():
        raise ValueError(f"{data}: no `sftflow data` output here (data.json); run `sftflow data --out {data}` first")
    return load_data_result(data)


def index_vocab_size(index_dir: Path) -> int | None:
    return json.loads((index_dir / "index.json").read_text()).get("vocab_size")


def bare_index(data: Path) -> bool:
    """Whether `data` is a dataset index without a `sftflow data` output around it."""
    return (data / "index.json").is_file() and not (data / "data.json").is_file()


def data_inputs(data: Path) -> tuple[str, str | None, str | None, Any]:
    """(index folder, tokenizer, chat template, how the template was chosen) of `data`: a `sftflow data` output, or a
    bare dataset index (whose tokenizer and template are not known: the model's are used)."""
    if bare_index(data):
        return str(data), None, None, None
    if not (data / "data.json").is_file():
        raise ValueError(
            f"{data}: neither a `sftflow data` output (data.json) nor a dataset index (index.json); pass --data DIR"
        )
    result = data_result(data)
    return result.index_dir, result.tokenizer.path, result.chat_template, result.template_choice


@dataclass(frozen=True)
class PlannedFolder:
    """A plan written into `out`: its statistics, the row length (`auto` made a number) and why it has it."""

    out: Path
    stats: Any  # `PlanStats`
    tokens_per_rank: int
    tokens_reason: str

    def summary(self) -> dict:
        s = self.stats
        return {
            "tokens_per_rank": self.tokens_per_rank,
            "efficiency": s.efficiency,
            "token_imbalance": s.token_imbalance,
            "cost_imbalance": s.cost_imbalance,
            "num_steps": s.num_steps,
            "num_rows": s.num_rows,
            "planning_seconds": s.planning_seconds,
            "dropped_docs": s.dropped_docs,
        }


def plan_folder(
    cfg, *, data: Path | None, lengths: Path | None, out: Path | None, force: bool, session: Session
) -> PlannedFolder:
    """Plan into `out` (default: WORK_DIR/plan): document `lengths` (.npy, capacity planning), a bare dataset index
    (plain planning: no cache, no Prefect), or a `sftflow data` output through the `sft-plan` flow, run inside
    `session(out)`."""
    import numpy as np

    from sftflow.flows.config import plan_inputs
    from sftflow.tasks.plan.plan_files import plan_from_index, plan_into
    from sftflow.tasks.plan.row_length import ROW_LENGTH_FILE, read_row_length

    if data is not None and lengths is not None:
        raise ValueError("give one of --data DIR or --lengths FILE.npy, not both")
    out = out or Path(cfg.work_dir) / "plan"
    if lengths is not None:
        doc_lengths = np.load(lengths, allow_pickle=False)
        if doc_lengths.ndim != 1:
            raise ValueError(f"{lengths}: expected a 1-D array of lengths, got shape {doc_lengths.shape}")
        # Without loss spans, every token but each document's first is a trained target.
        targets = np.maximum(doc_lengths - 1, 0)
        config, row_length = plan_inputs(cfg)
        _, stats = plan_into(out, doc_lengths, targets, config, lambda doc: f"{lengths}: doc {doc}", None, row_length)
    elif data is not None and bare_index(data):
        # A dataset index without a `sftflow data` output around it: plain planning (no cache, no Prefect), as
        # `train` takes such an index too.
        config, row_length = plan_inputs(cfg, index_vocab_size(data))
        _, stats = plan_from_index(data, config, out, row_length=row_length)
    else:
        import shutil

        from sftflow.flows.plan import sft_plan

        inputs = data_result(data or Path(cfg.work_dir) / "data")
        with session(out):
            manifest = sft_plan(
                config=cfg.model_copy(update={"work_dir": str(out.resolve())}), data=inputs, force=force
            )
        stats = manifest.stats
        shutil.copyfile(manifest.path, out / "plan.npz")
        # How the rows' length was chosen travels with the plan: `sftflow train --plan OUT` prints it.
        shutil.copyfile(manifest.dir / ROW_LENGTH_FILE, out / ROW_LENGTH_FILE)
    with np.load(out / "plan.npz") as arrays:
        row_tokens = int(arrays["tokens_per_rank"])  # the number `auto` became
    reason = read_row_length(out).reason
    return PlannedFolder(out=out, stats=stats, tokens_per_rank=row_tokens, tokens_reason=reason)


def train_folder_config(cfg, *, data: Path | None, plan: Path | None, out: Path | None):
    """The `TrainConfig` of one run into `out` (default: WORK_DIR/run) on `data` (a `sftflow data` output or a bare
    index, default WORK_DIR/data) and the plan in `plan` (default: WORK_DIR/plan)."""
    from sftflow.tasks.train.config import run_config

    work = Path(cfg.work_dir)
    index_dir, tokenizer, chat_template, choice = data_inputs(data or work / "data")
    return run_config(
        cfg.train, data=index_dir, plan=str(plan or work / "plan"), tokenizer=tokenizer, chat_template=chat_template,
        out=str(out or work / "run"), template_choice=choice,
    )  # fmt: skip


def train_folder(cfg, config):
    """Train `config` (`train_folder_config`) without Prefect; with `track:` in `cfg`, its step metrics go to the
    trackers while it trains (from node 0 only: the others would open runs of their own)."""
    from sftflow.tasks.train.launch import train

    live = None
    if cfg.track.enabled and cfg.train.node_rank == 0:
        from sftflow.tasks.track.live import live_tracker

        live = live_tracker(cfg.track, Path(cfg.work_dir), finish=True)
    return train(config, live=live)


def eval_folder(cfg, *, model: str | None, data: Path | None, base: str | None, out: Path | None) -> str:
    """Evaluate `model` (default: WORK_DIR/run/hf) on `data`'s eval split (default: WORK_DIR/data) into `out`
    (default: WORK_DIR/eval), beside `base` where given (a preset built with `train.seed`); returns the markdown
    summary."""
    from sftflow.tasks.core.manifests import ModelRef
    from sftflow.tasks.eval.report import markdown_summary
    from sftflow.tasks.eval.stage import evaluate_run

    work = Path(cfg.work_dir)
    index_dir, tokenizer, _, _ = data_inputs(data or work / "data")
    model = model or str(work / "run" / "hf")
    out = out or work / "eval"
    base_ref = ModelRef(spec=base, seed=cfg.train.seed) if base else None
    metrics = Path(model).parent / "metrics.jsonl"
    metrics_path = metrics if metrics.is_file() else None
    result, _ = evaluate_run(ModelRef(spec=model), base_ref, index_dir, tokenizer or model, cfg.eval, out, metrics_path)
    return markdown_summary(result, out / "loss_curve.png" if metrics_path else None)
