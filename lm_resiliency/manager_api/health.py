"""Hardware health: direct device telemetry for permanent or imminent device failures.

A `HardwareHealthMonitor` polls `HealthSource`s on a daemon thread. Every source returns
`HealthReading`s, each already classified OK, WARNING or FATAL by the source. The monitor hands
the manager one `HealthEvent` per fatal (device, metric) pair, once, and only logs warnings.
`NvmlSource` is the built-in source for NVIDIA GPUs; every NVML call lives in it. Custom
sources (XID, PCIe, InfiniBand, NIC, HCA, fabric) subclass `HealthSource`.

Nothing here starts on its own: `enable_resiliency()` never creates a monitor.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from lm_resiliency._values import is_int
from lm_resiliency.config import ConfigError

logger = logging.getLogger(__name__)

NVML_INSTALL_HINT = "pip install 'lm-resiliency[nvml]'"


class HealthSeverity(str, enum.Enum):
    OK = "ok"
    WARNING = "warning"
    FATAL = "fatal"


@dataclass(frozen=True)
class HealthReading:
    """One metric sample. `source` names the HealthSource, `device` the physical device it
    describes (for NvmlSource, the GPU UUID), `value` the raw sample (a count, degrees C, a flag)
    and `time` the wall-clock time of the sample (seconds since the epoch)."""

    source: str
    device: str
    metric: str
    value: Union[int, float, bool, str, None]
    severity: HealthSeverity
    message: str = ""
    time: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        for name in ("source", "device", "metric"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"HealthReading.{name}: must be a non-empty string, got {value!r}")
        try:
            object.__setattr__(self, "severity", HealthSeverity(self.severity))
        except ValueError:
            names = ", ".join(repr(s.value) for s in HealthSeverity)
            raise ValueError(f"HealthReading.severity: must be a HealthSeverity ({names}), "
                             f"got {self.severity!r}") from None

    def to_json(self) -> dict:
        return {"source": self.source, "device": self.device, "metric": self.metric, "value": self.value,
                "severity": self.severity.value, "message": self.message, "time": self.time}


@dataclass(frozen=True)
class HealthEvent:
    """A fatal finding, delivered once per (device, metric) pair: `reading` is the first fatal
    sample, `host` the machine the monitor runs on, `first_seen` that sample's time."""

    device: str
    metric: str
    reading: HealthReading
    host: str
    first_seen: float

    def to_json(self) -> dict:
        return {"device": self.device, "metric": self.metric, "host": self.host, "first_seen": self.first_seen,
                "reading": self.reading.to_json()}


HealthEventCallback = Callable[[HealthEvent], None]


