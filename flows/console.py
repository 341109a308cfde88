"""What a command shows on the terminal: the run's progress and, for a user error, one line; tracebacks go to a log.

Prefect logs a failed task's or flow's exception with its traceback, ~100 lines above the command's own one-line
`error: file:line: ...`, and each failed task and flow run repeats the message in its `Finished in state Failed(...)`
line. While a command runs flows, every log record also goes to `<work_dir>/sftflow.log`, full tracebacks included,
and the terminal's Prefect handler drops the records that carry a user error (`USER_ERRORS`) or repeat one in a
final state, and the traceback of any other error: a user error reaches the terminal once, as the command's
`error:` line. The Prefect API (and its UI) still receives everything. `--debug` keeps the terminal as Prefect
prints it. The log file stops at its first failed write (a full disk): one line on the terminal
says so, where logging's default would print a `--- Logging error ---` block for every record that follows.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_NAME = "sftflow.log"
# Bad input, bad config: the command ends on one located line for these (exit 2).
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)
# Prefect's final-state line: `Finished in state Failed("Task run encountered an exception RecordError: ...")` for a
# task, `...("Flow run encountered an exception: RecordError: ...")` for a flow.
_FAILED_WITH = re.compile(r"Finished in state Failed\(.*? encountered an exception:? (\w+): ", re.DOTALL)

_state = {"debug": False, "log_file": None}


def set_debug(debug: bool) -> None:
    _state["debug"] = debug


def log_file() -> Path | None:
    """The log of the command's flow runs, once one is being written."""
    return _state["log_file"]


def _is_user_error_name(name: str) -> bool:
    """Whether `name` is the class name of a user error: the final-state line names the class, not the object."""
    pending = list(USER_ERRORS)
    while pending:
        cls = pending.pop()
        if cls.__name__ == name:
            return True
        pending += cls.__subclasses__()
    return False


class _TerminalFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            error = record.exc_info[1]
            if isinstance(error, USER_ERRORS):
                return False  # the command ends with this error's one located line
            record.exc_info, record.exc_text = None, None
        elif isinstance(record.msg, str) and record.msg.startswith("Finished in state Failed("):
            failed = _FAILED_WITH.match(record.getMessage())
            if failed is not None and _is_user_error_name(failed.group(1)):
                return False  # the same line again, in the run's final state
        return True


class LogFile(logging.FileHandler):
    """A log file that turns itself off at its first failed write, and says so once on stderr."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8")
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        self.failed = True
        _state["log_file"] = None  # no longer where the details are
        error = sys.exc_info()[1]
        try:
            self.close()
        except OSError:  # flushing the buffered rest fails the same way
            pass
        sys.stderr.write(f"sftflow: stopped writing {self.baseFilename}: {error}\n")


@contextmanager
def logged_to(work_dir: str | Path) -> Iterator[Path]:
    """Write every log record to `work_dir/sftflow.log` and keep tracebacks off the terminal (unless `--debug`)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    path = Path(work_dir) / LOG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = LogFile(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    # First among the root's handlers: it sees each record before the terminal's filter trims it.
    root.handlers.insert(0, handler)
    terminal = _TerminalFilter()
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)] if not _state["debug"] else []
    for console in consoles:
        console.addFilter(terminal)
    _state["log_file"] = path
    try:
        yield path
    finally:
        for console in consoles:
            console.removeFilter(terminal)
        root.removeHandler(handler)
        handler.close()
