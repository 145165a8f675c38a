"""What a session tells the user about itself: its event log (lm_resiliency.events), rank 0's INFO
line whenever the capture cadence is new, and the summary at close.

The session calls it at each step of its lifecycle; it keeps the counters the summary reports
(captures, SCOUT verdicts, time spent in lm-resiliency's hooks on the training thread).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, Callable, Dict, Optional

from lm_resiliency.events import EventLog

logger = logging.getLogger(__name__)


class SessionActivity:
    """One session's event log, cadence lines and close summary."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.events: Optional[EventLog] = None
        self.captures = 0
        self.verdicts: "collections.Counter[str]" = collections.Counter()
        self.first_step = 0
        self._last_capture: Optional[int] = None
        self._cadence: Optional[int] = None  # None: not said yet
        self._started_at = time.monotonic()
        self._hook_seconds = 0.0

    def open(self, manager: Any, *, layout: str, framework: str, detection: bool) -> None:
        """Start the event log in `manager`'s node-local directory with a `start` event."""
        self.events = EventLog(manager.store.directory, run_id=manager.run_id, rank=manager.rank,
                               world_size=manager.world_size)
        self.events.record(
            "start", step=None, topology=manager.topology, layout=layout, framework=framework,
            jump=manager.pairing.jump if manager.pairing is not None else 0, interval=self.interval,
            disk_flush_interval=manager.config.disk_flush_interval, disk_folder=manager.config.disk_folder,
            restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"), pid=os.getpid(), detection=detection)

    def record(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.record(event, **fields)

    def resumed(self, step: int, source: str, where: str) -> None:
        self.first_step = self._last_capture = step
        self.record("recovered", step=step, source=source, where=where)

    def fresh(self, step: int, reason: str) -> None:
        self.first_step = step
        self.record("fresh", step=step, reason=reason)

    def verdict(self, verdict: str) -> None:
        self.verdicts[verdict] += 1

    def report(self, report: Any) -> None:
        """A fault SCOUT found (a SCOUTFaultReport)."""
        step = report.step if isinstance(report.step, int) and report.step >= 0 else None
        self.record("report", step=step, kind=report.kind, ranks=list(report.ranks), resource=report.resource)

    def captured(self, step: int, manager: Any) -> None:
        """Count a capture; rank 0 says so at INFO when the cadence is new: the first capture, and
        whenever the gap to the previous one changes (a vetoed or refused capture)."""
        self.captures += 1
        gap = step - self._last_capture if self._last_capture is not None else None
        self.record("capture", step=step)
        if (self._cadence is None or gap != self._cadence) and manager.rank == 0:
            if self._cadence is None or gap == self.interval:
                replica = f"replicated to rank {manager.pairing.send_to}" if manager.pairing else "not replicated"
                every = manager.config.disk_flush_interval
                flush = (f"flushed to {manager.config.disk_folder} every {every} steps" if every
                         else "flushed to disk only at exit or on a signal")
                logger.info("GEMINI: captured step %d; capturing every %d optimizer steps (%s, %s)", step,
                            self.interval, replica, flush)
            else:
                logger.info("GEMINI: captured step %d, %d steps after the previous capture (step %d); the cadence "
                            "stays every %d steps", step, gap, self._last_capture, self.interval)
        self._last_capture = step
        self._cadence = gap if gap is not None else self.interval

    def timed(self, hook: Callable[[], None]) -> Callable[[], None]:
        """`hook`, adding its time to what the summary reports as spent in lm-resiliency."""
        @functools.wraps(hook)
        def timed() -> None:
            began = time.perf_counter()
            try:
                hook()
            finally:
                self._hook_seconds += time.perf_counter() - began

        return timed

    def summary(self, *, step: int, newest_recoverable: int, verified: Optional[int],
                check_errors: int) -> Dict[str, Any]:
        return {"steps": step - self.first_step, "first_step": self.first_step, "last_step": step,
                "captures": self.captures, "newest_recoverable_step": newest_recoverable,
                "recovery_verified_step": verified, "scout_checks": sum(self.verdicts.values()),
                "scout_verdicts": dict(sorted(self.verdicts.items())), "scout_check_errors": check_errors,
                "hook_seconds": round(self._hook_seconds, 3),
                "wall_seconds": round(time.monotonic() - self._started_at, 3)}

    def closed(self, summary: Dict[str, Any], *, run_name: str, detection: bool, rank: int, abnormal: bool) -> None:
        """The `close` event, and rank 0's summary line (INFO)."""
        self.record("close", step=summary["last_step"], abnormal=abnormal, **summary)
        if rank != 0:
            return
        newest, verified = summary["newest_recoverable_step"], summary["recovery_verified_step"]
        scout = "SCOUT off"
        if detection:
            verdicts = ", ".join(f"{n} {v}" for v, n in summary["scout_verdicts"].items()) or "none"
            scout = f"SCOUT {summary['scout_checks']} checks ({verdicts})"
        wall = summary["wall_seconds"]
        share = f" ({100 * summary['hook_seconds'] / wall:.1f}%)" if wall > 0 else ""
        logger.info("lm-resiliency: %sclosing after %d optimizer steps (%d to %d): %d captures, newest recoverable "
                    "step %s, RECOVERY_VERIFIED step %s; %s; %.2f s of %.1f s on the training thread in "
                    "lm-resiliency%s", run_name, summary["steps"], summary["first_step"], summary["last_step"],
                    summary["captures"], newest if newest >= 0 else "none",
                    verified if verified is not None else "none", scout, summary["hook_seconds"], wall, share)
