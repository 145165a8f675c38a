"""Value checks shared by every validator (configuration, on-disk records, wire documents)."""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import TypeGuard

from lm_resiliency.errors import ResiliencyError

# The longest wait every consumer of a time value accepts: threading waits (TIMEOUT_MAX) and
# datetime.timedelta (process-group and collective timeouts). Longer values overflow later.
MAX_SECONDS = float(min(threading.TIMEOUT_MAX, timedelta.max.total_seconds()))
# The largest cadence in optimizer steps (capture, flush, check) any config accepts: far beyond
# any run, and a step plus one interval stays well inside the int64 step arithmetic of agreement.
MAX_STEP_INTERVAL = 1_000_000_000


class ConfigError(ResiliencyError, ValueError):
    """A configuration value is invalid. The message names the field and the accepted values."""


def is_int(value: object) -> TypeGuard[int]:
    """A true int: `bool` is an int subclass in Python, but True is never a step, rank or size."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_step_interval(value: object, minimum: int = 1) -> bool:
    """An int number of optimizer steps in [minimum, MAX_STEP_INTERVAL]."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_STEP_INTERVAL


def is_seconds(value: object, *, allow_zero: bool = False) -> bool:
    """A real number of seconds that every wait accepts: finite, > 0 (>= 0 with `allow_zero`)
    and at most MAX_SECONDS."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value >= 0 if allow_zero else value > 0) and value <= MAX_SECONDS)
