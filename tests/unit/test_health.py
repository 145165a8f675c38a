"""Hardware health: HealthConfig validation, the monitor's deduplication, warnings, failing
sources and lifecycle (driven by a scripted HealthSource, the documented extension point), and
NvmlSource's errors on a machine without NVML (its real-GPU smoke test is marked gpu)."""

import ctypes
import json
import logging
import sys
import threading
import types

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.config import ConfigError
from lm_resiliency.manager_api import (HardwareHealthMonitor, HealthConfig, HealthEvent, HealthReading, HealthSeverity,
                                       HealthSource, NvmlSource)

# A deadline for waits on the poll thread: it fails a hung test, it measures nothing.
DEADLINE_S = 60.0
FAST = HealthConfig(poll_interval_s=0.01)
LOGGER = "lm_resiliency.manager_api.health"


def reading(metric, severity=None, device="gpu-a", value=1, message="scripted", limit=None):
    return HealthReading(source="scripted", device=device, metric=metric, value=value, severity=severity,
                         message=message, time=1000.0, limit=limit)


class ScriptedSource(HealthSource):
    """Replays one list of readings per poll (the last one repeats); raises while `failing`."""

    def __init__(self, *polls, failing=0):
        self.polls = list(polls)
        self.failing = failing
        self.reads = 0
        self.closes = 0
        self.read_enough = threading.Event()
        self.wanted_reads = 5

    def read(self):
        self.reads += 1
        if self.reads >= self.wanted_reads:
            self.read_enough.set()
        if self.failing:
            self.failing -= 1
            raise OSError("telemetry daemon unreachable")
        return list(self.polls[0] if len(self.polls) == 1 else self.polls.pop(0))

    def close(self):
        self.closes += 1


