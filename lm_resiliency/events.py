"""The run's event log: what lm-resiliency did, one JSON line per event, next to its state.

Each rank's session appends to ``events.jsonl`` in its node-local GEMINI directory
(``<disk_folder>/<run namespace>/rank-<rank>/``), so the log lives and dies with the state it
describes (a cleanup removes both). `lm-resiliency timeline` draws a run from it. Events:

    start      a session started (every launch and every torchrun restart): run id, world size,
               topology fingerprint, replication distance, framework, capture and flush cadence
    recovered  state was loaded: step, source ("gemini", "fallback", "durable"), where from
    fresh      nothing was loaded, and why
    capture    a GEMINI capture of a step started
    vetoed     SCOUT or a non-finite check vetoed the capture of a step
    report     a fault SCOUT found (SDC, straggler, hang...): kind, ranks, step
    close      the session closed: captures, SCOUT checks and verdicts, time in the library

Every line carries the schema version, wall time, run id, rank and world size, so any line
identifies its run. Bounded: a file that would grow past `MAX_FILE_BYTES` becomes
``events.1.jsonl`` (replacing the one before) and a new file starts, so a rank keeps at most two
files. Writing never fails training: a write error is logged once and the log goes quiet.
`read_events` is the one reader: owner, regular-file and size checks, and a schema per line; a
torn last line (a process killed mid-write) or a line that does not match is counted, never used.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from lm_resiliency.files import (CLOEXEC, NOFOLLOW, PRIVATE, RecordRejected, RecordSchema, integer, number,
                                 nullable, parse_record, read_file_bytes, text)

logger = logging.getLogger(__name__)

EVENT_FILE = "events.jsonl"
OLD_EVENT_FILE = "events.1.jsonl"
SCHEMA_VERSION = 1
MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024
KINDS = ("start", "recovered", "fresh", "capture", "vetoed", "report", "close")
# One line: the common keys are declared; each event adds its own (open keys), `step` when it has one.
EVENT_SCHEMA = RecordSchema(what="event log line", identity=("v", SCHEMA_VERSION), open_keys=True,
                            max_bytes=MAX_LINE_BYTES, fields={
                                "t": number(0.0), "event": text(choices=KINDS), "run_id": text(nonempty=False),
                                "rank": integer(0), "world_size": integer(1),
                                "step": nullable(integer(0, required=False))})


class EventLogRejected(RecordRejected):
    """An event log file exists but must not be read (a link, another user's, not a regular file)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EventsRead:
    """What `read_events` found in one rank directory: the valid events, oldest first, and how
    many lines were refused (torn by a crash, or not an event of this schema)."""

    events: Tuple[Dict[str, Any], ...]
    refused_lines: int
    files: Tuple[str, ...]


class EventLog:
    """One rank's append-only event log in `directory` (see the module documentation)."""

    def __init__(self, directory: str, *, run_id: str, rank: int, world_size: int) -> None:
        self.path = os.path.join(directory, EVENT_FILE)
        self._old_path = os.path.join(directory, OLD_EVENT_FILE)
        self._common = {"run_id": run_id, "rank": rank, "world_size": world_size}
        self._lock = threading.Lock()
        self._broken = False

    def record(self, event: str, **fields: Any) -> None:
        """Append one event (thread-safe; never raises)."""
        if event not in KINDS:
            raise ValueError(f"EventLog.record: unknown event {event!r}; expected one of {KINDS}")
        doc = {"v": SCHEMA_VERSION, "t": round(time.time(), 3), "event": event, **self._common, **fields}
        try:
            line = (json.dumps(doc, allow_nan=False, separators=(",", ":"), default=str) + "\n").encode("utf-8")
        except ValueError as exc:
            logger.warning("lm-resiliency: event %r not logged: %s", event, exc)
            return
        if len(line) > MAX_LINE_BYTES:
            logger.warning("lm-resiliency: event %r not logged: %d bytes, more than %d", event, len(line),
                           MAX_LINE_BYTES)
            return
        with self._lock:
            if self._broken:
                return
            try:
                self._append(line)
            except OSError as exc:
                self._broken = True
                logger.warning("lm-resiliency: the event log %s cannot be written (%s); no further events are "
                               "logged for this session (checkpoints are not affected)", self.path, exc)

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size + len(line) > MAX_FILE_BYTES:
                os.close(fd)
                fd = -1
                os.replace(self.path, self._old_path)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o600)
            os.write(fd, line)
        finally:
            if fd >= 0:
                os.close(fd)


def read_events(directory: str) -> EventsRead:
    """Every valid event of one rank directory (``events.1.jsonl`` then ``events.jsonl``), oldest
    first. Raises EventLogRejected for a file that must not be opened; a missing file is empty."""
    events: List[Dict[str, Any]] = []
    refused = 0
    files = []
    for name in (OLD_EVENT_FILE, EVENT_FILE):
        path = os.path.join(directory, name)
        # A file grows past MAX_FILE_BYTES by at most one line before it is rotated.
        data = read_file_bytes(path, "event log", max_bytes=MAX_FILE_BYTES + MAX_LINE_BYTES, trust=PRIVATE,
                               error=EventLogRejected)
        if data is None:
            continue
        files.append(path)
        for raw in data.split(b"\n"):
            if not raw.strip():
                continue
            event = _parse_line(raw)
            if event is None:
                refused += 1
            else:
                events.append(event)
    events.sort(key=lambda e: e["t"])
    return EventsRead(events=tuple(events), refused_lines=refused, files=tuple(files))


def _parse_line(raw: bytes) -> Optional[Dict[str, Any]]:
    try:
        return parse_record(raw, EVENT_SCHEMA, "event log line")
    except RecordRejected:
        return None
