"""`NvmlSource`: NVIDIA GPU telemetry through NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call of the library is here. The source reports raw measurements of the standard
metrics (`health_reading.STANDARD_METRICS`); `HardwareHealthMonitor` classifies them from its
`HealthConfig`, exactly as it classifies any other source's.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from lm_resiliency._values import is_int
from lm_resiliency.config import ConfigError
from lm_resiliency.manager_api.health import HealthSource
from lm_resiliency.manager_api.health_reading import (DEVICE_LOST, ECC_CORRECTABLE, ECC_UNCORRECTABLE, NVLINK_ERRORS,
                                                      ROW_REMAP_FAILURE, ROW_REMAP_PENDING, TEMPERATURE, XID,
                                                      HealthReading)

logger = logging.getLogger(__name__)

NVML_INSTALL_HINT = "pip install 'lm-resiliency[nvml]'"
# XID events drained per poll: a storm of them must not keep one poll from ending.
MAX_XIDS_PER_POLL = 256


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

    Each poll reads: the XIDs the driver reported since the last poll (critical-error events; an
    ``xid`` reading of None when there were none), the volatile uncorrectable and correctable ECC
    counts, row-remap failure and pending flags, the temperature with the GPU's shutdown
    temperature as `limit`, the NVLink error counters summed over the active links, and device
    loss (NVML reports the GPU lost or needing a reset). A metric the GPU does not support is
    left out. Readings name the device by its NVML UUID. Whether a reading is OK, a WARNING or
    FATAL is the monitor's `HealthConfig`'s to say.
    """

    def __init__(self, device_index: int) -> None:
        if not is_int(device_index) or device_index < 0:
            raise ConfigError(f"NvmlSource.device_index: must be a non-negative int (the physical GPU index "
                              f"NVML uses), got {device_index!r}")
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
        self._events = self._xid_events()
        self._probes: Dict[str, Callable[[float], List[HealthReading]]] = {
            "ecc_uncorrectable": self._ecc_uncorrectable,
            "ecc_correctable": self._ecc_correctable,
            "row_remap": self._row_remap,
        }
        if self._events is not None:
            self._probes["xid"] = self._xids
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
                return [self._reading(DEVICE_LOST, True, now, f"NVML reports the GPU unusable: {error}")]
            raise
        return readings

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nvml = self._nvml
        if self._events is not None:
            try:
                nvml.nvmlEventSetFree(self._events)
            except nvml.NVMLError:
                logger.debug("%s: nvmlEventSetFree failed", self.name, exc_info=True)
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            logger.debug("%s: nvmlShutdown failed", self.name, exc_info=True)

    def _reading(self, metric: str, value: Any, now: float, message: str = "",
                 limit: Optional[float] = None) -> HealthReading:
        return HealthReading(source=self.name, device=self._device, metric=metric, value=value, message=message,
                             time=now, limit=limit)

    def _supported(self, call: Callable[[], Any]) -> Any:
        """call()'s result, or None when this GPU does not support it."""
        try:
            return call()
        except self._nvml.NVMLError as error:
            if error.value in (self._nvml.NVML_ERROR_NOT_SUPPORTED, self._nvml.NVML_ERROR_INVALID_ARGUMENT):
                return None
            raise

    def _xid_events(self) -> Any:
        """An NVML event set registered for this GPU's XID critical-error events, or None when
        the GPU or driver cannot deliver them (logged: XIDs are then not monitored)."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as error:
            logger.warning("%s: NVML cannot create an event set (%s); XIDs are not monitored", self.name, error)
            return None
        try:
            nvml.nvmlDeviceRegisterEvents(self._handle, nvml.nvmlEventTypeXidCriticalError, events)
        except nvml.NVMLError as error:
            nvml.nvmlEventSetFree(events)
            logger.warning("%s: this GPU does not deliver XID events (%s); XIDs are not monitored", self.name, error)
            return None
        return events

    def _nvlink_counters_present(self) -> List[Tuple[int, int]]:
        """(link, counter) pairs to poll: every error counter an active link supports."""
        nvml = self._nvml
        counters = (nvml.NVML_NVLINK_ERROR_DL_REPLAY, nvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                    nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, nvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
                    nvml.NVML_NVLINK_ERROR_DL_ECC_DATA)
        present: List[Tuple[int, int]] = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            state = self._supported(functools.partial(nvml.nvmlDeviceGetNvLinkState, self._handle, link))
            if state != nvml.NVML_FEATURE_ENABLED:
                continue
            present.extend((link, counter) for counter in counters if self._supported(
                functools.partial(nvml.nvmlDeviceGetNvLinkErrorCounter, self._handle, link, counter)) is not None)
        return present

    def _xids(self, now: float) -> List[HealthReading]:
        nvml = self._nvml
        readings = []
        for _ in range(MAX_XIDS_PER_POLL):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as error:
                if error.value == nvml.NVML_ERROR_TIMEOUT:
                    break   # no event is waiting
                raise
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                readings.append(self._reading(XID, int(data.eventData), now))
        else:
            logger.warning("%s: more than %d XID events in one poll; the rest are read at the next poll", self.name,
                           MAX_XIDS_PER_POLL)
        return readings or [self._reading(XID, None, now, "no XID since the last poll")]

    def _ecc_count(self, error_type: int) -> int:
        return int(self._nvml.nvmlDeviceGetTotalEccErrors(self._handle, error_type, self._nvml.NVML_VOLATILE_ECC))

    def _ecc_uncorrectable(self, now: float) -> List[HealthReading]:
        return [self._reading(ECC_UNCORRECTABLE, self._ecc_count(self._nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED), now)]

    def _ecc_correctable(self, now: float) -> List[HealthReading]:
        return [self._reading(ECC_CORRECTABLE, self._ecc_count(self._nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED), now)]

    def _row_remap(self, now: float) -> List[HealthReading]:
        _, _, pending, failure = self._nvml.nvmlDeviceGetRemappedRows(self._handle)
        return [self._reading(ROW_REMAP_FAILURE, bool(failure), now),
                self._reading(ROW_REMAP_PENDING, bool(pending), now)]

    def _temperature(self, now: float) -> List[HealthReading]:
        celsius = self._nvml.nvmlDeviceGetTemperature(self._handle, self._nvml.NVML_TEMPERATURE_GPU)
        return [self._reading(TEMPERATURE, celsius, now, limit=self._shutdown_c)]

    def _nvlink(self, now: float) -> List[HealthReading]:
        per_link: Dict[int, int] = {}
        for link, counter in self._nvlink_counters:
            count = int(self._nvml.nvmlDeviceGetNvLinkErrorCounter(self._handle, link, counter))
            per_link[link] = per_link.get(link, 0) + count
        detail = ", ".join(f"link {link}: {count}" for link, count in sorted(per_link.items()) if count)
        return [self._reading(NVLINK_ERRORS, sum(per_link.values()), now,
                              f"errors so far by link: {detail}" if detail else "")]