class BlockedSource(HealthSource):
    """A read() that blocks until released: a hung telemetry daemon."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closes = 0

    def read(self):
        self.entered.set()
        self.release.wait(DEADLINE_S)
        return []

    def close(self):
        self.closes += 1


def health_threads():
    return [t for t in threading.enumerate() if t.name == "lm-resiliency-health"]


def wait_for(event):
    assert event.wait(DEADLINE_S), "the poll thread did not get there before the deadline"


# ---------------------------------------------------------------------------- deduplication


def test_a_repeated_fatal_reading_is_one_event():
    events = []
    source = ScriptedSource([reading("ecc_uncorrectable", value=2)])
    with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
        for _ in range(5):
            assert [r.metric for r in monitor.poll()] == ["ecc_uncorrectable"]
    assert source.reads == 5
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, HealthEvent)
    assert (event.device, event.metric, event.first_seen) == ("gpu-a", "ecc_uncorrectable", 1000.0)
    assert event.reading.value == 2 and event.reading.severity is HealthSeverity.FATAL
    assert monitor.events == (event,)
    assert json.loads(json.dumps(event, allow_nan=False)) == event == {
        "device": "gpu-a", "metric": "ecc_uncorrectable", "host": event.host, "first_seen": 1000.0,
        "reading": {"source": "scripted", "device": "gpu-a", "metric": "ecc_uncorrectable", "value": 2,
                    "severity": "fatal", "message": "2 uncorrectable ECC error(s) since the driver loaded; scripted",
                    "time": 1000.0, "limit": None}}


def test_the_poll_thread_delivers_one_event_over_many_polls():
    events = []
    source = ScriptedSource([reading("row_remap_failure", value=True)])
    source.wanted_reads = 20
    monitor = HardwareHealthMonitor(FAST, [source], on_event=events.append)
    monitor.start()
    wait_for(source.read_enough)
    monitor.close()
    assert source.reads >= 20
    assert [(e.device, e.metric) for e in events] == [("gpu-a", "row_remap_failure")]
    assert not health_threads()


def test_each_fatal_device_and_metric_pair_is_its_own_event():
    events = []
    source = ScriptedSource(
        [reading("ecc_uncorrectable")],
        [reading("ecc_uncorrectable"), reading("temperature", value=92, limit=95)],
        [reading("temperature", value=93, limit=95), reading("temperature", value=1, limit=3, device="gpu-b")],
    )
    with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
        for _ in range(4):
            monitor.poll()
    assert [(e.device, e.metric, e.reading.value) for e in events] == [
        ("gpu-a", "ecc_uncorrectable", 1), ("gpu-a", "temperature", 92), ("gpu-b", "temperature", 1)]


# ---------------------------------------------------------------------------- warnings


def test_warnings_are_logged_when_they_start_and_never_reach_on_event(caplog):
    events = []
    warn = reading("pcie_aer", HealthSeverity.WARNING, message="3 new correctable PCIe errors")
    source = ScriptedSource([warn], [warn], [reading("pcie_aer", HealthSeverity.OK)], [warn])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
            for _ in range(4):
                monitor.poll()
    assert events == []
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # Once when it starts, not again while it persists, once more after it cleared and came back.
    assert logged == ["hardware health warning: gpu-a pcie_aer = 1 (scripted): "
                      "3 new correctable PCIe errors"] * 2


# ---------------------------------------------------------------------------- failing sources and callbacks


def test_a_raising_source_is_logged_once_and_the_others_keep_being_polled(caplog):
    events = []
    broken = ScriptedSource([], failing=3)
    healthy = ScriptedSource([reading("nvlink_errors", value=0)], [reading("nvlink_errors", value=7)])
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [broken, healthy], on_event=events.append) as monitor:
            for _ in range(5):
                monitor.poll()
    assert (broken.reads, healthy.reads) == (5, 5)
    assert [(e.metric, e.reading.value) for e in events] == [("nvlink_errors", 7)]
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "hardware health: source ScriptedSource failed; retrying every 0.01 s (repeat failures are logged "
        "at debug level until it reads again)"]
    assert warnings[0].exc_info[1].args == ("telemetry daemon unreachable",)
    infos = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert infos == ["hardware health: source ScriptedSource reads again after 3 failed polls"]


def test_a_source_returning_something_else_than_readings_is_a_failing_source(caplog):
    class Wrong(HealthSource):
        def read(self):
            return [{"metric": "ecc"}]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [Wrong()], on_event=print) as monitor:
            assert monitor.poll() == []
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert str(record.exc_info[1]) == "Wrong.read() returned a dict, expected HealthReading objects"


def test_a_failing_on_event_is_logged_and_later_events_still_arrive(caplog):
    delivered = []

    def on_event(event):
        delivered.append(event.metric)
        if event.metric == "temperature":
            raise RuntimeError("manager unreachable")

    source = ScriptedSource([reading("temperature", value=90, limit=92)], [reading("device_lost", value=True)])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [source], on_event=on_event) as monitor:
            for _ in range(3):
                monitor.poll()
    assert delivered == ["temperature", "device_lost"]
    failed = [r for r in caplog.records if r.getMessage() == "hardware health: on_event failed for gpu-a temperature"]
    assert len(failed) == 1 and failed[0].exc_info[1].args == ("manager unreachable",)


# ---------------------------------------------------------------------------- lifecycle


def test_close_joins_the_thread_closes_sources_once_and_is_idempotent():
    source = ScriptedSource([reading("temperature", value=40, limit=92)])
    monitor = HardwareHealthMonitor(FAST, [source], on_event=print)
    monitor.start()
    assert len(health_threads()) == 1
    with pytest.raises(RuntimeError, match=r"already started"):
        monitor.start()
    wait_for(source.read_enough)
    monitor.close()
    monitor.close()
    assert not health_threads()
    assert source.closes == 1
    reads = source.reads
    with pytest.raises(RuntimeError, match=r"^HardwareHealthMonitor.poll\(\): the monitor is closed$"):
        monitor.poll()
    with pytest.raises(RuntimeError, match=r"^HardwareHealthMonitor.start\(\): the monitor is closed; create a new one$"):
        monitor.start()
    assert source.reads == reads


def test_close_inside_on_event_stops_the_monitor():
    source = ScriptedSource([reading("device_lost", value=True)])
    done = threading.Event()
    monitor = None

    def on_event(event):
        monitor.close()
        done.set()

    monitor = HardwareHealthMonitor(FAST, [source], on_event=on_event)
    monitor.start()
    wait_for(done)
    for thread in health_threads():
        thread.join(DEADLINE_S)
    assert not health_threads()
    assert source.closes == 1


def test_close_with_a_hung_source_returns_and_leaves_it_open(caplog):
    source = BlockedSource()
    monitor = HardwareHealthMonitor(HealthConfig(poll_interval_s=0.01, close_timeout_s=0.1), [source], on_event=print)
    monitor.start()
    wait_for(source.entered)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        monitor.close()
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "hardware health: a source's read() is still running after 0.1 s; the daemon poll thread is abandoned "
        "and the sources are left open"]
    assert source.closes == 0
    source.release.set()
    for thread in health_threads():
        thread.join(DEADLINE_S)
    assert not health_threads()
    monitor.close()
    assert source.closes == 0


def test_enable_resiliency_does_not_start_a_health_monitor(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(model, optimizer, interval=1,
                                checkpoint=InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="health"))
    try:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        assert not health_threads()
    finally:
        session.close()


# ---------------------------------------------------------------------------- the policy (HealthConfig)


def _classify(config, *polls):
    """(events, the classified readings of each poll) for scripted polls through one monitor."""
    events = []
    source = ScriptedSource(*polls)
    with HardwareHealthMonitor(config, [source], on_event=events.append) as monitor:
        seen = [monitor.poll() for _ in polls]
    return events, seen


def test_xid_79_is_fatal_13_is_a_logged_warning_and_unknown_codes_follow_xid_other(caplog):
    polls = [[reading("xid", value=None)], [reading("xid", value=13)], [reading("xid", value=13)],
             [reading("xid", value=200)], [reading("xid", value=79)], [reading("xid", value=79)]]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        events, seen = _classify(FAST, *polls)
    assert [[r.severity.value for r in poll] for poll in seen] == [
        ["ok"], ["warning"], ["warning"], ["warning"], ["fatal"], ["fatal"]]
    assert [(e.metric, e.reading.value) for e in events] == [("xid", 79)]
    assert events[0].reading.message == "XID 79 (GPU has fallen off the bus): fatal by HealthConfig.xid_fatal; scripted"
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    # Every XID is an event of its own: each one is logged, not only the first of a run.
    assert warnings == [
        "hardware health warning: gpu-a xid = 13 (scripted): XID 13 (graphics engine exception): a warning by "
        "HealthConfig.xid_warning; scripted"] * 2 + [
        "hardware health warning: gpu-a xid = 200 (scripted): XID 200 (not in the known XID catalog): "
        "HealthConfig.xid_other is 'warning'; scripted"]
    events, _ = _classify(HealthConfig(poll_interval_s=0.01, xid_fatal={13, 79}, xid_warning=(),
                                       xid_other="fatal"), *polls)
    assert [(e.metric, e.reading.value) for e in events] == [("xid", 13)]   # one event per (device, metric)


def test_a_standard_reading_is_classified_by_the_monitor_whatever_its_source_said():
    events, seen = _classify(FAST, [reading("xid", HealthSeverity.FATAL, value=13),
                                    reading("ecc_uncorrectable", HealthSeverity.OK, value=3),
                                    reading("pcie_aer", HealthSeverity.FATAL, value=1)])
    assert [(r.metric, r.severity) for r in seen[0]] == [
        ("xid", HealthSeverity.WARNING), ("ecc_uncorrectable", HealthSeverity.FATAL),
        ("pcie_aer", HealthSeverity.FATAL)]   # a custom metric keeps its source's severity
    assert [e.metric for e in events] == ["ecc_uncorrectable", "pcie_aer"]


def test_ecc_and_row_remap_switches():
    bad = [reading("ecc_uncorrectable", value=1), reading("ecc_correctable", value=0),
           reading("row_remap_failure", value=True), reading("row_remap_pending", value=True)]
    grown = [reading("ecc_uncorrectable", value=1), reading("ecc_correctable", value=4),
             reading("row_remap_failure", value=True), reading("row_remap_pending", value=True)]
    events, seen = _classify(FAST, bad, grown)
    assert [[r.severity.value for r in poll] for poll in seen] == [
        ["fatal", "ok", "fatal", "warning"], ["fatal", "warning", "fatal", "warning"]]
    assert [e.metric for e in events] == ["ecc_uncorrectable", "row_remap_failure"]
    quiet = HealthConfig(poll_interval_s=0.01, ecc_uncorrectable_fatal=False, ecc_correctable_warning=False,
                         row_remap_failure_fatal=False, row_remap_pending_warning=False)
    events, seen = _classify(quiet, bad, grown)
    assert events == []
    assert [[r.severity.value for r in poll] for poll in seen] == [
        ["warning", "ok", "warning", "ok"], ["warning", "ok", "warning", "ok"]]


def test_temperature_is_judged_against_the_readings_shutdown_limit():
    polls = [[reading("temperature", value=c, limit=92)] for c in (70, 77, 86, 87)]
    events, seen = _classify(HealthConfig(poll_interval_s=0.01, temperature_fatal_margin_c=5,
                                          temperature_warning_margin_c=15), *polls)
    assert [poll[0].severity.value for poll in seen] == ["ok", "warning", "warning", "fatal"]
    assert events[0].reading.message == "87 C, 5 C below the 92 C shutdown temperature; scripted"


def test_counters_are_judged_by_growth_per_device_and_a_reset_is_a_new_baseline():
    def nvlink(total, device="gpu-a"):
        return reading("nvlink_errors", value=total, device=device)

    polls = [[nvlink(5), nvlink(0, "gpu-b")], [nvlink(5), nvlink(2, "gpu-b")], [nvlink(1), nvlink(2, "gpu-b")],
             [nvlink(3), nvlink(2, "gpu-b")]]
    events, seen = _classify(HealthConfig(poll_interval_s=0.01, nvlink_error_growth_fatal=2), *polls)
    # The first reading is the baseline (5 errors before the monitor started are not growth); 5 -> 1 is
    # a driver reload; 1 -> 3 is growth 2, FATAL at the threshold; gpu-b grows by 2 at the second poll.
    assert [[r.severity.value for r in poll] for poll in seen] == [
        ["ok", "ok"], ["ok", "fatal"], ["ok", "ok"], ["fatal", "ok"]]
    assert [(e.device, e.reading.value) for e in events] == [("gpu-b", 2), ("gpu-a", 3)]


@pytest.mark.parametrize("kwargs, message", [
    ({"metric": "xid", "value": "79"},
     "HealthReading.value: an XID reading is the XID code (a positive int) or None, got '79'"),
    ({"metric": "ecc_uncorrectable", "value": -1},
     "HealthReading.value: a 'ecc_uncorrectable' reading is a non-negative int error count, got -1"),
    ({"metric": "device_lost", "value": 1}, "HealthReading.value: a 'device_lost' reading is True or False, got 1"),
    ({"metric": "temperature", "value": 80},
     "HealthReading.limit: a temperature reading needs the device's shutdown temperature (degrees C) as limit, "
     "got None"),
    ({"metric": "pcie_aer", "value": 1},
     "HealthReading.severity: 'pcie_aer' is not a standard metric (xid, ecc_uncorrectable, ecc_correctable, "
     "nvlink_errors, row_remap_failure, row_remap_pending, device_lost, temperature), so its source must classify "
     "it: pass a HealthSeverity"),
])
def test_standard_readings_are_validated_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as error:
        HealthReading(source="scripted", device="gpu-a", **kwargs)
    assert str(error.value) == message


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, message", [
    ({"poll_interval_s": 0}, "HealthConfig.poll_interval_s: must be a positive, finite number of seconds, got 0"),
    ({"poll_interval_s": float("inf")},
     "HealthConfig.poll_interval_s: must be a positive, finite number of seconds, got inf"),
    ({"close_timeout_s": "10"}, "HealthConfig.close_timeout_s: must be a positive, finite number of seconds, got '10'"),
    ({"temperature_fatal_margin_c": -1},
     "HealthConfig.temperature_fatal_margin_c: must be a finite number of degrees C >= 0, got -1"),
    ({"temperature_fatal_margin_c": 10, "temperature_warning_margin_c": 5},
     "HealthConfig.temperature_warning_margin_c: must be a finite number of degrees C >= temperature_fatal_margin_c "
     "(10): warnings start before the fatal margin, got 5"),
    ({"nvlink_error_growth_fatal": 0},
     "HealthConfig.nvlink_error_growth_fatal: must be a positive int number of errors per poll, got 0"),
    ({"nvlink_error_growth_fatal": True},
     "HealthConfig.nvlink_error_growth_fatal: must be a positive int number of errors per poll, got True"),
    ({"xid_fatal": {79, 0}}, "HealthConfig.xid_fatal: must be a set of positive int XID codes, got {0, 79}"),
    ({"xid_fatal": "79"}, "HealthConfig.xid_fatal: must be a set of positive int XID codes, got '79'"),
    ({"xid_warning": {13, 79}},
     "HealthConfig.xid_warning: must not repeat codes of xid_fatal ([79] are in both), got frozenset({13, 79})"),
    ({"xid_other": "loud"}, "HealthConfig.xid_other: must be a HealthSeverity ('ok', 'warning' or 'fatal'), "
                            "got 'loud'"),
    ({"row_remap_pending_warning": 1}, "HealthConfig.row_remap_pending_warning: must be True or False, got 1"),
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as error:
        HealthConfig(**kwargs)
    assert str(error.value) == message


def test_config_is_frozen_with_the_documented_defaults():
    config = HealthConfig()
    assert (config.poll_interval_s, config.close_timeout_s, config.temperature_fatal_margin_c,
            config.temperature_warning_margin_c, config.nvlink_error_growth_fatal) == (5.0, 10.0, 5.0, 15.0, 1)
    assert 79 in config.xid_fatal and 13 in config.xid_warning and config.xid_other is HealthSeverity.WARNING
    assert (config.ecc_uncorrectable_fatal, config.ecc_correctable_warning, config.row_remap_failure_fatal,
            config.row_remap_pending_warning) == (True, True, True, True)
    with pytest.raises(AttributeError):
        config.poll_interval_s = 1.0


def test_reading_validation_and_severity_strings():
    assert reading("pcie_aer", "warning").severity is HealthSeverity.WARNING
    with pytest.raises(ValueError) as error:
        reading("pcie_aer", "bad")
    assert str(error.value) == ("HealthReading.severity: must be a HealthSeverity ('ok', 'warning', 'fatal'), "
                                "got 'bad'")
    with pytest.raises(ValueError, match=r"^HealthReading.device: must be a non-empty string, got ''$"):
        reading("pcie_aer", "ok", device="")


def test_monitor_argument_errors():
    source = ScriptedSource([])
    with pytest.raises(TypeError, match=r"^HardwareHealthMonitor\(config=...\): expected a HealthConfig, got dict$"):
        HardwareHealthMonitor({}, [source], on_event=print)
    with pytest.raises(ConfigError, match=r"^HardwareHealthMonitor.sources: pass at least one HealthSource"):
        HardwareHealthMonitor(FAST, [], on_event=print)
    with pytest.raises(TypeError, match=r"^HardwareHealthMonitor.sources\[1\]: expected a HealthSource, got str;"):
        HardwareHealthMonitor(FAST, [source, "nvml"], on_event=print)
    with pytest.raises(ConfigError, match=r"^HardwareHealthMonitor.on_event: must be a callable taking a HealthEvent"):
        HardwareHealthMonitor(FAST, [source], on_event=None)


# ---------------------------------------------------------------------------- NvmlSource


def _nvml_library_present():
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def test_nvml_source_device_index_errors():
    with pytest.raises(ConfigError) as error:
        NvmlSource(device_index=-1)
    assert str(error.value) == ("NvmlSource.device_index: must be a non-negative int (the physical GPU index NVML "
                                "uses), got -1")


def test_nvml_source_without_pynvml_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what `import pynvml` sees when it is not installed
    with pytest.raises(ImportError) as error:
        NvmlSource(device_index=0)
    assert str(error.value) == ("NvmlSource needs the pynvml module from the nvidia-ml-py package, which is not "
                                "installed: pip install 'lm-resiliency[nvml]'")


@pytest.mark.skipif(_nvml_library_present(), reason="NVML is present: it initializes")
def test_nvml_source_without_a_driver_says_what_is_missing():
    pynvml = pytest.importorskip("pynvml")
    with pytest.raises(RuntimeError) as error:
        NvmlSource(device_index=0)
    assert str(error.value) == (
        "NvmlSource(device_index=0): NVML could not initialize (NVML Shared Library Not Found). It needs an NVIDIA "
        "GPU and its driver (libnvidia-ml.so.1); on a machine without them, supply telemetry through a custom "
        "HealthSource")
    assert isinstance(error.value.__cause__, pynvml.NVMLError)


@pytest.mark.gpu
def test_nvml_source_reads_a_real_gpu():
    pytest.importorskip("pynvml")
    events = []
    source = NvmlSource(device_index=0)
    assert source.device.startswith("GPU-")
    with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
        first, second = monitor.poll(), monitor.poll()
    metrics = {r.metric for r in second}
    assert {r.metric for r in first} == metrics
    assert metrics <= {"xid", "ecc_uncorrectable", "ecc_correctable", "row_remap_failure", "row_remap_pending",
                       "temperature", "nvlink_errors"}
    assert "temperature" in metrics
    for r in second:
        assert (r.source, r.device) == ("nvml:0", source.device)
        json.dumps(r.to_json())
    assert [e.metric for e in events] == [r.metric for r in first if r.severity is HealthSeverity.FATAL]
    with pytest.raises(RuntimeError, match=r"^nvml:0: read\(\) after close\(\)$"):
        source.read()


# ---------------------------------------------------------------------------- NvmlSource behind a fake NVML
# No GPU here: a stand-in for the pynvml module (its constants, error class and event structure are
# the real module's) simulates one GPU, so NvmlSource's own code runs unchanged.


class FakeGpu:
    def __init__(self, pynvml):
        self.nvml = pynvml
        self.temperature, self.shutdown_c = 40, 92
        self.ecc = {pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 0, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 0}
        self.pending, self.failure = 0, 0
        self.nvlink = {0: 0, 1: 0}          # active links -> errors of one counter kind
        self.xids = []
        self.xid_events = True
        self.lost = False
        self.calls = []

    def module(self):
        real, gpu = self.nvml, self
        fake = types.ModuleType("pynvml")
        for name in dir(real):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(fake, name, getattr(real, name))
        fake.NVMLError = real.NVMLError

        def fail(code):
            raise real.NVMLError(code)

        def alive():
            if gpu.lost:
                fail(real.NVML_ERROR_GPU_IS_LOST)

        def wait(event_set, timeout_ms):
            assert (event_set, timeout_ms) == ("xid-set", 0)
            if not gpu.xids:
                fail(real.NVML_ERROR_TIMEOUT)
            data = real.c_nvmlEventData_t()
            data.eventType, data.eventData = real.nvmlEventTypeXidCriticalError, gpu.xids.pop(0)
            return data

        def register(handle, event_types, event_set):
            assert event_types == real.nvmlEventTypeXidCriticalError
            if not gpu.xid_events:
                fail(real.NVML_ERROR_NOT_SUPPORTED)

        def nvlink_state(handle, link):
            if link not in gpu.nvlink:
                fail(real.NVML_ERROR_INVALID_ARGUMENT)
            return real.NVML_FEATURE_ENABLED

        def nvlink_counter(handle, link, counter):
            alive()
            return gpu.nvlink[link] if counter == real.NVML_NVLINK_ERROR_DL_CRC_FLIT else 0

        fake.nvmlInit = lambda: gpu.calls.append("init")
        fake.nvmlShutdown = lambda: gpu.calls.append("shutdown")
        fake.nvmlDeviceGetHandleByIndex = lambda index: "gpu0" if index == 0 else fail(real.NVML_ERROR_INVALID_ARGUMENT)
        fake.nvmlDeviceGetUUID = lambda handle: "GPU-fake-0"
        fake.nvmlDeviceGetTemperatureThreshold = lambda handle, kind: (
            gpu.shutdown_c if kind == real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN else fail(real.NVML_ERROR_NOT_SUPPORTED))
        fake.nvmlDeviceGetTemperature = lambda handle, sensor: alive() or gpu.temperature
        fake.nvmlDeviceGetTotalEccErrors = lambda handle, kind, counter: (
            alive() or gpu.ecc[kind] if counter == real.NVML_VOLATILE_ECC else fail(real.NVML_ERROR_INVALID_ARGUMENT))
        fake.nvmlDeviceGetRemappedRows = lambda handle: alive() or (0, 0, gpu.pending, gpu.failure)
        fake.nvmlDeviceGetNvLinkState = nvlink_state
        fake.nvmlDeviceGetNvLinkErrorCounter = nvlink_counter
        fake.nvmlEventSetCreate = lambda: "xid-set"
        fake.nvmlDeviceRegisterEvents = register
        fake.nvmlEventSetWait_v2 = wait
        fake.nvmlEventSetFree = lambda event_set: gpu.calls.append(f"free {event_set}")
        return fake


@pytest.fixture
def gpu(monkeypatch):
    simulated = FakeGpu(pytest.importorskip("pynvml"))
    monkeypatch.setitem(sys.modules, "pynvml", simulated.module())
    return simulated


def test_nvml_source_reads_xids_and_raw_metrics_the_monitor_classifies(gpu, caplog):
    events = []
    source = NvmlSource(device_index=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
            first = monitor.poll()
            assert {(r.metric, r.value, r.severity.value) for r in first} == {
                ("ecc_uncorrectable", 0, "ok"), ("ecc_correctable", 0, "ok"), ("row_remap_failure", False, "ok"),
                ("row_remap_pending", False, "ok"), ("xid", None, "ok"), ("temperature", 40, "ok"),
                ("nvlink_errors", 0, "ok")}
            assert {r.limit for r in first if r.metric == "temperature"} == {92}
            assert {(r.source, r.device) for r in first} == {("nvml:0", "GPU-fake-0")}
            gpu.xids = [13]
            assert [(r.value, r.severity.value) for r in monitor.poll() if r.metric == "xid"] == [(13, "warning")]
            assert events == []
            gpu.xids = [31, 79]
            gpu.ecc[gpu.nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED] = 6
            gpu.nvlink[1] = 4
            gpu.temperature = 88
            third = {(r.metric, r.value): r.severity.value for r in monitor.poll()}
    assert third[("xid", 31)] == "warning" and third[("xid", 79)] == "fatal"
    assert third[("ecc_correctable", 6)] == "warning" and third[("nvlink_errors", 4)] == "fatal"
    assert third[("temperature", 88)] == "fatal"
    assert [(e.device, e.metric, e.reading.value) for e in events] == [
        ("GPU-fake-0", "xid", 79), ("GPU-fake-0", "temperature", 88), ("GPU-fake-0", "nvlink_errors", 4)]
    assert json.loads(json.dumps(events, allow_nan=False)) == events
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert [m for m in logged if " xid = " in m] == ["hardware health warning: GPU-fake-0 xid = 13 (nvml:0): XID 13 (graphics engine "
                          "exception): a warning by HealthConfig.xid_warning",
                          "hardware health warning: GPU-fake-0 xid = 31 (nvml:0): XID 31 (GPU memory page fault): "
                          "a warning by HealthConfig.xid_warning"]
    assert gpu.calls == ["init", "free xid-set", "shutdown"]


def test_nvml_xid_policy_is_the_monitors_config(gpu):
    events = []
    gpu.xids = [13]
    with HardwareHealthMonitor(HealthConfig(poll_interval_s=0.01, xid_fatal={13}, xid_warning=()),
                               [NvmlSource(device_index=0)], on_event=events.append) as monitor:
        monitor.poll()
    assert [(e.metric, e.reading.value, e.reading.severity) for e in events] == [("xid", 13, HealthSeverity.FATAL)]


def test_nvml_without_xid_events_says_so_and_reads_the_rest(gpu, caplog):
    gpu.xid_events = False
    with caplog.at_level(logging.WARNING, logger="lm_resiliency.manager_api.nvml"):
        source = NvmlSource(device_index=0)
    assert [r.getMessage() for r in caplog.records] == [
        "nvml:0: this GPU does not deliver XID events (Not Supported); XIDs are not monitored"]
    assert "xid" not in {r.metric for r in source.read()}
    source.close()
    assert gpu.calls == ["init", "free xid-set", "shutdown"]


def test_nvml_device_loss_is_one_fatal_reading(gpu):
    events = []
    with HardwareHealthMonitor(FAST, [NvmlSource(device_index=0)], on_event=events.append) as monitor:
        monitor.poll()
        gpu.lost = True
        assert [(r.metric, r.value, r.severity.value) for r in monitor.poll()] == [("device_lost", True, "fatal")]
    assert [(e.metric, e.reading.message) for e in events] == [
        ("device_lost", "the device is lost or needs a reset; NVML reports the GPU unusable: GPU is lost")]
