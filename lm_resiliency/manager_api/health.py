"""Hardware health: direct device telemetry for permanent or imminent device failures.

A `HardwareHealthMonitor` polls `HealthSource`s on a daemon thread. Sources return raw
`HealthReading`s; the monitor classifies the standard metrics (XIDs, ECC, row remaps,
temperature, NVLink errors, device loss) itself from `HealthConfig` (`health_policy`), so every
source gets the same policy, and takes a custom metric's severity from its source. It hands the
manager one `HealthEvent` per fatal (device, metric) pair, once, and only logs warnings.
`NvmlSource` (`manager_api/nvml.py`) is the built-in source for NVIDIA GPUs. Custom sources (XID
daemons, PCIe, InfiniBand, NIC, HCA, fabric) subclass `HealthSource`.

Nothing here starts on its own: `enable_resiliency()` never creates a monitor.
"""

from __future__ import annotations

import abc
import logging
import socket
import threading
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from lm_resiliency.config import ConfigError
from lm_resiliency.manager_api.health_policy import HealthConfig, HealthPolicy
from lm_resiliency.manager_api.health_reading import XID, HealthEvent, HealthReading, HealthSeverity

logger = logging.getLogger(__name__)


HealthEventCallback = Callable[[HealthEvent], None]


class HealthSource(abc.ABC):
    """The extension point: a telemetry source the monitor polls.

    `read()` returns this poll's readings: raw measurements of the standard metrics (the monitor
    classifies them from `HealthConfig`), and any other metric classified by the source. It may
    raise: the monitor logs the failure and calls it again at the next poll. `close()` releases
    what the source holds; the monitor calls it once, from `HardwareHealthMonitor.close()`.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def read(self) -> List[HealthReading]:
        """This poll's readings."""

    def close(self) -> None:
        """Release the source's resources (default: nothing to release)."""


class HardwareHealthMonitor:
    """Polls `sources` every `config.poll_interval_s` on a daemon thread once `start()` runs.

    Every reading is classified by one `HealthPolicy` built from `config` (the standard metrics)
    or keeps its source's severity (any other metric). `on_event` receives one `HealthEvent` per
    fatal (device, metric) pair over the monitor's life, on the monitor thread; an exception it
    raises is logged. WARNING readings are logged when a (device, metric) pair starts warning,
    never passed to `on_event`. A source that raises is logged (once, as a warning, until it reads
    again) and polled again next time; the other sources keep being polled. `close()` stops the
    thread and closes the sources.
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
        self._policy = HealthPolicy(config)
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
        """Read every source once, classify the readings, deliver new fatal events, and return the
        classified readings. The thread calls this; a manager with its own loop may call it
        instead of `start()`."""
        with self._poll_lock:
            if self._closed:
                raise RuntimeError("HardwareHealthMonitor.poll(): the monitor is closed")
            readings = [self._policy.classify(reading) for source in self._sources for reading in self._read(source)]
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
            # A state (a temperature, pending remaps) is logged when it starts; every XID is an event.
            if key not in self._warning or reading.metric == XID:
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
