"""An fcntl lock with a bounded wait, for the fault kit's shared campaign state. Atomic replace,
directory fsync and owned-file opens are `lm_resiliency.files`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from typing import Iterator

from lm_resiliency.files import CLOEXEC, NOFOLLOW

_POLL_S = 0.005


@contextlib.contextmanager
def locked(lock_path: str, *, exclusive: bool = True, timeout_s: float = 30.0) -> Iterator[None]:
    """Hold an advisory `flock` on `lock_path` (created if missing); TimeoutError after timeout_s."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o600)  # never through a link
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"could not lock {lock_path} within {timeout_s}s "
                                       "(another process holds it)") from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
