"""A single-threaded background job runner whose first failure is kept for the caller to raise."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from lm_resiliency.errors import ResiliencyError

logger = logging.getLogger(__name__)

_STOP = object()


class BackgroundError(ResiliencyError, RuntimeError):
    """A background capture, replication or flush failed; raised at the next maybe_wait()/save()."""


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.error: Optional[BaseException] = None
        self._queue: "queue.Queue" = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=f"lm-resiliency-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Finish queued jobs, then end the thread. False if it did not end in time."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the training thread
                logger.error("GEMINI %s worker failed: %s", self.name, exc)
                if self.error is None:
                    self.error = exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
