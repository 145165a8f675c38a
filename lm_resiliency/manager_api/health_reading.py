"""What hardware-health telemetry says: `HealthReading` (one sample), `HealthEvent` (a fatal
finding delivered to the manager), `HealthSeverity`, and the standard metrics the monitor
classifies itself from `HealthConfig` (`lm_resiliency.manager_api.health_policy`).

Readings and events are JSON-ready payloads (`lm_resiliency.payload`): ``json.dumps(event)``
works, and the fields read as attributes too.
"""

from __future__ import annotations

import enum
import math
import time as _time
from typing import Any, Optional, Union

from lm_resiliency._values import is_int
from lm_resiliency.payload import Payload, nested


class HealthSeverity(str, enum.Enum):
    OK = "ok"
    WARNING = "warning"
    FATAL = "fatal"


# The standard metrics. A reading of one of these carries the raw measurement; the monitor classifies
# it from HealthConfig, so every source gets the same policy.
XID = "xid"                              # an XID the driver reported: its code (None: none since the last poll)
ECC_UNCORRECTABLE = "ecc_uncorrectable"  # volatile uncorrectable ECC error count (int >= 0)
ECC_CORRECTABLE = "ecc_correctable"      # volatile correctable ECC error count (int >= 0), judged by growth
ROW_REMAP_FAILURE = "row_remap_failure"  # a row remap failed (bool)
ROW_REMAP_PENDING = "row_remap_pending"  # row remaps wait for a GPU reset (bool)
TEMPERATURE = "temperature"              # degrees C; `limit` is the device's shutdown temperature
NVLINK_ERRORS = "nvlink_errors"          # NVLink replay/recovery/CRC/ECC errors over all links (int >= 0), by growth
DEVICE_LOST = "device_lost"              # the device is gone or needs a reset (bool)
COUNTERS = (ECC_UNCORRECTABLE, ECC_CORRECTABLE, NVLINK_ERRORS)
FLAGS = (ROW_REMAP_FAILURE, ROW_REMAP_PENDING, DEVICE_LOST)
STANDARD_METRICS = (XID, *COUNTERS, *FLAGS, TEMPERATURE)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _value_problem(metric: str, value: Any, limit: Any) -> str:
    """Why `value` (and `limit`) cannot be a reading of standard `metric`, or ""."""
    if metric == XID and not (value is None or (is_int(value) and value > 0)):
        return f"value: an XID reading is the XID code (a positive int) or None, got {value!r}"
    if metric in COUNTERS and not (is_int(value) and value >= 0):
        return f"value: a {metric!r} reading is a non-negative int error count, got {value!r}"
    if metric in FLAGS and not isinstance(value, bool):
        return f"value: a {metric!r} reading is True or False, got {value!r}"
    if metric == TEMPERATURE and not _number(value):
        return f"value: a temperature reading is a finite number of degrees C, got {value!r}"
    if metric == TEMPERATURE and not _number(limit):
        return (f"limit: a temperature reading needs the device's shutdown temperature (degrees C) as limit, "
                f"got {limit!r}")
    return ""


class HealthReading(Payload):
    """One metric sample.

    source: the HealthSource that read it. device: the physical device it describes (for
    NvmlSource, the GPU UUID). metric: what was measured. value: the raw sample (a count, degrees
    C, a flag, an XID code). severity: OK, WARNING or FATAL. A standard metric (`STANDARD_METRICS`)
    is classified by the monitor from HealthConfig, which replaces any severity set here: leave it
    None. Any other metric needs the source's severity.
    message: what the sample means, in words. time: wall-clock time of the sample (seconds since
    the epoch; now when omitted). limit: the device's own limit for the metric (temperature: its
    shutdown temperature), None when there is none.
    """

    __slots__ = ()
    _FIELDS = ("source", "device", "metric", "value", "severity", "message", "time", "limit")
    _ATTRS = {"severity": HealthSeverity}

    source: str
    device: str
    metric: str
    value: Union[int, float, bool, str, None]
    severity: Optional[HealthSeverity]
    message: str
    time: float
    limit: Optional[float]

    def __init__(self, source: str, device: str, metric: str, value: Union[int, float, bool, str, None],
                 severity: "Union[HealthSeverity, str, None]" = None, message: str = "",
                 time: Optional[float] = None, limit: Optional[float] = None) -> None:
        for name, text in (("source", source), ("device", device), ("metric", metric)):
            if not isinstance(text, str) or not text:
                raise ValueError(f"HealthReading.{name}: must be a non-empty string, got {text!r}")
        if metric in STANDARD_METRICS:
            problem = _value_problem(metric, value, limit)
            if problem:
                raise ValueError(f"HealthReading.{problem}")
        elif severity is None:
            raise ValueError(f"HealthReading.severity: {metric!r} is not a standard metric "
                             f"({', '.join(STANDARD_METRICS)}), so its source must classify it: pass a "
                             f"HealthSeverity")
        if severity is not None:
            try:
                severity = HealthSeverity(severity)
            except ValueError:
                names = ", ".join(repr(s.value) for s in HealthSeverity)
                raise ValueError(f"HealthReading.severity: must be a HealthSeverity ({names}), "
                                 f"got {severity!r}") from None
        if not isinstance(message, str):
            raise ValueError(f"HealthReading.message: must be a string, got {message!r}")
        if limit is not None and not _number(limit):
            raise ValueError(f"HealthReading.limit: must be None or a finite number, got {limit!r}")
        self._init(source=source, device=device, metric=metric, value=value, severity=severity, message=message,
                   time=_time.time() if time is None else float(time), limit=limit)

    def classified(self, severity: HealthSeverity, message: str) -> "HealthReading":
        """This reading as the monitor classified it: `severity`, and `message` in front of the
        source's own."""
        text = f"{message}; {self.message}" if message and self.message else message or self.message
        return HealthReading(source=self.source, device=self.device, metric=self.metric, value=self.value,
                             severity=severity, message=text, time=self.time, limit=self.limit)


class HealthEvent(Payload):
    """A fatal finding, delivered once per (device, metric) pair: `reading` is the first fatal
    sample (classified), `host` the machine the monitor runs on, `first_seen` that sample's time."""

    __slots__ = ()
    _FIELDS = ("device", "metric", "reading", "host", "first_seen")
    _ATTRS = {"reading": nested(HealthReading)}

    device: str
    metric: str
    reading: HealthReading
    host: str
    first_seen: float

    def __init__(self, device: str, metric: str, reading: HealthReading, host: str, first_seen: float) -> None:
        if not isinstance(reading, HealthReading):
            raise TypeError(f"HealthEvent.reading: expected a HealthReading, got {type(reading).__name__}")
        self._init(device=device, metric=metric, reading=dict(reading), host=host, first_seen=float(first_seen))
