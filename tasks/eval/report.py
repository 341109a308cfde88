"""Turn an evaluation into things people read: a loss-curve PNG, a markdown summary and a metrics table."""

from __future__ import annotations

import json
from pathlib import Path

from sftflow.tasks.eval.evaluate import EvalResult


def read_metrics(metrics_path: Path) -> list[dict]:
    if not metrics_path.is_file():
        return []
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, result: EvalResult, final_step: int, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if rows:
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss (per step)", lw=1)
    points = {"base": 0, "tuned": final_step}
    for name, metrics in result.metrics.items():
        ax.scatter([points.get(name, final_step)], [metrics.loss], zorder=3, label=f"eval loss: {name}")
    ax.set_xlabel("step")
    ax.set_ylabel("masked cross-entropy (nats/token)")
    ax.set_title("sftflow: training and held-out loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


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
    if plot_path is not None:
        lines += ["", f"Loss curve: `{plot_path}`"]
    for i, example in enumerate(result.examples):
        lines += ["", f"## Example {i + 1}", "", "Prompt:", _code(example.prompt), f"Reference: `{example.reference}`"]
        lines += [f"- {name}: `{answer}`" for name, answer in example.outputs.items()]
    return "\n".join(lines)