class HealthSource(abc.ABC):
    """The extension point: a telemetry source the monitor polls.

    `read()` returns this poll's readings, each classified by the source. It may raise: the
    monitor logs the failure and calls it again at the next poll. `close()` releases what the
    source holds; the monitor calls it once, from `HardwareHealthMonitor.close()`.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def read(self) -> List[HealthReading]:
        """This poll's readings."""

    def close(self) -> None:
        """Release the source's resources (default: nothing to release)."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class HealthConfig:
    """Monitor cadence and the NVML thresholds.

    poll_interval_s: seconds between polls of every source.
    close_timeout_s: how long `close()` waits for a poll in progress to finish.
    temperature_fatal_margin_c: FATAL at or above (shutdown threshold - this margin).
    temperature_warning_margin_c: WARNING at or above (shutdown threshold - this margin).
    nvlink_error_growth_fatal: FATAL when one poll adds at least this many NVLink replay,
        recovery, CRC or ECC errors across the GPU's links; smaller growth is a WARNING.
    """

    poll_interval_s: float = 5.0
    close_timeout_s: float = 10.0
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


class HardwareHealthMonitor:
    """Polls `sources` every `config.poll_interval_s` on a daemon thread once `start()` runs.

    `on_event` receives one `HealthEvent` per fatal (device, metric) pair over the monitor's life,
    on the monitor thread; an exception it raises is logged. WARNING readings are logged when a
    (device, metric) pair starts warning, never passed to `on_event`. A source that raises is
    logged (once, as a warning, until it reads again) and polled again next time; the other
    sources keep being polled. `close()` stops the thread and closes the sources.
    """

    def __init__(self, config: HealthConfig, sources: Sequence[HealthSource], *,
                 on_event: HealthEventCallback) -> None:
        if not isinstance(config, HealthConfig):
            raise TypeError(f"HardwareHealthMonitor(config=...): expected a HealthConfig, got {type(config).__name__}")
        self._sources = tuple(sources)
        if not self._sources:
            raise ConfigError("HardwareHealthMonitor.sources: pass at least one HealthSource (e.g. NvmlSource)")
        for index, source in enumerate(self._sources):
            if not isinstance(source, HealthSource):
                raise TypeError(f"HardwareHealthMonitor.sources[{index}]: expected a HealthSource, "
                                f"got {type(source).__name__}; subclass HealthSource for custom telemetry")
        if not callable(on_event):
            raise ConfigError(f"HardwareHealthMonitor.on_event: must be a callable taking a HealthEvent, "
                              f"got {type(on_event).__name__} {on_event!r}")
        self._config = config
        self._on_event = on_event
        self._host = socket.gethostname()
        self._events: List[HealthEvent] = []
        self._reported: Set[Tuple[str, str]] = set()
        self._warning: Set[Tuple[str, str]] = set()
        self._failures: Dict[int, int] = {}
        self._poll_lock = threading.RLock()  # close() may run inside on_event, mid-poll
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    @property
    def events(self) -> Tuple[HealthEvent, ...]:
        """Every event delivered so far, oldest first."""
        return tuple(self._events)

    def start(self) -> None:
        """Start the polling thread (the first poll runs at once)."""
        if self._closed:
            raise RuntimeError("HardwareHealthMonitor.start(): the monitor is closed; create a new one")
        if self._thread is not None:
            raise RuntimeError("HardwareHealthMonitor.start(): already started")
        self._thread = threading.Thread(target=self._run, name="lm-resiliency-health", daemon=True)
        self._thread.start()

    def poll(self) -> List[HealthReading]:
        """Read every source once, deliver new fatal events, and return the readings. The thread
        calls this; a manager with its own loop may call it instead of `start()`."""
        with self._poll_lock:
            if self._closed:
                raise RuntimeError("HardwareHealthMonitor.poll(): the monitor is closed")
            readings = [reading for source in self._sources for reading in self._read(source)]
            for reading in readings:
                self._handle(reading)
            return readings

    def close(self) -> None:
        """Stop polling, wait up to `close_timeout_s` for a poll in progress, close the sources.
        Idempotent."""
        if self._closed:
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._config.close_timeout_s)
            if thread.is_alive():
                self._closed = True
                logger.warning("hardware health: a source's read() is still running after %g s; the daemon "
                               "poll thread is abandoned and the sources are left open",
                               self._config.close_timeout_s)
                return
        with self._poll_lock:
            self._closed = True
            for source in self._sources:
                try:
                    source.close()
                except Exception:  # one source must not keep the others open
                    logger.exception("hardware health: closing source %s failed", source.name)

    def __enter__(self) -> "HardwareHealthMonitor":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except RuntimeError:
                if self._closed:
                    return
                raise
            self._stop.wait(self._config.poll_interval_s)

    def _read(self, source: HealthSource) -> List[HealthReading]:
        key = id(source)
        try:
            readings = list(source.read())
            for reading in readings:
                if not isinstance(reading, HealthReading):
                    raise TypeError(f"{source.name}.read() returned a {type(reading).__name__}, "
                                    f"expected HealthReading objects")
        except Exception:  # a failing source must not stop the monitor
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            if failures == 1:
                logger.warning("hardware health: source %s failed; retrying every %g s (repeat failures are "
                               "logged at debug level until it reads again)", source.name,
                               self._config.poll_interval_s, exc_info=True)
            else:
                logger.debug("hardware health: source %s failed again (%d in a row)", source.name, failures,
                             exc_info=True)
            return []
        failures = self._failures.pop(key, 0)
        if failures:
            logger.info("hardware health: source %s reads again after %d failed polls", source.name, failures)
        return readings

    def _handle(self, reading: HealthReading) -> None:
        key = (reading.device, reading.metric)
        if reading.severity is HealthSeverity.OK:
            self._warning.discard(key)
        elif reading.severity is HealthSeverity.WARNING:
            if key not in self._warning:
                self._warning.add(key)
                logger.warning("hardware health warning: %s %s = %r (%s): %s", reading.device, reading.metric,
                               reading.value, reading.source, reading.message)
        elif key not in self._reported:
            self._reported.add(key)
            event = HealthEvent(device=reading.device, metric=reading.metric, reading=reading, host=self._host,
                                first_seen=reading.time)
            self._events.append(event)
            logger.error("hardware health FATAL: %s %s = %r (%s) on %s: %s", reading.device, reading.metric,
                         reading.value, reading.source, self._host, reading.message)
            try:
                self._on_event(event)
            except Exception:  # the manager's callback must not stop the monitor
                logger.exception("hardware health: on_event failed for %s %s", reading.device, reading.metric)


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as error:
        raise ImportError(f"NvmlSource needs the pynvml module from the nvidia-ml-py package, which is not "
                          f"installed: {NVML_INSTALL_HINT}") from error
    return pynvml


class NvmlSource(HealthSource):
    """NVIDIA GPU telemetry through NVML, for the GPU NVML numbers `device_index` (the physical
    index `nvidia-smi -L` lists, not one relative to CUDA_VISIBLE_DEVICES).

    FATAL: uncorrectable ECC errors (volatile count > 0), a row-remap failure, NVLink error
    growth of at least `nvlink_error_growth_fatal` per poll, temperature within
    `temperature_fatal_margin_c` of the shutdown threshold, and device loss (NVML reports the GPU
    lost or needing a reset). WARNING: correctable ECC growth, pending row remaps, smaller NVLink
    error growth, temperature within `temperature_warning_margin_c` of shutdown. A metric the GPU
    does not support is left out. Readings name the device by its NVML UUID.
    """

    def __init__(self, device_index: int, *, config: Optional[HealthConfig] = None) -> None:
        if not isinstance(device_index, int) or isinstance(device_index, bool) or device_index < 0:
            raise ConfigError(f"NvmlSource.device_index: must be a non-negative int (the physical GPU index "
                              f"NVML uses), got {device_index!r}")
        if config is not None and not isinstance(config, HealthConfig):
            raise TypeError(f"NvmlSource(config=...): expected a HealthConfig, got {type(config).__name__}")
        self._config = config if config is not None else HealthConfig()
        self._index = device_index
        self._nvml = _import_pynvml()
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            raise RuntimeError(f"NvmlSource(device_index={device_index}): NVML could not initialize ({error}). "
                               f"It needs an NVIDIA GPU and its driver (libnvidia-ml.so.1); on a machine without "
                               f"them, supply telemetry through a custom HealthSource") from error
        try:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)
            self._device = nvml.nvmlDeviceGetUUID(self._handle)
        except nvml.NVMLError as error:
            nvml.nvmlShutdown()
            raise RuntimeError(f"NvmlSource(device_index={device_index}): NVML cannot open this GPU ({error}); pass "
                               f"the physical index `nvidia-smi -L` lists") from error
        self._closed = False
        self._lost_codes = (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED)
        self._shutdown_c = self._supported(
            lambda: nvml.nvmlDeviceGetTemperatureThreshold(self._handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN))
        self._nvlink_counters = self._nvlink_counters_present()
        self._previous: Dict[str, int] = {}
        self._probes: Dict[str, Callable[[float], List[HealthReading]]] = {
            "ecc_uncorrectable": self._ecc_uncorrectable,
            "ecc_correctable": self._ecc_correctable,
            "row_remap": self._row_remap,
        }
        if self._shutdown_c is not None:
            self._probes["temperature"] = self._temperature
        if self._nvlink_counters:
            self._probes["nvlink"] = self._nvlink

    @property
    def name(self) -> str:
        return f"nvml:{self._index}"

    @property
    def device(self) -> str:
        """The GPU's NVML UUID, the `device` of every reading."""
        return self._device

    def read(self) -> List[HealthReading]:
        if self._closed:
            raise RuntimeError(f"{self.name}: read() after close()")
        nvml = self._nvml
        now = time.time()
        readings: List[HealthReading] = []
        try:
            for probe_name, probe in list(self._probes.items()):
                try:
                    readings.extend(probe(now))
                except nvml.NVMLError as error:
                    if error.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                        raise
                    logger.debug("%s: %s is not supported by this GPU; no longer polled", self.name, probe_name)
                    del self._probes[probe_name]
        except nvml.NVMLError as error:
            if error.value in self._lost_codes:
                return [self._reading("device_lost", error.value, HealthSeverity.FATAL, now,
                                      f"NVML reports the GPU unusable: {error}")]
            raise
        return readings

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            logger.debug("%s: nvmlShutdown failed", self.name, exc_info=True)

    def _reading(self, metric: str, value: Any, severity: HealthSeverity, now: float, message: str) -> HealthReading:
        return HealthReading(source=self.name, device=self._device, metric=metric, value=value, severity=severity,
                             message=message, time=now)

    def _supported(self, call: Callable[[], Any]) -> Any:
        """call()'s result, or None when this GPU does not support it."""
        try:
            return call()
        except self._nvml.NVMLError as error:
            if error.value in (self._nvml.NVML_ERROR_NOT_SUPPORTED, self._nvml.NVML_ERROR_INVALID_ARGUMENT):
                return None
            raise

    def _nvlink_counters_present(self) -> List[Tuple[int, int]]:
        """(link, counter) pairs to poll: every error counter an active link supports."""
        nvml = self._nvml
        counters = (nvml.NVML_NVLINK_ERROR_DL_REPLAY, nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                    nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                    nvml.NVML_NVLINK_ERROR_DL_ECC_DATA)
        present = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            if self._supported(lambda: nvml.nvmlDeviceGetNvLinkState(self._handle, link)) != nvml.NVML_FEATURE_ENABLED:
                continue
            present.extend((link, counter) for counter in counters
                           if self._supported(lambda: nvml.nvmlDeviceGetNvLinkErrorCounter(
                               self._handle, link, counter)) is not None)
        return present

    def _ecc_count(self, error_type: int) -> int:
        return self._nvml.nvmlDeviceGetTotalEccErrors(self._handle, error_type, self._nvml.NVML_VOLATILE_ECC)

    def _growth(self, key: str, total: int) -> Optional[int]:
        """total - the previous poll's total; None at the first poll (the baseline)."""
        previous = self._previous.get(key)
        self._previous[key] = total
        return None if previous is None else total - previous

    def _ecc_uncorrectable(self, now: float) -> List[HealthReading]:
        count = self._ecc_count(self._nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        if count > 0:
            return [self._reading("ecc_uncorrectable", count, HealthSeverity.FATAL, now,
                                  f"{count} uncorrectable ECC error(s) since the driver loaded")]
        return [self._reading("ecc_uncorrectable", count, HealthSeverity.OK, now, "")]

    def _ecc_correctable(self, now: float) -> List[HealthReading]:
        count = self._ecc_count(self._nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)
        growth = self._growth("ecc_correctable", count)
        if growth:
            return [self._reading("ecc_correctable", count, HealthSeverity.WARNING, now,
                                  f"{growth} new correctable ECC error(s) since the last poll")]
        return [self._reading("ecc_correctable", count, HealthSeverity.OK, now, "")]

    def _row_remap(self, now: float) -> List[HealthReading]:
        _, _, pending, failure = self._nvml.nvmlDeviceGetRemappedRows(self._handle)
        return [
            self._reading("row_remap_failure", bool(failure), HealthSeverity.FATAL if failure else HealthSeverity.OK,
                          now, "a row remap failed: the GPU's memory cannot be repaired" if failure else ""),
            self._reading("row_remap_pending", bool(pending),
                          HealthSeverity.WARNING if pending else HealthSeverity.OK, now,
                          "row remaps are pending: reset the GPU to apply them" if pending else ""),
        ]

    def _temperature(self, now: float) -> List[HealthReading]:
        celsius = self._nvml.nvmlDeviceGetTemperature(self._handle, self._nvml.NVML_TEMPERATURE_GPU)
        headroom = self._shutdown_c - celsius
        message = f"{celsius} C, {headroom} C below the {self._shutdown_c} C shutdown threshold"
        if headroom <= self._config.temperature_fatal_margin_c:
            severity = HealthSeverity.FATAL
        elif headroom <= self._config.temperature_warning_margin_c:
            severity = HealthSeverity.WARNING
        else:
            severity, message = HealthSeverity.OK, ""
        return [self._reading("temperature", celsius, severity, now, message)]

    def _nvlink(self, now: float) -> List[HealthReading]:
        grown: Dict[int, int] = {}
        for link, counter in self._nvlink_counters:
            count = self._nvml.nvmlDeviceGetNvLinkErrorCounter(self._handle, link, counter)
            growth = self._growth(f"nvlink:{link}:{counter}", count)
            if growth:
                grown[link] = grown.get(link, 0) + growth
        total = sum(grown.values())
        if total >= self._config.nvlink_error_growth_fatal:
            severity = HealthSeverity.FATAL
        else:
            severity = HealthSeverity.WARNING if total > 0 else HealthSeverity.OK
        message = ", ".join(f"link {link}: +{count}" for link, count in sorted(grown.items()))
        return [self._reading("nvlink_error_growth", total, severity, now,
                              f"NVLink errors since the last poll: {message}" if message else "")]
