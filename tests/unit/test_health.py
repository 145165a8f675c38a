"""Hardware health: HealthConfig validation, the monitor's deduplication, warnings, failing
sources and lifecycle (driven by a scripted HealthSource, the documented extension point), and
NvmlSource's errors on a machine without NVML (its real-GPU smoke test is marked gpu)."""

import ctypes
import json
import logging
import sys
import threading

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


def reading(metric, severity, device="gpu-a", value=1, message="scripted"):
    return HealthReading(source="scripted", device=device, metric=metric, value=value, severity=severity,
                         message=message, time=1000.0)


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
    source = ScriptedSource([reading("ecc_uncorrectable", HealthSeverity.FATAL, value=2)])
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
    assert json.loads(json.dumps(event.to_json())) == {
        "device": "gpu-a", "metric": "ecc_uncorrectable", "host": event.host, "first_seen": 1000.0,
        "reading": {"source": "scripted", "device": "gpu-a", "metric": "ecc_uncorrectable", "value": 2,
                    "severity": "fatal", "message": "scripted", "time": 1000.0}}


def test_the_poll_thread_delivers_one_event_over_many_polls():
    events = []
    source = ScriptedSource([reading("row_remap_failure", HealthSeverity.FATAL)])
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
        [reading("ecc_uncorrectable", "fatal")],
        [reading("ecc_uncorrectable", "fatal"), reading("temperature", "fatal", value=92)],
        [reading("temperature", "fatal", value=93), reading("temperature", "fatal", device="gpu-b")],
    )
    with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
        for _ in range(4):
            monitor.poll()
    assert [(e.device, e.metric, e.reading.value) for e in events] == [
        ("gpu-a", "ecc_uncorrectable", 1), ("gpu-a", "temperature", 92), ("gpu-b", "temperature", 1)]


# ---------------------------------------------------------------------------- warnings


def test_warnings_are_logged_when_they_start_and_never_reach_on_event(caplog):
    events = []
    warn = reading("ecc_correctable", HealthSeverity.WARNING, message="3 new correctable ECC errors")
    source = ScriptedSource([warn], [warn], [reading("ecc_correctable", HealthSeverity.OK)], [warn])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [source], on_event=events.append) as monitor:
            for _ in range(4):
                monitor.poll()
    assert events == []
    logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # Once when it starts, not again while it persists, once more after it cleared and came back.
    assert logged == ["hardware health warning: gpu-a ecc_correctable = 1 (scripted): "
                      "3 new correctable ECC errors"] * 2


# ---------------------------------------------------------------------------- failing sources and callbacks


def test_a_raising_source_is_logged_once_and_the_others_keep_being_polled(caplog):
    events = []
    broken = ScriptedSource([], failing=3)
    healthy = ScriptedSource([reading("nvlink_error_growth", "ok", value=0)],
                             [reading("nvlink_error_growth", "fatal", value=7)])
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [broken, healthy], on_event=events.append) as monitor:
            for _ in range(5):
                monitor.poll()
    assert (broken.reads, healthy.reads) == (5, 5)
    assert [(e.metric, e.reading.value) for e in events] == [("nvlink_error_growth", 7)]
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

    source = ScriptedSource([reading("temperature", "fatal")], [reading("device_lost", "fatal")])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        with HardwareHealthMonitor(FAST, [source], on_event=on_event) as monitor:
            for _ in range(3):
                monitor.poll()
    assert delivered == ["temperature", "device_lost"]
    failed = [r for r in caplog.records if r.getMessage() == "hardware health: on_event failed for gpu-a temperature"]
    assert len(failed) == 1 and failed[0].exc_info[1].args == ("manager unreachable",)


# ---------------------------------------------------------------------------- lifecycle


def test_close_joins_the_thread_closes_sources_once_and_is_idempotent():
    source = ScriptedSource([reading("temperature", "ok", value=40)])
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
    source = ScriptedSource([reading("device_lost", "fatal")])
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
])
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as error:
        HealthConfig(**kwargs)
    assert str(error.value) == message


def test_config_is_frozen_with_the_documented_defaults():
    config = HealthConfig()
    assert (config.poll_interval_s, config.close_timeout_s, config.temperature_fatal_margin_c,
            config.temperature_warning_margin_c, config.nvlink_error_growth_fatal) == (5.0, 10.0, 5.0, 15.0, 1)
    with pytest.raises(AttributeError):
        config.poll_interval_s = 1.0


def test_reading_validation_and_severity_strings():
    assert reading("temperature", "warning").severity is HealthSeverity.WARNING
    with pytest.raises(ValueError) as error:
        reading("temperature", "bad")
    assert str(error.value) == ("HealthReading.severity: must be a HealthSeverity ('ok', 'warning', 'fatal'), "
                                "got 'bad'")
    with pytest.raises(ValueError, match=r"^HealthReading.device: must be a non-empty string, got ''$"):
        reading("temperature", "ok", device="")


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
    assert metrics <= {"ecc_uncorrectable", "ecc_correctable", "row_remap_failure", "row_remap_pending",
                       "temperature", "nvlink_error_growth"}
    assert "temperature" in metrics
    for r in second:
        assert (r.source, r.device) == ("nvml:0", source.device)
        json.dumps(r.to_json())
    assert [e.metric for e in events] == [r.metric for r in first if r.severity is HealthSeverity.FATAL]
    with pytest.raises(RuntimeError, match=r"^nvml:0: read\(\) after close\(\)$"):
        source.read()
