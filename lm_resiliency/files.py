"""Every file and record read or written: atomic publication, owned-file opens, strict JSON, and
the record layer (one reader, with a declared schema, for every document that comes from another
process, the store, shared memory or disk; one private-directory policy)."""

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
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Mapping, Optional, Tuple, Type, Union

from lm_resiliency.errors import ResiliencyError

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


def json_copy(value: Any, *, default: Optional[Callable[[Any], Any]] = None) -> Any:
    """`value` as every receiver of it as JSON sees it (tuples become lists, a deep copy); ValueError
    for NaN/Infinity, TypeError for what JSON cannot hold unless `default` turns it into JSON."""
    return json.loads(json.dumps(value, allow_nan=False, default=default))


def fsync_dir(directory: str) -> None:
    """Make a rename in `directory` durable; filesystems without directory fsync are tolerated."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        logger.debug("directory fsync not supported (%s)", exc)


def atomic_write(path: str, data: Union[bytes, Callable[[BinaryIO], None]], *,
                 temp_name: Optional[str] = None, dir_fd: Optional[int] = None, mode: int = 0o600) -> None:
    """Make a file visible at `path` only complete: temp file, fsync, rename, fsync the dir.

    `data` is the bytes, or a function that streams them into the open temp file. The temp
    file is created in the same directory (never through a symlink, `mode`: 0600 unless the file
    is a user's own output, such as a report they asked for) under
    `temp_name`, or a random name; it is removed when anything fails before the rename. With
    `dir_fd`, `path` is a name inside that open directory (no path lookup can be redirected)."""
    if dir_fd is None:
        directory = os.path.dirname(os.path.abspath(path))
        final = path
        temp = os.path.join(directory, temp_name or f".{os.path.basename(path)}.tmp-{secrets.token_hex(8)}")
    else:
        final = path
        temp = temp_name or f".{path}.tmp-{secrets.token_hex(8)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600, dir_fd=dir_fd)
    published = False
    try:
        os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            fd = -1
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        published = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not published:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
    if dir_fd is None:
        fsync_dir(directory)
    else:
        _fsync_fd(dir_fd)


def open_owned(path: str, what: str, reject: Callable[[str], Exception], *, flags: int = os.O_RDONLY,
               dir_fd: Optional[int] = None, shown: Optional[str] = None, uid: Optional[int] = None,
               owners: Optional[Tuple[int, ...]] = None, forbidden_mode: int = 0) -> Optional[int]:
    """Open `path` (relative to `dir_fd` when given) as a regular file this process owns, never
    following a symbolic link; None when it does not exist. The fd is returned blocking.

    Refused with `reject(message)` (the message starts with `shown`, default `path`, and `what`):
    a symbolic link, anything but a regular file, a file owned by another uid than `uid` (or any
    of `owners`; default: the effective uid), a mode with any `forbidden_mode` bit set, or a
    stat/open that fails. Checked before the open and again on the open fd, so a file swapped in
    between is refused too."""
    shown = path if shown is None else shown
    allowed = owners if owners is not None else (os.geteuid() if uid is None else uid,)

    def check(st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            reason = "is a symbolic link; refusing to follow it"
        elif not stat.S_ISREG(st.st_mode):  # opening a FIFO would block until a writer appears
            reason = "is not a regular file; refusing to open it"
        elif st.st_uid not in allowed:
            expected = (f"this process (uid {allowed[0]})" if len(allowed) == 1
                        else f"uid {' or '.join(map(str, allowed))}")
            reason = f"is owned by uid {st.st_uid}, not by {expected}; refusing to open it"
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


# ------------------------------------------------------------------ the record layer
#
# Every document that comes from another process, the store, shared memory or disk is read here:
# bytes (from a file checked for type, owner and mode, or from the store/wire), a size bound, strict
# JSON, then a declared schema (identity/version, keys, types, ranges). Anything else raises
# RecordRejected (or the caller's subclass of it) with a message that starts with where it came from.

DEFAULT_MAX_RECORD_BYTES = 64 * 1024
# Library-written records: this user's, no group/other access at all (they are written 0600).
PRIVATE = "private"
# Configuration a person wrote for the library (a policy file): this user's or root's, and not
# writable by group or others (it may name code to import).
CONFIG = "config"
# A file a person named for this one call (a command-line input): any owner or mode and links
# followed, as the person chose it; still only a regular file (never a FIFO) and size-bounded.
INPUT = "input"
_FILE_TRUST = {PRIVATE: 0o077, CONFIG: 0o022}


class RecordRejected(ResiliencyError, ValueError):
    """A document from outside this process is missing a part, malformed, too large, of another
    schema or version, out of range, or its file is unsafe (a link, not a regular file, another
    owner, group/other access). The message names where it came from and what was wrong."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Field:
    """One key of a record: the JSON types it may hold and the values it may take."""

    types: Tuple[type, ...]
    """Accepted Python types after JSON decoding (`int` never accepts a bool; `float` accepts an int)."""
    minimum: Optional[float] = None
    """Smallest accepted number (int/float values)."""
    maximum: Optional[float] = None
    """Largest accepted number (int/float values)."""
    max_length: Optional[int] = None
    """Longest accepted string, list or object."""
    nonempty: bool = False
    """Strings, lists and objects must not be empty."""
    choices: Optional[Tuple[Any, ...]] = None
    """The only accepted values, when set."""
    items: Optional["Field"] = None
    """The field every list element (or object value) must satisfy."""
    record: Optional["RecordSchema"] = None
    """The schema a nested object must satisfy."""
    required: bool = True
    """Whether the key must be present."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordSchema:
    """What one kind of document must look like."""

    what: str
    """What the document is, in words, for messages ("restart context")."""
    fields: Mapping[str, Field]
    """Every key the document may hold (no other key is accepted unless `open_keys`)."""
    identity: Optional[Tuple[str, Any]] = None
    """(key, value) that names the schema and its version, e.g. ("schema", "lm-resiliency-x/2")."""
    open_keys: bool = False
    """Accept keys that are not declared (a record that other versions extend)."""
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """The largest encoded document accepted."""


def integer(minimum: Optional[int] = 0, maximum: Optional[int] = None, *, required: bool = True) -> Field:
    return Field(types=(int,), minimum=minimum, maximum=maximum, required=required)


def number(minimum: Optional[float] = None, maximum: Optional[float] = None, *, required: bool = True) -> Field:
    return Field(types=(float,), minimum=minimum, maximum=maximum, required=required)


def text(*, nonempty: bool = True, max_length: Optional[int] = 4096, required: bool = True,
         choices: Optional[Tuple[str, ...]] = None) -> Field:
    return Field(types=(str,), nonempty=nonempty, max_length=max_length, required=required, choices=choices)


def boolean(*, required: bool = True) -> Field:
    return Field(types=(bool,), required=required)


def array(items: Field, *, max_length: Optional[int] = 4096, nonempty: bool = False,
          required: bool = True) -> Field:
    return Field(types=(list,), items=items, max_length=max_length, nonempty=nonempty, required=required)


# Every value strict JSON decodes to.
JSON_TYPES: Tuple[type, ...] = (dict, list, str, int, float, bool, type(None))


def any_json(*, required: bool = True) -> Field:
    """Any JSON value (a caller's own structure, checked by its owner)."""
    return Field(types=JSON_TYPES, required=required)


def nested(schema: "RecordSchema", *, required: bool = True) -> Field:
    return Field(types=(dict,), record=schema, required=required)


def nullable(field: Field) -> Field:
    """`field`, or JSON null."""
    return Field(types=(*field.types, type(None)), minimum=field.minimum, maximum=field.maximum,
                 max_length=field.max_length, nonempty=field.nonempty, choices=field.choices, items=field.items,
                 record=field.record, required=field.required)


def _type_ok(value: Any, types: Tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _field_problem(value: Any, field: Field, path: str) -> Optional[str]:
    if not _type_ok(value, field.types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in field.types)
        return f"{path} must be {names}, got {type(value).__name__} {_shown(value)}"
    if value is None:
        return None
    if field.choices is not None and value not in field.choices:
        return f"{path} must be one of {list(field.choices)}, got {_shown(value)}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if field.minimum is not None and value < field.minimum:
            return f"{path} must be at least {_bound(field.minimum)}, got {value!r}"
        if field.maximum is not None and value > field.maximum:
            return f"{path} must be at most {_bound(field.maximum)}, got {value!r}"
    if isinstance(value, (str, list, dict)):
        if field.nonempty and not value:
            return f"{path} must not be empty"
        if field.max_length is not None and len(value) > field.max_length:
            return f"{path} holds {len(value)} items or characters; at most {field.max_length} are accepted"
    if isinstance(value, list) and field.items is not None:
        for index, item in enumerate(value):
            problem = _field_problem(item, field.items, f"{path}[{index}]")
            if problem is not None:
                return problem
    if isinstance(value, dict):
        if field.record is not None:
            return _record_problem(value, field.record, f"{path}.")
        if field.items is not None:
            for key, item in value.items():
                problem = _field_problem(item, field.items, f"{path}[{key!r}]")
                if problem is not None:
                    return problem
    return None


def _bound(limit: float) -> str:
    """A range bound as written: 4294967295, not 4.29497e+09."""
    return str(int(limit)) if float(limit).is_integer() else f"{limit:g}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _record_problem(doc: Any, schema: RecordSchema, prefix: str = "") -> Optional[str]:
    if not isinstance(doc, dict):
        return f"{prefix or 'the document '}is not a JSON object ({type(doc).__name__})"
    if schema.identity is not None:
        key, expected = schema.identity
        found = doc.get(key)
        # `==` alone would take True for 1 and 1.0 for 1.
        if type(found) is not type(expected) or found != expected:
            shown = "nothing" if key not in doc else _shown(found)
            return f"not a {schema.what} of this version: {prefix}{key}: expected {expected!r}, got {shown}"
    declared = set(schema.fields) | ({schema.identity[0]} if schema.identity else set())
    unknown = sorted(set(doc) - declared, key=str)
    if unknown and not schema.open_keys:
        return (f"unknown key(s) {[prefix + str(k) for k in unknown]} in a {schema.what}; "
                f"accepted: {sorted(declared)}")
    missing = sorted(k for k, f in schema.fields.items() if f.required and k not in doc)
    if missing:
        return f"missing keys {[prefix + k for k in missing]} in a {schema.what}"
    for key, field in schema.fields.items():
        if key in doc:
            problem = _field_problem(doc[key], field, prefix + key)
            if problem is not None:
                return problem
    return None


def check_record(doc: Any, schema: RecordSchema, where: str, *,
                 error: Type[RecordRejected] = RecordRejected) -> Dict[str, Any]:
    """`doc` (already decoded, e.g. from TOML) when it satisfies `schema`; else `error`."""
    problem = _record_problem(doc, schema)
    if problem is not None:
        raise error(f"{where}: {problem}")
    return doc


def decode_record(data: Union[bytes, str], schema: RecordSchema, where: str, *,
                  error: Type[RecordRejected] = RecordRejected) -> Any:
    """The strict JSON value in `data` (at most `schema.max_bytes`), not yet checked against `schema`.
    The error's `__cause__` is the decoder's exception: a UnicodeDecodeError or json.JSONDecodeError
    means bytes that may still be changing (a reader may retry); anything else is a file that is
    complete and not strict JSON (NaN, duplicate keys, too deep)."""
    size = len(data)
    if size > schema.max_bytes:
        raise error(f"{where}: a {schema.what} of {size} bytes; at most {schema.max_bytes} are accepted")
    try:
        return loads_strict_json(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{where}: not a {schema.what}: not valid JSON ({exc})") from exc


def parse_record(data: Union[bytes, str], schema: RecordSchema, where: str, *,
                 error: Type[RecordRejected] = RecordRejected) -> Dict[str, Any]:
    """Bytes from a file, the store, shared memory or the wire -> a document satisfying `schema`."""
    return check_record(decode_record(data, schema, where, error=error), schema, where, error=error)


def encode_record(doc: Mapping[str, Any], schema: RecordSchema) -> bytes:
    """The bytes `parse_record` reads back as exactly `doc` (checked before anything is written)."""
    data = json.dumps(doc, sort_keys=True, allow_nan=False).encode("utf-8")
    parse_record(data, schema, f"a {schema.what} about to be written")
    return data


def read_file_bytes(path: str, what: str, *, max_bytes: int, trust: str = PRIVATE, dir_fd: Optional[int] = None,
                    shown: Optional[str] = None, uid: Optional[int] = None,
                    error: Type[RecordRejected] = RecordRejected) -> Optional[bytes]:
    """The bytes of `path` (None when it does not exist), after the checks for `trust` and a size
    bound. PRIVATE: this user's (`uid`, default the effective uid), no group/other access; CONFIG:
    this user's or root's, not group/other writable (both never follow a link, see open_owned);
    INPUT: a file a person named, any owner, links followed. Never blocks on a FIFO."""
    if trust == INPUT:
        fd = _open_input(path, what, shown or path, error)
    else:
        me = os.geteuid() if uid is None else uid
        owners = (me,) if trust == PRIVATE else (me, 0)
        fd = open_owned(path, what, error, dir_fd=dir_fd, shown=shown, owners=owners,
                        forbidden_mode=_FILE_TRUST[trust])
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{shown or path}: {what} is larger than {max_bytes} bytes; refusing to read it")
    return data


def _open_input(path: str, what: str, shown: str, error: Type[RecordRejected]) -> Optional[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)  # never waits for a FIFO's writer
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise error(f"{shown}: cannot open {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{shown}: {what} is not a regular file; refusing to read it")
    os.set_blocking(fd, True)
    return fd


def read_record(path: str, schema: RecordSchema, *, trust: str = PRIVATE, dir_fd: Optional[int] = None,
                shown: Optional[str] = None, error: Type[RecordRejected] = RecordRejected) -> Optional[Dict[str, Any]]:
    """The document at `path` satisfying `schema` (None when the file does not exist)."""
    data = read_file_bytes(path, schema.what, max_bytes=schema.max_bytes, trust=trust, dir_fd=dir_fd, shown=shown,
                           error=error)
    return None if data is None else parse_record(data, schema, shown or path, error=error)


def write_record(path: str, doc: Mapping[str, Any], schema: RecordSchema) -> None:
    """Publish `doc` at `path` atomically (0600) after checking it against `schema`."""
    atomic_write(path, encode_record(doc, schema))


def make_parents(path: str) -> None:
    """Create the missing parent directories of a file the user named (as the umask allows): the
    user's own folder, not a private one (the file itself is written 0600)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def ensure_private_dir(path: str, what: str, *, error: Type[RecordRejected] = RecordRejected) -> None:
    """The one private-directory policy: create `path` 0700 (missing parents as the umask allows),
    or accept an existing one only when it is a real directory (not a link) this user owns with no
    group/other access. An existing directory is never chmod-ed: a mode someone chose is theirs to
    change, and a directory that became accessible to others may already hold their files."""
    os.close(open_private_dir(path, what, parents=True, error=error))


def open_private_dir(path: str, what: str, *, dir_fd: Optional[int] = None, shown: Optional[str] = None,
                     parents: bool = False, error: Type[RecordRejected] = RecordRejected) -> int:
    """`ensure_private_dir` returning an open fd of the directory (`path` relative to `dir_fd` when
    given; `shown` names it in messages). The checks run on the open fd, so a directory swapped
    after the check is never the one used; `parents` creates missing parents (without `dir_fd`)."""
    shown = path if shown is None else shown
    try:
        parent = os.path.dirname(os.path.abspath(path))
        if parents and dir_fd is None and not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise error(f"cannot create the {what} {shown}: {exc.strerror or exc}") from None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        try:
            info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise error(f"{what} {shown}: cannot open it: {exc.strerror or exc}") from None
        raise error(_private_dir_problem(info, what, shown) or f"{what} {shown}: cannot open it: "
                    f"{exc.strerror or exc}") from None
    try:
        problem = _private_dir_problem(os.fstat(fd), what, shown)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise error(problem)
    return fd


def check_private_dir(path: str, what: str, *, error: Type[RecordRejected] = RecordRejected) -> None:
    """Refuse `path` unless it is a real directory this user owns with no group/other access
    (readers call this again before trusting what is inside: a mode can change after setup)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise error(f"{what} {path}: cannot stat it: {exc.strerror or exc}") from None
    problem = _private_dir_problem(info, what, path)
    if problem is not None:
        raise error(problem)


def _private_dir_problem(info: os.stat_result, what: str, shown: str) -> Optional[str]:
    if stat.S_ISLNK(info.st_mode):
        return f"{what} {shown} is a symbolic link; refusing to follow it. Point it at a directory this user owns"
    if not stat.S_ISDIR(info.st_mode):
        return f"{what} {shown} is not a directory; point it at a directory this user owns"
    if info.st_uid != os.geteuid():
        return (f"{what} {shown} is owned by uid {info.st_uid}, not this user (uid {os.geteuid()}); "
                "refusing to use it. Use a directory this user owns")
    if info.st_mode & 0o077:
        return (f"{what} {shown} has mode {stat.S_IMODE(info.st_mode):04o}: group/other access is not "
                "allowed. It is not changed for you; chmod 700 it or use another directory")
    return None
