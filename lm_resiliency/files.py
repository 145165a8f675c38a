"""File and JSON primitives shared by every on-disk record (shards, sidecars, manifests, journals)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import stat
from itertools import accumulate
from typing import Any, BinaryIO, Callable, Optional, Union

logger = logging.getLogger(__name__)

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
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


def open_owned(path: str, what: str, reject: Callable[[str], Exception], *, flags: int = os.O_RDONLY,
               dir_fd: Optional[int] = None, shown: Optional[str] = None, uid: Optional[int] = None,
               forbidden_mode: int = 0) -> Optional[int]:
    """Open `path` (relative to `dir_fd` when given) as a regular file this process owns, never
    following a symbolic link; None when it does not exist. The fd is returned blocking.

    Refused with `reject(message)` (the message starts with `shown`, default `path`, and `what`):
    a symbolic link, anything but a regular file, a file owned by another uid (default: the
    effective uid), a mode with any `forbidden_mode` bit set, or a stat/open that fails. Checked
    before the open and again on the open fd, so a file swapped in between is refused too."""
    shown = path if shown is None else shown
    uid = os.geteuid() if uid is None else uid

    def check(st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            reason = "is a symbolic link; refusing to follow it"
        elif not stat.S_ISREG(st.st_mode):  # opening a FIFO would block until a writer appears
            reason = "is not a regular file; refusing to open it"
        elif st.st_uid != uid:
            reason = f"is owned by uid {st.st_uid}, not by this process (uid {uid}); refusing to open it"
        elif mode & forbidden_mode:
            reason = f"has mode {mode:o}; expected {0o666 & ~forbidden_mode:04o} at most; refusing to open it"
        else:
            return
        raise reject(f"{shown}: {what} {reason}")

    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise reject(f"{shown}: cannot stat {what}: {exc}") from exc
    check(st)
    try:
        # O_NONBLOCK: a FIFO swapped in after the stat is opened without waiting, then refused.
        fd = os.open(path, flags | os.O_NONBLOCK | NOFOLLOW | CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise reject(f"{shown}: {what} is a symbolic link; refusing to follow it") from exc
        raise reject(f"{shown}: cannot open {what}: {exc}") from exc
    try:
        check(os.fstat(fd))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_owned(path: str, what: str, reject: Callable[[str], Exception], max_bytes: int, *,
               dir_fd: Optional[int] = None, shown: Optional[str] = None, uid: Optional[int] = None,
               forbidden_mode: int = 0) -> Optional[bytes]:
    """The bytes of a file `open_owned` accepts (same checks and arguments), None when it does not
    exist; refused with `reject(message)` when it holds more than `max_bytes`."""
    fd = open_owned(path, what, reject, dir_fd=dir_fd, shown=shown, uid=uid, forbidden_mode=forbidden_mode)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise reject(f"{path if shown is None else shown}: {what} is larger than {max_bytes} bytes; refusing to "
                     "read it")
    return data
