"""Turn an evaluation into things people read: a loss-curve PNG, a markdown summary and a metrics table."""

from __future__ import annotations

import json
from pathlib import Path

from sftflow.tasks.core.manifests import EvalMetrics
from sftflow.tasks.eval.evaluate import EvalResult


def read_metrics(metrics_path: Path) -> list[dict]:
    if not metrics_path.is_file():
        return []
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def _figure(width: float = 7):
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, 4), dpi=100)


def _save(fig, ax, title: str, out_png: Path, **grid) -> Path:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(alpha=0.3, **grid)
    ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_loss_curve(metrics_path: Path, result: EvalResult, final_step: int, out_png: Path) -> Path:
    rows = [r for r in read_metrics(metrics_path) if r.get("loss") is not None]
    fig, ax = _figure()
    if rows:
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss (per step)", lw=1)
    points = {"base": 0, "tuned": final_step}
    for name, metrics in result.metrics.items():
        ax.scatter([points.get(name, final_step)], [metrics.loss], zorder=3, label=f"eval loss: {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("masked cross-entropy (nats/token)")
    return _save(fig, ax, "sftflow: training and held-out loss", out_png)


def metrics_table(result: EvalResult) -> list[dict]:
    rows = []
    for name, m in result.metrics.items():
        rows.append(
            {
                "model": name,
                "loss": round(m.loss, 4),
                "perplexity": round(m.perplexity, 3),
                "token_accuracy": round(m.token_accuracy, 4),
                "exact_match": None if m.exact_match is None else round(m.exact_match, 4),
                "overlap": None if m.overlap is None else round(m.overlap, 4),
                "loss_tokens": m.loss_tokens,
                "generations": m.generations,
            }
        )
    return rows


def _groups(metrics: EvalMetrics, by: str) -> dict:
    return metrics.by_source if by == "source" else metrics.by_tag


def source_table(metrics: dict[str, EvalMetrics], by: str = "source") -> list[dict]:
    """One row per (data source, model), or per (tag, model) with `by="tag"`: masked loss, token accuracy, trained
    tokens and documents."""
    return [
        {
            by: source,
            "model": name,
            "loss": round(m.loss, 4),
            "token_accuracy": round(m.token_accuracy, 4),
            "loss_tokens": m.loss_tokens,
            "docs": m.docs,
        }
        for name, model_metrics in metrics.items()
        for source, m in _groups(model_metrics, by).items()
    ]


def source_rows(metrics: dict[str, EvalMetrics], by: str = "source") -> list[str]:
    """A markdown table of loss and token accuracy per data source (or tag) and model; none for a single source (for
    tags: none when no record has one)."""
    sources = sorted({s for m in metrics.values() for s in _groups(m, by)})
    if len(sources) < (2 if by == "source" else 1):
        return []
    names = list(metrics)
    head = [by, "docs", *[f"{n} loss" for n in names], *[f"{n} token acc" for n in names]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for source in sources:
        cells = [_groups(metrics[n], by).get(source) for n in names]
        docs = next((c.docs for c in cells if c is not None), 0)
        losses = ["n/a" if c is None else f"{c.loss:.4f}" for c in cells]
        accuracies = ["n/a" if c is None else f"{c.token_accuracy:.1%}" for c in cells]
        lines.append("| " + " | ".join([source, str(docs), *losses, *accuracies]) + " |")
    return lines


def plot_source_losses(result: EvalResult, out_png: Path, by: str = "source") -> Path | None:
    """Bars of eval loss per data source (or tag, `by="tag"`), one per model; None for a single source (no tags)."""
    sources = sorted({s for m in result.metrics.values() for s in _groups(m, by)})
    if len(sources) < (2 if by == "source" else 1):
        return None
    import numpy as np

    fig, ax = _figure(width=max(5, 1.2 * len(sources) + 2))
    width = 0.8 / max(1, len(result.metrics))
    x = np.arange(len(sources))
    for k, (name, metrics) in enumerate(result.metrics.items()):
        groups = _groups(metrics, by)
        losses = [groups[s].loss if s in groups else np.nan for s in sources]
        ax.bar(x + k * width, losses, width, label=name)
    ax.set_xticks(x + width * (len(result.metrics) - 1) / 2, sources, rotation=20, ha="right")
    ax.set_ylabel("eval loss (nats/token)")
    title = "data source" if by == "source" else "tag"
    return _save(fig, ax, f"sftflow: held-out loss by {title}", out_png, axis="y")


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _code(text: str, limit: int = 400) -> str:
    text = text if len(text) <= limit else "…" + text[-limit:]
    return "```\n" + text.replace("```", "ʼʼʼ") + "\n```"


def markdown_summary(result: EvalResult, plot_path: Path | None) -> str:
    rows = metrics_table(result)
    keys = ["model", "loss", "perplexity", "token_accuracy", "exact_match", "overlap", "loss_tokens", "generations"]
    lines = ["# sftflow evaluation", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    by_source = source_rows(result.metrics)
    if by_source:
        lines += ["", "## By data source", "", *by_source]
    by_tag = source_rows(result.metrics, by="tag")
    if by_tag:
        lines += ["", "## By tag", "", *by_tag]
    if plot_path is not None:
        lines += ["", f"Loss curve: `{plot_path}`"]
    for i, example in enumerate(result.examples):
        lines += ["", f"## Example {i + 1}", "", "Prompt:", _code(example.prompt), f"Reference: `{example.reference}`"]
        lines += [f"- {name}: `{answer}`" for name, answer in example.outputs.items()]
    return "\n".join(lines)
