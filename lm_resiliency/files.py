"""File and JSON primitives shared by every on-disk record (shards, sidecars, manifests, journals)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
from itertools import accumulate
from typing import Any, BinaryIO, Callable, Optional, Union

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


# Deepest nesting of arrays/objects any record may have. Python's decoder recurses once per level
# and raises RecursionError near 1000 (less in a deep call stack), so a crafted file must be refused
# before it is parsed. What GEMINI writes stays far below (codec.MAX_STATE_DEPTH).
MAX_JSON_DEPTH = 256

# A JSON string, or an unterminated one up to the end: linear, never backtracks.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_nesting(text: str) -> int:
    """How deeply arrays/objects nest in `text`, without parsing it (no recursion). Brackets inside
    strings do not count; for malformed text the result is at least the depth a parser reaches
    before it fails."""
    skeleton = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(0, max(accumulate(map(_BRACKET_STEP.__getitem__, skeleton)), default=0))


def loads_strict_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` that refuses NaN/Infinity constants, duplicate keys and arrays/objects nested
    deeper than `max_depth` (ValueError in every case)."""
    depth = json_nesting(text)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep; at most {max_depth} are accepted")
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


def atomic_write(path: str, data: Union[bytes, Callable[[BinaryIO], None]], *,
                 temp_name: Optional[str] = None) -> None:
    """Make a file visible at `path` only complete: temp file, fsync, rename, fsync the dir.

    `data` is the bytes, or a function that streams them into the open temp file. The temp
    file is created in the same directory (never through a symlink, mode 0600) under
    `temp_name`, or a random name; it is removed when anything fails before the rename."""
    directory = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(directory, temp_name or f".{os.path.basename(path)}.tmp-{secrets.token_hex(8)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o600)
    published = False
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            fd = -1
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        published = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not published:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    fsync_dir(directory)
