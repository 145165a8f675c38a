"""The hardware-health policy: `HealthConfig` (cadence, XID policy, ECC and row-remap switches,
temperature and NVLink thresholds) and `HealthPolicy`, the monitor's classifier of the standard
metrics, so every `HealthSource` gets the same policy.

Counters (`ecc_correctable`, `nvlink_errors`) are judged by their growth between two readings of
the same device; the first reading is the baseline, and a counter that went down (the driver
reloaded) is a new baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Tuple

from lm_resiliency._values import is_int
from lm_resiliency.config import ConfigError
from lm_resiliency.manager_api.health_reading import (DEVICE_LOST, ECC_CORRECTABLE, ECC_UNCORRECTABLE, NVLINK_ERRORS,
                                                      ROW_REMAP_FAILURE, ROW_REMAP_PENDING, STANDARD_METRICS, XID,
                                                      HealthReading, HealthSeverity)

# NVIDIA's XID catalog: the ones that mean the GPU (or its memory or links) needs a reset or
# replacement, and the ones usually caused by the application or recoverable by the driver.
XID_NAMES = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "row remapping event", 64: "row remapping failure",
    74: "NVLink error", 79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
    94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
    140: "unrecovered ECC error",
}
DEFAULT_FATAL_XIDS = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 140})
DEFAULT_WARNING_XIDS = frozenset({13, 31, 43, 45, 63, 92, 94})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class HealthConfig:
    """Monitor cadence and the policy it classifies every source's standard readings with.

    poll_interval_s: seconds between polls of every source.
    close_timeout_s: how long `close()` waits for a poll in progress to finish.
    xid_fatal: XID codes that are FATAL (default: ECC double-bit/uncontained/unrecovered, row-remap
        failure, NVLink error, fallen off the bus, micro-controller halt, GSP errors).
    xid_warning: XID codes that are only a WARNING (default: application-caused faults such as 13
        and 31, and recoverable memory events).
    xid_other: the severity of an XID in neither set (default WARNING).
    ecc_uncorrectable_fatal: uncorrectable ECC errors are FATAL (False: a WARNING).
    ecc_correctable_warning: growth of correctable ECC errors is a WARNING (False: OK).
    row_remap_failure_fatal: a failed row remap is FATAL (False: a WARNING).
    row_remap_pending_warning: pending row remaps are a WARNING (False: OK).
    temperature_fatal_margin_c: FATAL at or above (shutdown temperature - this margin).
    temperature_warning_margin_c: WARNING at or above (shutdown temperature - this margin).
    nvlink_error_growth_fatal: FATAL when NVLink errors grow by at least this many between two
        polls; smaller growth is a WARNING.
    """

    poll_interval_s: float = 5.0
    close_timeout_s: float = 10.0
    xid_fatal: FrozenSet[int] = DEFAULT_FATAL_XIDS
    xid_warning: FrozenSet[int] = DEFAULT_WARNING_XIDS
    xid_other: HealthSeverity = HealthSeverity.WARNING
    ecc_uncorrectable_fatal: bool = True
    ecc_correctable_warning: bool = True
    row_remap_failure_fatal: bool = True
    row_remap_pending_warning: bool = True
    temperature_fatal_margin_c: float = 5.0
    temperature_warning_margin_c: float = 15.0
    nvlink_error_growth_fatal: int = 1

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"HealthConfig.{name}: {message}, got {getattr(self, name)!r}")

        for name in ("poll_interval_s", "close_timeout_s"):
            value = getattr(self, name)
            require(_number(value) and value > 0, name, "must be a positive, finite number of seconds")
        for name in ("xid_fatal", "xid_warning"):
            codes = getattr(self, name)
            require(isinstance(codes, (set, frozenset, list, tuple)) and all(is_int(c) and c > 0 for c in codes),
                    name, "must be a set of positive int XID codes")
            object.__setattr__(self, name, frozenset(codes))
        both = sorted(self.xid_fatal & self.xid_warning)
        require(not both, "xid_warning", f"must not repeat codes of xid_fatal ({both} are in both)")
        try:
            object.__setattr__(self, "xid_other", HealthSeverity(self.xid_other))
        except ValueError:
            require(False, "xid_other", "must be a HealthSeverity ('ok', 'warning' or 'fatal')")
        for name in ("ecc_uncorrectable_fatal", "ecc_correctable_warning", "row_remap_failure_fatal",
                     "row_remap_pending_warning"):
            require(isinstance(getattr(self, name), bool), name, "must be True or False")
        require(_number(self.temperature_fatal_margin_c) and self.temperature_fatal_margin_c >= 0,
                "temperature_fatal_margin_c", "must be a finite number of degrees C >= 0")
        require(_number(self.temperature_warning_margin_c)
                and self.temperature_warning_margin_c >= self.temperature_fatal_margin_c,
                "temperature_warning_margin_c",
                f"must be a finite number of degrees C >= temperature_fatal_margin_c "
                f"({self.temperature_fatal_margin_c!r}): warnings start before the fatal margin")
        require(is_int(self.nvlink_error_growth_fatal)
                and self.nvlink_error_growth_fatal >= 1,
                "nvlink_error_growth_fatal", "must be a positive int number of errors per poll")


OK, WARNING, FATAL = HealthSeverity.OK, HealthSeverity.WARNING, HealthSeverity.FATAL


class HealthPolicy:
    """Classifies readings for one monitor: a standard metric from `config` (counters by growth
    since that device's previous reading), any other metric as its source did."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._counts: Dict[Tuple[str, str], int] = {}

    def classify(self, reading: HealthReading) -> HealthReading:
        if reading.metric not in STANDARD_METRICS:
            return reading
        severity, message = self._judge(reading)
        return reading.classified(severity, message)

    def _judge(self, reading: HealthReading) -> Tuple[HealthSeverity, str]:
        config, metric, value = self.config, reading.metric, reading.value
        if metric == XID:
            return self._xid(value)
        if metric == ECC_UNCORRECTABLE:
            if not value:
                return OK, ""
            return (FATAL if config.ecc_uncorrectable_fatal else WARNING,
                    f"{value} uncorrectable ECC error(s) since the driver loaded")
        if metric == ECC_CORRECTABLE:
            growth = self._growth(reading)
            if growth and config.ecc_correctable_warning:
                return WARNING, f"{growth} new correctable ECC error(s) since the last poll"
            return OK, ""
        if metric == NVLINK_ERRORS:
            growth = self._growth(reading)
            if not growth:
                return OK, ""
            return (FATAL if growth >= config.nvlink_error_growth_fatal else WARNING,
                    f"{growth} new NVLink error(s) since the last poll")
        if metric == ROW_REMAP_FAILURE:
            if not value:
                return OK, ""
            return (FATAL if config.row_remap_failure_fatal else WARNING,
                    "a row remap failed: the GPU's memory cannot be repaired")
        if metric == ROW_REMAP_PENDING:
            if value and config.row_remap_pending_warning:
                return WARNING, "row remaps are pending: reset the GPU to apply them"
            return OK, ""
        if metric == DEVICE_LOST:
            return (FATAL, "the device is lost or needs a reset") if value else (OK, "")
        return self._temperature(value, reading.limit)

    def _xid(self, code: Any) -> Tuple[HealthSeverity, str]:
        if code is None:
            return OK, ""
        config = self.config
        name = XID_NAMES.get(code, "not in the known XID catalog")
        if code in config.xid_fatal:
            return FATAL, f"XID {code} ({name}): fatal by HealthConfig.xid_fatal"
        if code in config.xid_warning:
            return WARNING, f"XID {code} ({name}): a warning by HealthConfig.xid_warning"
        return config.xid_other, f"XID {code} ({name}): HealthConfig.xid_other is {config.xid_other.value!r}"

    def _temperature(self, celsius: Any, shutdown: Any) -> Tuple[HealthSeverity, str]:
        headroom = shutdown - celsius
        message = f"{celsius} C, {headroom:g} C below the {shutdown} C shutdown temperature"
        if headroom <= self.config.temperature_fatal_margin_c:
            return FATAL, message
        if headroom <= self.config.temperature_warning_margin_c:
            return WARNING, message
        return OK, ""

    def _growth(self, reading: HealthReading) -> int:
        """How much a counter grew since this device's previous reading (0 at the first, and when
        it went down: the driver reloaded and the volatile counters restarted)."""
        key, count = (reading.device, reading.metric), int(reading.value or 0)  # validated: an int >= 0
        previous = self._counts.get(key)
        self._counts[key] = count
        if previous is None or count < previous:
            return 0
        return count - previous
