"""Bounds on what one chat-template render may cost: wall time, output size, and the allocations a template can ask
for in one expression.

Templates are untrusted code. The immutable sandbox keeps them away from Python's internals, but a nested loop,
`'x' * 10**10`, `lipsum(n=10**7)` or runaway macro recursion still burns CPU or memory without limit. Rendering goes
through these checks instead:

- **Time.** A watchdog thread raises `RenderLimitError` inside the rendering thread once a render runs past its
  budget (`PyThreadState_SetAsyncExc`, delivered between bytecodes, so it interrupts pure-Python loops in compiled
  templates; renders run on worker threads, where signals cannot reach).
- **Output.** The template is rendered chunk by chunk (`Template.generate`) and stops when the text exceeds the budget.
- **One operation.** Each operation that can build a large value is sized before it runs and refused over the output
  budget (`sftflow.tasks.data.template_sizes`): one C call cannot be interrupted, by the time limit or by SIGTERM.
- **Termination.** A stage that ends while rendering (SIGTERM, Ctrl-C, a failed task) stops its renders at once
  (`renders_stopped_on_error`), since its task runner waits for its threads before the process can exit.
  Ranges over 100k items are refused by Jinja's sandbox itself.
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

DEFAULT_SECONDS = 10.0
# What one rendered text may be: the tokenizer must survive it (`render.max_record_bytes`, `spans.BATCH_CHARS`).
DEFAULT_OUTPUT_CHARS = 16 * 2**20
DEFAULT_OUTPUT_FACTOR = 2


class RenderLimitError(RuntimeError):
    """A render exceeded one of its limits; the message says which."""


@dataclass(frozen=True, kw_only=True)
class RenderLimits:
    seconds: float = DEFAULT_SECONDS
    # The output may be `output_factor` times the conversation's size, or `output_chars`, whichever is larger.
    output_chars: int = DEFAULT_OUTPUT_CHARS
    output_factor: int = DEFAULT_OUTPUT_FACTOR

    def output_budget(self, input_chars: int) -> int:
        return max(self.output_chars, self.output_factor * input_chars)


_CURRENT: threading.local = threading.local()


def current_budget() -> int:
    """The output budget of the render running on this thread (for the sandbox's per-expression checks)."""
    return getattr(_CURRENT, "budget", DEFAULT_OUTPUT_CHARS)


class _Watchdog:
    """One daemon thread for all renders: it raises `RenderLimitError` in a thread whose deadline has passed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> int:
        tid = threading.get_ident()
        with self._lock:
            self._deadlines[tid] = time.monotonic() + seconds
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sftflow-render-watchdog", daemon=True)
                self._thread.start()
        return tid

    def fire_all(self) -> None:
        """Stop every render running now (within the watchdog's 50 ms tick)."""
        with self._lock:
            for tid in self._deadlines:
                self._deadlines[tid] = 0.0

    def disarm(self, tid: int) -> None:
        with self._lock:
            self._deadlines.pop(tid, None)
            if tid in self._fired:
                self._fired.discard(tid)
                # The exception may still be pending (not yet delivered): cancel it, so it cannot surface later in
                # code that has nothing to do with the render.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self._lock:
                for tid, deadline in self._deadlines.items():
                    if now > deadline and tid not in self._fired:
                        self._fired.add(tid)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(tid), ctypes.py_object(_RenderTimeout)
                        )


class _RenderTimeout(RenderLimitError):
    """Raised asynchronously (no arguments can be passed that way); `render_limited` turns it into a message."""


_WATCHDOG = _Watchdog()
# Set while the stage that renders is ending: its task runner waits for its threads before the process can exit, so a
# render (and each later one on those threads) must stop at once instead of running out its time budget.
_STOPPING = threading.Event()


@contextmanager
def renders_stopped_on_error(task_runner):
    """Enter `task_runner` (a context manager whose exit waits for its threads); if the body raises (SIGTERM's
    `TerminationSignal` in a Prefect flow, Ctrl-C, a failed task), stop this process's renders before the runner
    waits for them, and allow renders again once it has."""
    try:
        with task_runner as runner:
            try:
                yield runner
            except BaseException:
                _STOPPING.set()
                _WATCHDOG.fire_all()
                raise
    finally:
        _STOPPING.clear()


_STOPPED = "the stage is ending (SIGTERM, Ctrl-C or an error elsewhere), so its renders stop"


def render_limited(template, context: dict, limits: RenderLimits, input_chars: int) -> str:
    """`template.render(**context)` within `limits`; raises `RenderLimitError` naming the limit it hit."""
    if _STOPPING.is_set():
        raise RenderLimitError(_STOPPED)
    budget = limits.output_budget(input_chars)
    _CURRENT.budget = budget
    tid = _WATCHDOG.arm(limits.seconds)
    pieces: list[str] = []
    size = 0
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > budget:
                raise RenderLimitError(f"its output passed {budget} characters (the render's output budget)")
            pieces.append(piece)
    except _RenderTimeout:
        if _STOPPING.is_set():
            raise RenderLimitError(_STOPPED) from None
        raise RenderLimitError(f"it ran longer than {limits.seconds:g} s (the render's time budget)") from None
    except RecursionError:
        raise RenderLimitError("it recursed too deeply (a macro calling itself without end?)") from None
    except OverflowError as err:  # the sandbox's refusal of a range over 100k items, among others
        raise RenderLimitError(f"it asked for too much: {err}") from None
    except MemoryError:
        raise RenderLimitError("it ran out of memory") from None
    finally:
        _WATCHDOG.disarm(tid)
        _CURRENT.budget = DEFAULT_OUTPUT_CHARS
    return "".join(pieces)
