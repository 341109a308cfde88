"""What a tracker receives about one finished run, gathered from the stages' outputs (`metrics.jsonl`, the eval
report, the loss plot, the exported model): one `RunRecord`, whatever the tracker."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sftflow.tasks.core.manifests import BenchTaskScores, EvalMetrics

_STEP_KEYS_SKIPPED = {"step", "epoch", "eta_s", "epoch_time_s"}  # the x-axis and forecasts


@dataclass
class RunRecord:
    name: str
    params: dict[str, str]  # the resolved config, flattened: {"train.optimizer.lr": "2e-05", ...}
    steps: list[dict[str, float]]  # one dict per step: {"step": 3, "loss": 1.2, "lr": ...}
    eval: dict[str, EvalMetrics]  # "base", "tuned"
    final_step: int
    images: list[Path] = field(default_factory=list)
    model_dir: Path | None = None
    tags: dict[str, str] = field(default_factory=dict)  # links back: the Prefect flow run
    promoted_as: str | None = None  # the registry version the promotion gate made of this model, if it did
    bench: dict[str, BenchTaskScores] = field(default_factory=dict)  # benchmark task -> each model's score

    def eval_scalars(self) -> dict[str, float]:
        """`eval/tuned/loss`, `eval/tuned/source/code/loss`, ... as flat scalars."""
        out = {}
        for model, m in self.eval.items():
            for key in ("loss", "perplexity", "token_accuracy", "exact_match", "overlap"):
                value = getattr(m, key)
                if value is not None:
                    out[f"eval/{model}/{key}"] = float(value)
            for kind, groups in (("source", m.by_source), ("tag", m.by_tag)):
                for name, s in groups.items():
                    out[f"eval/{model}/{kind}/{safe_key(name)}/loss"] = s.loss
                    out[f"eval/{model}/{kind}/{safe_key(name)}/token_accuracy"] = s.token_accuracy
        for task, scores in self.bench.items():
            for model, value in scores.scores.items():
                out[f"bench/{model}/{safe_key(task)}/{scores.metric}"] = value
        return out

    def eval_rows(self) -> list[dict[str, Any]]:
        rows = []
        for model, m in self.eval.items():
            rows.append(
                {
                    "model": model,
                    "source": "all",
                    "loss": m.loss,
                    "token_accuracy": m.token_accuracy,
                    "loss_tokens": m.loss_tokens,
                    "exact_match": m.exact_match,
                }
            )
            for source, s in [*m.by_source.items(), *((f"tag {t}", v) for t, v in m.by_tag.items())]:
                rows.append(
                    {
                        "model": model,
                        "source": source,
                        "loss": s.loss,
                        "token_accuracy": s.token_accuracy,
                        "loss_tokens": s.loss_tokens,
                        "exact_match": None,
                    }
                )
        return rows


def safe_key(name: str) -> str:
    """A metric-key-safe spelling of a source name (trackers allow letters, digits, `_-./ `)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


def step_rows(records: list[dict]) -> list[dict[str, float]]:
    """The numeric, finite fields of each `metrics.jsonl` record, with its step."""
    rows = []
    for r in records:
        if "step" not in r:
            continue
        row = {"step": int(r["step"])}
        for source, value in (r.get("trained_tokens_by_source") or {}).items():
            row[f"trained_tokens/{safe_key(source)}"] = float(value)
        for kind, cells in (r.get("breakdown") or {}).items():  # the training loss by source and by tag
            for name, cell in cells.items():
                for metric in ("loss", "token_accuracy"):
                    if cell.get(metric) is not None:
                        row[f"train/{kind}/{safe_key(name)}/{metric}"] = float(cell[metric])
        for key, value in r.items():
            if key in _STEP_KEYS_SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                row[key] = float(value)
        rows.append(row)
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def table_markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [
            "" if row[k] is None else (f"{row[k]:.4f}" if isinstance(row[k], float) else str(row[k])) for k in keys
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
