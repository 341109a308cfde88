"""The clock chat templates read through `strftime_now`, and `fixed_clock` to hold it at one instant."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime

# The instant `strftime_now` formats: the wall clock, as in Hugging Face, unless `fixed_clock` holds one. Templates
# that write the day (Llama 3.2, SmolLM3) render differently from one day to the next, so `template: auto` compares
# its probes at one instant, and tests name the day they expect.
_CLOCK: ContextVar[datetime | None] = ContextVar("sftflow_template_clock", default=None)


def strftime_now(fmt: str) -> str:
    return (_CLOCK.get() or datetime.now()).strftime(fmt)


@contextmanager
def fixed_clock(instant: datetime | None = None):
    """Renders inside read `instant` through `strftime_now` instead of the wall clock; without one, the instant the
    clock shows on entry (an enclosing `fixed_clock`'s, else now)."""
    token = _CLOCK.set(instant or _CLOCK.get() or datetime.now())
    try:
        yield
    finally:
        _CLOCK.reset(token)
