"""File and JSON primitives shared by every on-disk record (shards, sidecars, manifests, journals)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
from typing import Any

logger = logging.getLogger(__name__)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def loads_strict_json(text: str) -> Any:
    """`json.loads` that refuses NaN/Infinity constants and duplicate keys (ValueError)."""
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys)


def fsync_dir(directory: str) -> None:
    """Make a rename in `directory` durable; filesystems without directory fsync are tolerated."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        logger.debug("directory fsync not supported on %s (%s)", directory, exc)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Make `data` visible at `path` only complete: temp file, fsync, rename, fsync the dir."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(directory)
