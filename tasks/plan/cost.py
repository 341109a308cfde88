"""What a document costs the rank that trains it, the quantity the planner balances across ranks.

Either the two-term model `a·L + b·L²` (linear layers per token, causal attention per token pair), or a table
measured on the GPU that will train (`benchmarks/cost_table.py`): the step time per token of rows made of documents
of `L` tokens, at a few lengths. A table captures what the formula cannot: attention kernels that are less efficient
on short documents, sliding windows that stop the quadratic growth, activation recomputation. A document of length
`L` then costs `L · t(L)`, with `t` interpolated linearly in `L` between the measured lengths (per-token time of the
two-term model is linear in `L`, so the table reproduces it exactly), held constant below the shortest, and
continued along the last segment above the longest (attention keeps growing with length; held where that
segment falls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CostPoints = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class DocCost:
    a: float
    b: float
    table: CostPoints = ()
    # the table as arrays, and the slope above its longest length: made once, since the tail's LPT spread calls
    # this once per document
    _lengths: np.ndarray = field(init=False, repr=False, compare=False)
    _per_token: np.ndarray = field(init=False, repr=False, compare=False)
    _slope: float = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        lengths = np.array([p[0] for p in self.table], dtype=np.float64)
        per_token = np.array([p[1] for p in self.table], dtype=np.float64)
        # never falling: a noisy last point must not make longer documents cheaper (or negative)
        slope = max(0.0, (per_token[-1] - per_token[-2]) / (lengths[-1] - lengths[-2])) if len(lengths) > 1 else 0.0
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_per_token", per_token)
        object.__setattr__(self, "_slope", slope)

    def __call__(self, length):
        """Cost of documents of `length` tokens (an int or an array of them), in the table's units or the model's."""
        L = np.asarray(length, dtype=np.float64)
        if not self.table:
            cost = self.a * L + self.b * L * L
        else:
            lengths, per_token = self._lengths, self._per_token
            t = np.interp(L, lengths, per_token)
            t = np.where(L > lengths[-1], per_token[-1] + self._slope * (L - lengths[-1]), t)
            cost = L * t
        return float(cost) if cost.ndim == 0 else cost


def check_points(points) -> CostPoints:
    """Validated `(length, time per token)` pairs: at least two, lengths strictly increasing, times positive."""
    try:
        pairs = tuple((int(length), float(t)) for length, t in points)
    except (TypeError, ValueError):
        raise ValueError("cost_table: expected [[length, time_per_token], ...]") from None
    if len(pairs) < 2:
        raise ValueError(f"cost_table: needs at least 2 measured lengths, got {len(pairs)}")
    lengths = [p[0] for p in pairs]
    if lengths[0] < 1 or any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError(f"cost_table: lengths must be positive and strictly increasing, got {lengths}")
    if any(not t > 0 or not np.isfinite(t) for _, t in pairs):
        raise ValueError("cost_table: every time per token must be a positive number")
    return pairs


def load_points(path: str | Path) -> CostPoints:
    """The points of a table file written by `benchmarks/cost_table.py` (`{"points": [[L, t], ...], ...}`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cost_table: {p}: file not found")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cost_table: {p}: not JSON ({err})") from None
    if not isinstance(data, dict) or "points" not in data:
        raise ValueError(f'cost_table: {p}: expected an object with "points": [[length, time_per_token], ...]')
    try:
        return check_points(data["points"])
    except ValueError as err:
        raise ValueError(f"{p}: {err}") from None
