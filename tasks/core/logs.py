"""The logger a stage writes to: Prefect's run logger inside a flow or task run (its lines reach the run page), a
plain `logging` logger outside one (scripts, tests)."""

from __future__ import annotations

import logging


def stage_logger(fallback: str) -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(fallback)
