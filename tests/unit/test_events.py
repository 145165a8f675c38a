"""The event log: what a session writes (start, fresh/recovered, capture, close with its summary),
bounded by rotation, and read back through its one reader, which refuses torn or foreign lines and
files it must not open."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency import events as ev
from lm_resiliency.events import EventLog, EventLogRejected, read_events


def test_a_session_logs_its_start_recovery_captures_and_close(tmp_path):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), shared_memory_dir=str(tmp_path / "shm"),
                                run_id="events", disk_flush_interval=2)
    for launch in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session = enable_resiliency(model, optimizer, interval=2, checkpoint=config, enable_detection=False)
        for _ in range(5):
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        directory = session.manager.store.directory
        session.close()
    found = read_events(directory)
    assert found.refused_lines == 0
    kinds = [(e["event"], e["step"]) for e in found.events]
    assert kinds == [("start", None), ("fresh", 0), ("capture", 2), ("capture", 4), ("close", 5),
                     ("start", None), ("recovered", 4), ("capture", 6), ("capture", 8), ("close", 9)]
    start, close = found.events[5], found.events[-1]
    assert (start["run_id"], start["world_size"], start["framework"], start["interval"]) == ("events", 1,
                                                                                             "pytorch/single", 2)
    assert (close["captures"], close["newest_recoverable_step"], close["first_step"], close["abnormal"]) == (
        2, 8, 4, False)


def test_the_log_rotates_into_one_previous_file_and_reads_both(tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "MAX_FILE_BYTES", 2000)
    log = EventLog(str(tmp_path), run_id="r", rank=0, world_size=1)
    for step in range(60):
        log.record("capture", step=step)
    assert sorted(os.listdir(tmp_path)) == sorted([ev.EVENT_FILE, ev.OLD_EVENT_FILE])
    assert all(os.path.getsize(tmp_path / name) <= 2000 for name in os.listdir(tmp_path))
    steps = [e["step"] for e in read_events(str(tmp_path)).events]
    assert steps == list(range(steps[0], 60)) and 0 < steps[0] < 60  # the oldest were dropped, in order


def test_torn_and_foreign_lines_are_counted_never_used(tmp_path):
    log = EventLog(str(tmp_path), run_id="r", rank=0, world_size=2)
    log.record("capture", step=2)
    with open(tmp_path / ev.EVENT_FILE, "a") as f:
        f.write(json.dumps({"v": 1, "t": 1.0, "event": "format-disk", "run_id": "r", "rank": 0, "world_size": 2}) + "\n")
        f.write(json.dumps({"v": 1, "t": 1.0, "event": "capture", "run_id": "r", "rank": -1, "world_size": 2}) + "\n")
        f.write('{"v": 1, "t": 2.0, "event": "capt')  # a process killed mid-write
    found = read_events(str(tmp_path))
    assert [(e["event"], e["step"]) for e in found.events] == [("capture", 2)] and found.refused_lines == 3
    with pytest.raises(ValueError, match="unknown event"):
        log.record("format-disk")


def test_a_linked_event_log_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("")
    os.symlink(tmp_path / "elsewhere", tmp_path / ev.EVENT_FILE)
    with pytest.raises(EventLogRejected, match="symbolic link"):
        read_events(str(tmp_path))
    log = EventLog(str(tmp_path), run_id="r", rank=0, world_size=1)
    log.record("capture", step=1)  # never written through the link, never raises
    assert (tmp_path / "elsewhere").read_text() == ""
