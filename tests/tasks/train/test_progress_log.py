"""The training progress line and the rate at which a Prefect run logs it, on an injected clock."""

from __future__ import annotations

from sftflow.tasks.train.progress_log import PROGRESS_LINE, ThrottledProgress, progress_line


def _record(step: int, **changes) -> dict:
    record = {"step": step, "loss": 1.23456, "lr": 2e-5, "ema_tokens_per_s": 1234.5, "mfu": None, "eta_s": 83.0}
    return {"skipped": None, **record, **changes}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(steps_at: list[tuple[int, float]], total: int, every_s: float = 30.0, other: dict[int, str] | None = None):
    """Feed one progress line per (step, time) and `other[step]` lines before a step's; return what was emitted."""
    emitted: list[str] = []
    clock = FakeClock()
    throttle = ThrottledProgress(emitted.append, every_s=every_s, clock=clock)
    for step, at in steps_at:
        clock.now = at
        if other and step in other:
            throttle(other[step])
        throttle(progress_line(_record(step), total))
    return throttle, emitted


def _steps(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for m in map(PROGRESS_LINE.match, lines) if m]


def test_the_line_is_short_and_parses_back():
    line = progress_line(_record(120), 400)
    assert line == "[train] step 120/400 loss 1.2346 lr 2e-05 tok/s 1234 eta 0:01:23"
    assert PROGRESS_LINE.match(line).groups() == ("120", "400")
    # A GPU run's line, a skipped step's: still under 80 characters, still a progress line
    gpu = progress_line(_record(12345, mfu=0.456, eta_s=45296.0), 99999)
    skipped = progress_line(_record(7, loss=None, skipped="no trained tokens"), 400)
    assert gpu.endswith("mfu 45.6% eta 12:34:56") and len(gpu) < 80
    assert "loss skipped" in skipped and skipped.endswith("(no trained tokens)") and PROGRESS_LINE.match(skipped)


def test_first_last_and_one_each_every_s_between():
    """216 steps of 1 s each: the first, one each 30 s, the last; not 216 lines."""
    throttle, emitted = _run([(step, step - 1.0) for step in range(1, 217)], total=216)
    assert _steps(emitted) == [1, 31, 61, 91, 121, 151, 181, 211, 216]
    throttle.flush()
    assert _steps(emitted)[-1] == 216  # nothing held back after the last step


def test_other_lines_all_pass_in_order():
    other = {2: "[train] fresh start; 6.4M params", 5: "Traceback (most recent call last):"}
    _, emitted = _run([(step, float(step)) for step in range(1, 7)], total=100, other=other)
    assert emitted == [progress_line(_record(1), 100), other[2], other[5]]


def test_a_run_that_stops_early_logs_where_it_stopped():
    """Cancelled or crashed at step 40 of 400: the line held back last is logged when training ends."""
    throttle, emitted = _run([(step, step * 0.5) for step in range(1, 41)], total=400)
    assert _steps(emitted) == [1]
    throttle.flush()
    assert _steps(emitted) == [1, 40]
    throttle.flush()
    assert _steps(emitted) == [1, 40]  # once


def test_a_slow_run_logs_every_step():
    _, emitted = _run([(step, step * 45.0) for step in range(1, 6)], total=5)
    assert _steps(emitted) == [1, 2, 3, 4, 5]
