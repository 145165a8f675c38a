"""Call a reader that must refuse a FIFO at once; an old reader that blocks in open() is released
(a writer opens the FIFO) so the test fails instead of hanging."""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional

import pytest


def refusal_without_blocking(read: Callable[[], object], fifo: str, timeout_s: float = 30.0) -> BaseException:
    """The exception `read()` raised; pytest.fail when it blocked or returned."""
    outcome: list = []

    def run() -> None:
        try:
            read()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(timeout=timeout_s)
    if reader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=timeout_s)
        pytest.fail(f"reading {fifo} blocked: a FIFO must be refused at once")
    error: Optional[BaseException] = outcome[0] if outcome else None
    if error is None:
        pytest.fail(f"reading the FIFO {fifo} was not refused")
    return error
