"""CampaignJournal: the append-only ground-truth log (JSON lines, one record per line)."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Iterable, List, Optional, Tuple

from lm_resiliency.files import CONFIG, make_parents, read_file_bytes

from ._files import locked
from .records import FaultInjectionRecord

logger = logging.getLogger(__name__)

# A journal holds one short line per executed or refused fault.
JOURNAL_MAX_BYTES = 256 * 1024 * 1024


class CampaignJournal:
    """Ground truth of what the injector did, kept apart from anything SCOUT or GEMINI write.

    With a `path`, every `append` writes one complete JSON line with a single ``write`` on an
    ``O_APPEND`` descriptor under an exclusive ``flock`` and fsyncs it, so ranks and successive
    worker generations on one host can share one journal file and a line is either complete or
    absent. A final line without its newline (a writer killed mid-write) is skipped with a
    warning; any other malformed line fails the read (the journal is never silently trimmed).
    Without a path the journal lives in memory (for single-process use and tests).
    """

    def __init__(self, path: Optional[str] = None, *, timeout_s: float = 30.0) -> None:
        self._path = None if path is None else os.path.abspath(os.fspath(path))
        self._timeout_s = float(timeout_s)
        self._memory: List[FaultInjectionRecord] = []
        self._lock = threading.Lock()
        if self._path is not None:
            make_parents(self._path)

    @property
    def path(self) -> Optional[str]:
        return self._path

    def append(self, record: FaultInjectionRecord) -> None:
        if not isinstance(record, FaultInjectionRecord):
            raise TypeError(f"CampaignJournal.append: expected a FaultInjectionRecord, got "
                            f"{type(record).__name__}")
        with self._lock:
            if self._path is None:
                self._memory.append(record)
                return
            line = (json.dumps(record.to_json(), sort_keys=True, allow_nan=False,
                               separators=(",", ":")) + "\n").encode("utf-8")
            with locked(self._path + ".lock", timeout_s=self._timeout_s):
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                             | getattr(os, "O_CLOEXEC", 0), 0o600)
                try:
                    view = memoryview(line)
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def extend(self, records: Iterable[FaultInjectionRecord]) -> None:
        for record in records:
            self.append(record)

    def records(self) -> Tuple[FaultInjectionRecord, ...]:
        """Every record, in append order."""
        with self._lock:
            if self._path is None:
                return tuple(self._memory)
            # Ground truth other processes append to: not writable by group or others.
            data = read_file_bytes(self._path, "campaign journal", max_bytes=JOURNAL_MAX_BYTES, trust=CONFIG)
            if data is None:
                return ()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        if tail:
            logger.warning("campaign journal %s ends with an incomplete line (%d bytes, a writer was "
                           "interrupted); ignoring it", self._path, len(tail))
        out = []
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                out.append(FaultInjectionRecord.from_json(raw.decode("utf-8")))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{self._path}:{number}: malformed journal line: {exc}") from exc
        return tuple(out)

    def __len__(self) -> int:
        return len(self.records())

    def __repr__(self) -> str:
        return f"CampaignJournal({self._path!r})"


__all__ = ["CampaignJournal"]
