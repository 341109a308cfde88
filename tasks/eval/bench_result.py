"""One benchmark task's result for every model scored: what the built-in loop and lm-eval both return."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TaskResult:
    name: str
    kind: str
    metric: str
    scores: dict[str, float]  # model name -> score in [0, 1]
    items: int
    prompt_example: str = ""  # the first scored item's prompt, few-shot examples and template included
    samples: list[dict] = field(default_factory=list)  # per item: line, reference, each model's answer and verdict
    # Where items carry a `subset`: per subset, its item count and each model's score (items without one: "other").
    subsets: dict[str, dict] = field(default_factory=dict)  # subset -> {"items": n, "scores": {model: score}}
