"""The training progress line, and how often a Prefect run logs it.

Rank 0 prints one short line per logged step (`progress_line`)::

    [train] step 120/400 loss 1.2345 lr 0.0001 tok/s 1234 eta 0:01:23

A Prefect run stores every line it logs and `prefect deployment run --watch` prints them all, so a run of thousands of
steps would log thousands of lines. Inside a Prefect run the launcher passes the worker's output through
`ThrottledProgress`: every line that is not a step's progress, and of the progress lines the first, the last step's,
and one each `every_s` seconds between. The last line held back is logged when training ends, however it ends, so the
log always shows how far it got. `metrics.jsonl` and the `train-progress` artifact keep every step.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

# `progress_line` as a pattern: group 1 is the step, group 2 the total.
PROGRESS_LINE = re.compile(r"^\[train\] step (\d+)/(\d+) ")
EVERY_S = 30.0


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress_line(r: dict, total_steps: int) -> str:
    """One step's line from its `metrics.jsonl` record: short enough for a terminal after Prefect's prefix."""
    loss = "skipped" if r["loss"] is None else f"{r['loss']:.4f}"
    extra = f" ({r['skipped']})" if r["skipped"] else ""
    mfu = f" mfu {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
    return (
        f"[train] step {r['step']}/{total_steps} loss {loss} lr {r['lr']:.3g} tok/s {r['ema_tokens_per_s']:.0f}"
        f"{mfu} eta {_clock(r['eta_s'])}{extra}"
    )


class ThrottledProgress:
    """`on_line` for the worker's output: passes each line to `emit`, the progress lines at a bounded rate.

    `clock` returns seconds (monotonic); tests pass their own.
    """

    def __init__(
        self, emit: Callable[[str], object], every_s: float = EVERY_S, clock: Callable[[], float] | None = None
    ):
        self.emit, self.every_s = emit, every_s
        self.clock = clock or time.monotonic
        self.last_emitted_at: float | None = None
        self.held: str | None = None  # the latest progress line not emitted

    def __call__(self, line: str) -> None:
        found = PROGRESS_LINE.match(line)
        if found is None:
            self.emit(line)
            return
        step, total = int(found.group(1)), int(found.group(2))
        now = self.clock()
        first = self.last_emitted_at is None
        if first or step >= total or now - self.last_emitted_at >= self.every_s:
            self.last_emitted_at, self.held = now, None
            self.emit(line)
        else:
            self.held = line

    def flush(self) -> None:
        """Emit the progress line held back last, if any: where training stopped."""
        if self.held is not None:
            line, self.held = self.held, None
            self.emit(line)
