"""LM_RESILIENCY_LOG_LEVEL: how much the `lm_resiliency` loggers say, without touching the
application's own logging.

Unset, nothing changes: Python's default shows WARNING and above (the one-line "resumed run ...
at step N" and "started fresh: ..." notes are WARNING for that reason). Set to INFO, the library
also says what it does: each capture cadence, each flush, the summary at close. When the
application configured no logging handler, a stderr handler for the `lm_resiliency` loggers
shows those lines (with the rank); once the application configures its own root handler, that
one prints them instead and this one stays quiet, so no line is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys

from lm_resiliency.config import LOG_LEVEL_ENV, ConfigError, env_log_level

_ROOT_LOGGER = "lm_resiliency"


class _UntilConfigured(logging.StreamHandler):
    """stderr, for as long as the root logger has no handler of the application's."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def apply_environment_log_level() -> None:
    """Set the `lm_resiliency` loggers' level from LM_RESILIENCY_LOG_LEVEL (idempotent). A value
    that is not a level is reported once and ignored: logging never stops a training run."""
    logger = logging.getLogger(_ROOT_LOGGER)
    try:
        level = env_log_level()
    except ConfigError as exc:
        logger.warning("lm-resiliency: %s; %s is ignored", exc, LOG_LEVEL_ENV)
        return
    if level is None:
        return
    logger.setLevel(level)
    if not any(isinstance(handler, _UntilConfigured) for handler in logger.handlers):
        handler = _UntilConfigured(sys.stderr)
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
