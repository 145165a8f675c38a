"""Node-local persistence tier of GEMINI (checkpoint format version 3).

One `NodeLocalStore` per rank owns the directory ``<root>/<namespace>/rank-<rank>/``, where the
namespace is an opaque hash of the run id and the job-wide topology fingerprint. It holds:

- shard files ``own-<step>.gemini`` (this rank's state) and ``peer-<owner>-<step>.gemini``
  (the replica a peer sent us), each a ``torch.save`` of exactly
  ``{"format_version": 3, "metadata": <JSON text>, "payload": <1-D uint8 tensor>}``;
- ``status.json``, this rank's trust sidecar (only this rank ever writes it).

What it guarantees:

- A file becomes visible only by same-directory ``os.replace`` of a fully written and fsynced
  temporary file, followed by an fsync of the directory. A writer killed mid-write leaves only a
  temporary file; opening the store (and the next write of the same file) removes it when it was
  left by a dead process of the same boot and PID namespace. Temporary files of live writers, or
  from another host or PID namespace, are never removed: a local PID check says nothing about
  the latter.
- Reading never unpickles arbitrary objects (``torch.load(weights_only=True)``), never follows a
  symlink, never opens anything but a regular file (a FIFO would block), refuses files owned by
  another user and archives with compressed entries or sizes that do not fit in the file (checked
  before torch.load allocates anything), refuses JSON nested deeper than
  ``files.MAX_JSON_DEPTH``, and validates format version, JSON metadata schema, run id, topology,
  owner rank, step, holder rank, layout, payload size and (with ``verify_integrity``) the CRC-32
  before returning anything. Every failure is `ShardRejected` (`StatusRejected` for the sidecar).
- Caller metadata (structure, extra, status) must be plain JSON (dict with str keys, list, str,
  finite float, int, bool, None) nested at most ``files.MAX_JSON_DEPTH - 1`` levels; anything
  else fails the write, never the read, so what is read back is exactly what was written.

What it does not do: interpret the structure (the manager does), or prove who produced the
bytes. CRC-32 detects accidental corruption only.

Why one module of this size: every read and write of the on-disk format (shards, status
sidecars, namespaces, their validation) lives together so the format has one definition.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import pickle
import re
import secrets
import socket
import time
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, BinaryIO, List, Optional, Set

import torch

from lm_resiliency._values import is_int as _is_int
from lm_resiliency.checksum import crc32, tensor_crc32
from lm_resiliency.files import (MAX_JSON_DEPTH, PRIVATE, Field, RecordRejected, RecordSchema, any_json, atomic_write,
                                 check_record, decode_record, ensure_private_dir, fsync_dir, integer, nullable,
                                 open_owned, parse_record, read_file_bytes, text)

from lm_resiliency.codec import Layout, StateSchemaError, check_structure

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3

SHARD_SUFFIX = ".gemini"
STATUS_FILE = "status.json"
# Bound on how long `read_status` keeps retrying decode failures, whatever `timeout_s` says.
STATUS_RETRY_CAP_S = 5.0
STATUS_RETRY_SLEEP_S = 0.05

_KINDS = ("own", "peer")
_TOP_KEYS = frozenset({"format_version", "metadata", "payload"})
_OBJECT = Field(types=(dict,))
# The JSON metadata inside a shard file; its structure may describe a large state dict.
SHARD_METADATA_SCHEMA = RecordSchema(
    what="GEMINI shard metadata", identity=("format_version", FORMAT_VERSION), max_bytes=256 * 1024 * 1024,
    fields={"run_id": text(max_length=None), "topology": text(max_length=None), "owner_rank": integer(0),
            "holder_rank": integer(0), "kind": text(choices=_KINDS), "step": integer(0), "layout": _OBJECT,
            "structure": any_json(), "extra": _OBJECT, "crc32": nullable(integer(0, 2 ** 32 - 1))})
STATUS_SCHEMA = RecordSchema(
    what="GEMINI status sidecar", identity=("format_version", FORMAT_VERSION), max_bytes=16 * 1024 * 1024,
    fields={"run_id": text(max_length=None), "topology": text(max_length=None), "rank": integer(0),
            "status": _OBJECT})

_OWN_RE = re.compile(r"own-(\d{12,})\.gemini")
_PEER_RE = re.compile(r"peer-(\d{5,})-(\d{12,})\.gemini")
_TEMP_RE = re.compile(r"\.(?P<final>.+)\.tmp-(?P<scope>[0-9a-f]+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)")
_ATTACHED_RE = re.compile(r"\.attached-(?P<scope>[0-9a-f]+)-(?P<pid>\d+)-(?P<start>\d+)-[0-9a-f]+")

# torch.save of the shard record writes 7 entries (pickle, storage, version markers).
_MAX_ZIP_ENTRIES = 32

_LEGACY_HINT = ("legacy or unknown GEMINI node-local formats are not loadable by this release; "
                "resume from the framework's durable checkpoint")


class ShardRejected(RecordRejected):
    """A shard file exists (or was asked for) but must not be used. The message names the file."""


class StatusRejected(RecordRejected):
    """A status sidecar is persistently malformed or belongs to another run, topology or rank."""


class NodeLocalDirRejected(RecordRejected, PermissionError):
    """A GEMINI node-local directory is not private to this user (a link, a file, another owner,
    group/other access) or cannot be created. An OSError too, as it was before the record layer."""


@dataclass(frozen=True, slots=True)
class ShardKey:
    """Names one shard: whose state (`owner_rank`), at which `step`, own copy or peer replica."""

    kind: str
    owner_rank: int
    step: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"ShardKey.kind must be 'own' or 'peer', got {self.kind!r}")
        if not _is_int(self.owner_rank) or self.owner_rank < 0:
            raise ValueError(f"ShardKey.owner_rank must be a non-negative int, got {self.owner_rank!r}")
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"ShardKey.step must be a non-negative int, got {self.step!r}")

    @property
    def file_name(self) -> str:
        if self.kind == "own":
            return f"own-{self.step:012d}{SHARD_SUFFIX}"
        return f"peer-{self.owner_rank:05d}-{self.step:012d}{SHARD_SUFFIX}"


@dataclass(frozen=True, eq=False)
class Shard:
    """A validated shard as read back from disk."""

    key: ShardKey
    holder_rank: int
    layout: Layout
    structure: Any
    payload: torch.Tensor
    extra: dict


def run_namespace(run_id: str, topology: str) -> str:
    """Opaque directory name binding files to one run id and one topology fingerprint."""
    digest = hashlib.sha256(f"{run_id}\0{topology}".encode("utf-8")).hexdigest()
    return "gemini-" + digest[:24]


def boot_id() -> str:
    """The kernel's boot id ('' where /proc does not say): one value per host boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "r", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def temp_scope() -> str:
    """Who may reap a temporary file by PID check: same boot and same PID namespace.

    A short hex hash of the kernel boot id and the PID-namespace inode. Where /proc is missing
    it falls back to the host name (weaker: containers sharing a host name share a scope).
    """
    boot, source = boot_id(), f"host\0{socket.gethostname()}"
    if boot:
        try:
            source = f"boot\0{boot}\0{os.stat('/proc/self/ns/pid').st_ino}"
        except OSError:
            pass
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def process_start_time(pid: int) -> Optional[int]:
    """Kernel start time of `pid` (clock ticks since boot), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start_time: Optional[int] = None) -> bool:
    """Whether the process that recorded (pid, start_time) still runs (a zombie does not); without
    `start_time`, whether any process `pid` runs. Shared by every temp/slot reaper in GEMINI."""
    if pid <= 0:
        return True  # not a process we could have been: never treat as dead
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        fields = data[data.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            return False
        return start_time is None or int(fields[19]) == start_time
    except (ValueError, IndexError):
        return True


def attachment(name: str) -> Optional[str]:
    """What the attachment record named `name` says of its process: "live" (it runs, in this boot
    and PID namespace), "dead", or "foreign" (another boot or PID namespace: not checkable here);
    None when `name` is no attachment record."""
    match = _ATTACHED_RE.fullmatch(name)
    if match is None:
        return None
    if match.group("scope") != temp_scope():
        return "foreign"
    alive = process_alive(int(match.group("pid")), int(match.group("start")) or None)
    return "live" if alive else "dead"


def _check_json(value: Any, where: str, depth: int = 1) -> None:
    """Plain JSON only, so that what is read back equals what was written; nested at most as deep
    as a reader accepts (`files.MAX_JSON_DEPTH`, counting the record that holds `value`)."""
    if isinstance(value, (list, dict)) and depth >= MAX_JSON_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_JSON_DEPTH - 1} levels; GEMINI metadata "
                         "readers refuse deeper JSON")
    if value is None or isinstance(value, (str, bool)) or _is_int(value):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{where}: non-finite float {value!r} cannot be stored in GEMINI metadata")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: dict key {key!r} of type {type(key).__name__} is not a str; "
                                "GEMINI metadata must be plain JSON")
            _check_json(item, f"{where}[{key!r}]", depth + 1)
        return
    raise TypeError(f"{where}: value of type {type(value).__module__}.{type(value).__qualname__} is not "
                    "plain JSON (dict with str keys, list, str, int, finite float, bool, None); "
                    "GEMINI never falls back to pickle")


def _shard_crc(metadata: dict, payload: torch.Tensor) -> int:
    """CRC-32 over the canonical metadata (everything but the CRC) and the payload bytes, so a
    flipped byte in the structure or identity is caught as surely as one in a tensor."""
    canonical = json.dumps(metadata, sort_keys=True, allow_nan=False, separators=(",", ":"))
    return tensor_crc32(payload, crc32(canonical.encode("utf-8")))


def _zip_refusal(f: BinaryIO) -> Optional[str]:
    """Why the torch zip archive in `f` must not be handed to `torch.load`, or None.

    GEMINI writes every entry uncompressed, so a compressed entry (a few KiB can inflate to GiBs
    inside torch.load before any GEMINI check runs) or one whose sizes do not fit in the file is
    refused from the central directory alone, before anything is read or allocated."""
    size = os.fstat(f.fileno()).st_size
    try:
        with zipfile.ZipFile(f) as archive:
            entries = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - zipfile raises many types for a corrupt directory
        return (f"not a readable torch file (truncated or corrupt, or not the zip archive every GEMINI "
                f"shard is; it is never unpickled): {_summarize(exc)}")
    finally:
        f.seek(0)
    if len(entries) > _MAX_ZIP_ENTRIES:
        return f"{len(entries)} archive entries; a GEMINI shard has at most {_MAX_ZIP_ENTRIES}"
    declared = 0
    for entry in entries:
        name = entry.filename
        if entry.compress_type != zipfile.ZIP_STORED:
            return (f"archive entry {name!r} is compressed (method {entry.compress_type}); GEMINI shards "
                    "are written uncompressed and compressed entries are never inflated")
        if entry.flag_bits & 0x1:
            return f"archive entry {name!r} is encrypted"
        if entry.file_size != entry.compress_size:
            return (f"archive entry {name!r} declares {entry.file_size} bytes but stores "
                    f"{entry.compress_size}")
        declared += entry.compress_size
        if entry.header_offset + entry.compress_size > size or declared > size:
            return (f"archive entry {name!r} declares {entry.compress_size} bytes at offset "
                    f"{entry.header_offset}, past the end of the {size}-byte file")
    return None


def _summarize(exc: BaseException) -> str:
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error" in line or "Unsupported global" in line:
            return line.strip()
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


class NodeLocalStore:
    """One rank's node-local shard files and trust sidecar for one run and topology."""

    def __init__(self, root: str, run_id: str, topology: str, rank: int, *,
                 verify_integrity: bool, timeout_s: float = 30.0) -> None:
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ValueError(f"NodeLocalStore: root must be a non-empty path, got {root!r}")
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"NodeLocalStore: run_id must be a non-empty str, got {run_id!r}")
        if not isinstance(topology, str) or not topology:
            raise ValueError(f"NodeLocalStore: topology must be a non-empty str, got {topology!r}")
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"NodeLocalStore: rank must be a non-negative int, got {rank!r}")
        if not isinstance(verify_integrity, bool):
            raise ValueError(f"NodeLocalStore: verify_integrity must be a bool, got {verify_integrity!r}")
        if (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
                or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise ValueError(f"NodeLocalStore: timeout_s must be a positive number, got {timeout_s!r}")
        self._root = os.path.abspath(os.fspath(root))
        self._run_id = run_id
        self._topology = topology
        self._rank = rank
        self._verify = verify_integrity
        self._timeout_s = float(timeout_s)
        self._uid = os.geteuid()
        namespace_dir = os.path.join(self._root, run_namespace(run_id, topology))
        self._dir = os.path.join(namespace_dir, f"rank-{rank:05d}")
        if os.path.lexists(self._root) and not os.path.isdir(self._root):
            raise NotADirectoryError(errno.ENOTDIR, "InMemoryCkptConfig.disk_folder must be a directory (GEMINI "
                                     "keeps one folder per run in it), but this path is a file; point disk_folder "
                                     "at a directory on the node-local disk", self._root)
        ensure_private_dir(namespace_dir, "GEMINI node-local directory", error=NodeLocalDirRejected)
        ensure_private_dir(self._dir, "GEMINI node-local directory", error=NodeLocalDirRejected)
        # Flushes killed mid-write leave temp files; their step may never be written again (the
        # shm tier recovers it from memory), so they are reaped now, not at the next write.
        self._reap_temps()
        self._namespace_dir = namespace_dir
        self._attached: Optional[str] = self._attach()

    # ------------------------------------------------------------------ attachment

    def _attach(self) -> Optional[str]:
        """Record, in the run's namespace directory, that this process uses it: an empty file
        naming the process (scope, PID, start time), which `python -m lm_resiliency.cleanup` reads
        however the folder is spelled and whatever holds the host slots. Records of dead processes
        of this scope are removed first. A failure only weakens cleanup's liveness check (warning)."""
        for name in os.listdir(self._namespace_dir):
            if attachment(name) == "dead":
                try:
                    os.unlink(os.path.join(self._namespace_dir, name))
                except FileNotFoundError:
                    pass
        pid = os.getpid()
        name = f".attached-{temp_scope()}-{pid}-{process_start_time(pid) or 0}-{secrets.token_hex(4)}"
        try:
            os.close(os.open(os.path.join(self._namespace_dir, name),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        except OSError as exc:
            logger.warning("GEMINI: cannot record that pid %d uses %s (%s); `python -m lm_resiliency.cleanup` "
                           "then judges this run by the age of its files alone", pid, self._namespace_dir, exc)
            return None
        return name

    def detach(self) -> None:
        """Remove this process's attachment record (the manager's `close()`); idempotent."""
        name, self._attached = self._attached, None
        if name is not None:
            try:
                os.unlink(os.path.join(self._namespace_dir, name))
            except OSError:
                pass  # already gone, or the disk went away: a dead process's record is harmless

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> str:
        """This rank's directory (``<root>/<namespace>/rank-<rank>``)."""
        return self._dir

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def topology(self) -> str:
        return self._topology

    @property
    def verify_integrity(self) -> bool:
        return self._verify

    # ------------------------------------------------------------------ shards

    def write_shard(self, key: ShardKey, layout: Layout, structure: Any, payload: torch.Tensor,
                    extra: Optional[dict] = None) -> str:
        """Publish one shard atomically; returns its path. Replaces an existing shard of that key.

        Raises TypeError if `structure` or `extra` is not plain JSON, ValueError if it nests too
        deeply or for a payload that does not match `layout`, OSError (with the path) for I/O
        failures.
        """
        if not isinstance(key, ShardKey):
            raise TypeError(f"write_shard: key must be a ShardKey, got {type(key).__name__}")
        if key.kind == "own" and key.owner_rank != self._rank:
            raise ValueError(f"write_shard: an 'own' shard of store rank {self._rank} cannot have "
                             f"owner_rank {key.owner_rank}")
        if not isinstance(layout, Layout):
            raise TypeError(f"write_shard: layout must be a Layout, got {type(layout).__name__}")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise TypeError(f"write_shard: extra must be a dict, got {type(extra).__name__}")
        _check_json(structure, "structure")
        _check_json(extra, "extra")
        payload = self._checked_payload(payload, layout)
        doc = {
            "format_version": FORMAT_VERSION,
            "run_id": self._run_id,
            "topology": self._topology,
            "owner_rank": key.owner_rank,
            "holder_rank": self._rank,
            "kind": key.kind,
            "step": key.step,
            "layout": layout.to_json(),
            "structure": structure,
            "extra": extra,
        }
        doc["crc32"] = _shard_crc(doc, payload) if self._verify else None
        crc = doc["crc32"]
        try:
            metadata = json.dumps(doc, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"write_shard {key}: metadata is not plain JSON: {exc}") from exc
        obj = {"format_version": FORMAT_VERSION, "metadata": metadata, "payload": payload}
        final = os.path.join(self._dir, key.file_name)
        self._publish(key.file_name, lambda f: torch.save(obj, f))
        logger.debug("published GEMINI shard %s (%d payload bytes, crc32=%s)", final,
                     payload.numel(), crc)
        return final

    def list_shards(self) -> List[ShardKey]:
        """Published shard names in this rank's directory, newest step first. No validation."""
        keys = []
        for name in self._listdir():
            key = self._parse_name(name)
            if key is not None:
                keys.append(key)
        keys.sort(key=lambda k: (-k.step, k.kind != "own", k.owner_rank))
        return keys

    def read_shard(self, key: ShardKey) -> Shard:
        """Load and fully validate one shard; raises ShardRejected for any problem."""
        if not isinstance(key, ShardKey):
            raise TypeError(f"read_shard: key must be a ShardKey, got {type(key).__name__}")
        path = os.path.join(self._dir, key.file_name)
        try:
            return self._read_shard(key, path)
        except ShardRejected as exc:
            logger.warning("GEMINI shard rejected: %s", exc)
            raise

    def remove_shard(self, key: ShardKey) -> None:
        """Delete one published shard (no error if it is already gone)."""
        path = os.path.join(self._dir, key.file_name)
        if self._unlink(path):
            self._sync_dir()

    def prune(self, keep: Set[ShardKey]) -> None:
        """Delete every published shard whose key is not in `keep`."""
        removed = False
        for key in self.list_shards():
            if key not in keep:
                removed |= self._unlink(os.path.join(self._dir, key.file_name))
        if removed:
            self._sync_dir()

    # ------------------------------------------------------------------ status sidecar

    def write_status(self, status: dict) -> None:
        """Publish this rank's trust sidecar atomically (replacing the previous one)."""
        if not isinstance(status, dict):
            raise TypeError(f"write_status: status must be a dict, got {type(status).__name__}")
        _check_json(status, "status")
        doc = {"format_version": FORMAT_VERSION, "run_id": self._run_id, "topology": self._topology,
               "rank": self._rank, "status": status}
        try:
            data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise TypeError(f"write_status: status is not plain JSON: {exc}") from exc
        self._publish(STATUS_FILE, lambda f: f.write(data))
        logger.debug("published GEMINI status sidecar %s", os.path.join(self._dir, STATUS_FILE))

    def read_status(self) -> Optional[dict]:
        """This rank's trust sidecar, or None if there is none.

        Byte/UTF-8/JSON decode failures are retried for a bounded interval (a remote filesystem
        client may briefly see a file being replaced); a persistently malformed file or any
        identity/schema mismatch raises StatusRejected.
        """
        path = os.path.join(self._dir, STATUS_FILE)
        deadline = time.monotonic() + min(self._timeout_s, STATUS_RETRY_CAP_S)
        attempts = 0
        while True:
            attempts += 1
            data = self._read_status_bytes(path)
            if data is None:
                return None
            try:
                doc = decode_record(data, STATUS_SCHEMA, path, error=StatusRejected)
            except StatusRejected as exc:
                # Undecodable bytes may be a file seen mid-replacement; strict-JSON violations
                # (NaN, duplicate keys, nesting) are a complete file and refused at once.
                if not isinstance(exc.__cause__, (UnicodeDecodeError, json.JSONDecodeError)):
                    raise
                if time.monotonic() >= deadline:
                    raise StatusRejected(f"{exc}: malformed after {attempts} reads; refusing to trust it") from None
                time.sleep(STATUS_RETRY_SLEEP_S)
                continue
            return self._checked_status(doc, path)

    # ------------------------------------------------------------------ internals

    def _listdir(self) -> List[str]:
        try:
            return os.listdir(self._dir)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot list GEMINI node-local directory: {exc.strerror}",
                          self._dir) from exc

    def _parse_name(self, name: str) -> Optional[ShardKey]:
        return shard_key_of(name, self._rank)

    @staticmethod
    def _checked_payload(payload: Any, layout: Layout) -> torch.Tensor:
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"write_shard: payload must be a torch.Tensor, got {type(payload).__name__}")
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"write_shard: payload must be a 1-D uint8 tensor, got {payload.dtype} "
                             f"with shape {tuple(payload.shape)}")
        if payload.numel() != layout.total_bytes:
            raise ValueError(f"write_shard: payload has {payload.numel()} bytes, layout needs exactly "
                             f"{layout.total_bytes}")
        if payload.device.type != "cpu":
            raise ValueError(f"write_shard: payload must be in host memory, got device {payload.device}")
        if (not payload.is_contiguous() or payload.storage_offset() != 0
                or payload.untyped_storage().nbytes() != payload.numel()):
            # torch.save writes a view's whole storage: copy so the file holds exactly the payload.
            payload = payload.clone(memory_format=torch.contiguous_format)
        return payload

    def _temp_name(self, final_name: str) -> str:
        return f".{final_name}.tmp-{temp_scope()}-{os.getpid()}-{secrets.token_hex(8)}"

    def _reap_temps(self, final_name: Optional[str] = None) -> None:
        """Remove temp files of `final_name` (default: of any file) left by dead writers of our
        boot and PID namespace. A live writer's temp file is never touched."""
        scope = temp_scope()
        for name in self._listdir():
            match = _TEMP_RE.fullmatch(name)
            if (not match or match.group("scope") != scope
                    or (final_name is not None and match.group("final") != final_name)):
                continue
            pid = int(match.group("pid"))
            if process_alive(pid):
                continue
            path = os.path.join(self._dir, name)
            try:
                os.unlink(path)
                logger.info("removed temporary file %s left by terminated writer (pid %d)", path, pid)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove stale temporary file %s: %s", path, exc)

    def _publish(self, final_name: str, write) -> None:
        """Stream `write(file)` into a scoped temp file (reapable if this process dies) and publish
        it atomically as `final_name` (files.atomic_write)."""
        self._reap_temps(final_name)
        final = os.path.join(self._dir, final_name)
        try:
            atomic_write(final, write, temp_name=self._temp_name(final_name))
        except OSError as exc:
            hint = ""
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                hint = ("; the node-local disk is full or read-only: free space there or point "
                        "InMemoryCkptConfig.disk_folder at a writable local disk")
            raise OSError(exc.errno, f"publishing GEMINI file failed: {exc.strerror or exc}{hint}", final) from exc
        except RuntimeError as exc:  # torch's zip writer reports write failures this way
            raise OSError(errno.EIO, f"publishing GEMINI file failed: {exc}", final) from exc

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise OSError(exc.errno, f"cannot remove GEMINI file: {exc.strerror}", path) from exc
        logger.debug("removed GEMINI shard %s", path)
        return True

    def _sync_dir(self) -> None:
        try:
            fsync_dir(self._dir)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot fsync GEMINI directory: {exc.strerror}", self._dir) from exc

    def _read_shard(self, key: ShardKey, path: str) -> Shard:
        def bad(reason: str) -> ShardRejected:
            return ShardRejected(f"{path}: {reason}")

        fd = open_owned(path, "shard", ShardRejected, uid=self._uid)
        if fd is None:
            raise bad("shard file is missing")
        try:
            with os.fdopen(fd, "rb") as f:
                refusal = _zip_refusal(f)
                if refusal is not None:
                    raise bad(refusal)
                obj = torch.load(f, weights_only=True, map_location="cpu")
        except ShardRejected:
            raise
        except pickle.UnpicklingError as exc:
            raise bad(f"weights-only load refused it (the file is not a GEMINI tensor file and is "
                      f"never unpickled): {_summarize(exc)}") from exc
        except Exception as exc:  # any loader failure means an unusable file
            raise bad(f"not a readable torch file (truncated or corrupt): {_summarize(exc)}") from exc

        if not isinstance(obj, dict):
            raise bad(f"top level is a {type(obj).__name__}, not a GEMINI format {FORMAT_VERSION} "
                      f"record; {_LEGACY_HINT}")
        if "format_version" not in obj:
            raise bad(f"no format_version (legacy GEMINI file); {_LEGACY_HINT}")
        version = obj["format_version"]
        if not _is_int(version) or version != FORMAT_VERSION:
            raise bad(f"format_version {version!r} is not {FORMAT_VERSION}; {_LEGACY_HINT}")
        if set(obj) != _TOP_KEYS:
            raise bad(f"top-level keys {sorted(map(str, obj))} are not exactly {sorted(_TOP_KEYS)}")

        metadata = obj["metadata"]
        if not isinstance(metadata, str):
            raise bad("metadata is not a JSON string")
        meta = parse_record(metadata, SHARD_METADATA_SCHEMA, path, error=ShardRejected)
        if meta["run_id"] != self._run_id:
            raise bad(f"wrong run id (file {meta['run_id']!r}, expected {self._run_id!r})")
        if meta["topology"] != self._topology:
            raise bad(f"wrong topology (file {meta['topology']!r}, expected {self._topology!r})")
        if meta["kind"] != key.kind:
            raise bad(f"wrong kind (file {meta['kind']!r}, expected {key.kind!r})")
        if meta["owner_rank"] != key.owner_rank:
            raise bad(f"wrong owner rank (file {meta['owner_rank']}, expected {key.owner_rank})")
        if meta["step"] != key.step:
            raise bad(f"wrong step (file {meta['step']}, expected {key.step})")
        if meta["holder_rank"] != self._rank:
            raise bad(f"wrong holder rank (file {meta['holder_rank']}, expected {self._rank})")
        if key.kind == "own" and meta["owner_rank"] != meta["holder_rank"]:
            raise bad("an 'own' shard whose owner rank differs from its holder rank")
        crc = meta["crc32"]
        try:
            layout = Layout.from_json(meta["layout"])
        except StateSchemaError as exc:
            raise bad(f"bad layout: {exc}") from exc
        try:
            check_structure(meta["structure"], layout)
        except StateSchemaError as exc:
            raise bad(f"its structure does not match its layout of {len(layout.specs)} tensors: {exc}") from exc

        payload = obj["payload"]
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            desc = (f"{payload.dtype} tensor of shape {tuple(payload.shape)}"
                    if isinstance(payload, torch.Tensor) else type(payload).__name__)
            raise bad(f"payload must be a 1-D uint8 tensor, got {desc}")
        if payload.numel() != layout.total_bytes:
            raise bad(f"payload has {payload.numel()} bytes, layout says {layout.total_bytes}")
        if not payload.is_contiguous():
            payload = payload.contiguous()
        if self._verify:
            if crc is None:
                raise bad("written without integrity checksum (verify_integrity=False); with "
                          "verify_integrity=True only checksummed generations are eligible")
            actual = _shard_crc({k: v for k, v in meta.items() if k != "crc32"}, payload)
            if actual != crc:
                raise bad(f"CRC-32 mismatch (stored {crc:#010x}, computed {actual:#010x}): "
                          "stored bytes are corrupt")
        return Shard(key=key, holder_rank=self._rank, layout=layout, structure=meta["structure"],
                     payload=payload, extra=meta["extra"])

    def _read_status_bytes(self, path: str) -> Optional[bytes]:
        try:
            return read_file_bytes(path, "status sidecar", max_bytes=STATUS_SCHEMA.max_bytes, trust=PRIVATE,
                                   error=StatusRejected)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot read GEMINI status sidecar: {exc.strerror}", path) from exc

    def _checked_status(self, doc: Any, path: str) -> dict:
        def bad(reason: str) -> StatusRejected:
            return StatusRejected(f"{path}: {reason}; refusing to trust it")

        check_record(doc, STATUS_SCHEMA, path, error=StatusRejected)
        if doc["run_id"] != self._run_id:
            raise bad(f"wrong run id (file {doc['run_id']!r}, expected {self._run_id!r})")
        if doc["topology"] != self._topology:
            raise bad(f"wrong topology (file {doc['topology']!r}, expected {self._topology!r})")
        if doc["rank"] != self._rank:
            raise bad(f"wrong rank (file {doc['rank']!r}, expected {self._rank})")
        return doc["status"]


def shard_key_of(name: str, rank: int) -> Optional[ShardKey]:
    """The key of a published shard file name in rank `rank`'s directory, or None (not a shard)."""
    match = _OWN_RE.fullmatch(name)
    if match:
        key = ShardKey("own", rank, int(match.group(1)))
    else:
        match = _PEER_RE.fullmatch(name)
        if not match:
            return None
        key = ShardKey("peer", int(match.group(1)), int(match.group(2)))
    return key if key.file_name == name else None  # canonical spelling only


def read_status_document(path: str) -> Optional[dict]:
    """A rank's status sidecar as written ({format_version, run_id, topology, rank, status}),
    schema-checked (STATUS_SCHEMA) but not bound to a run or rank (what `lm-resiliency inspect`
    reports); None when there is none. StatusRejected for a file that must not be trusted."""
    data = read_file_bytes(path, "status sidecar", max_bytes=STATUS_SCHEMA.max_bytes, trust=PRIVATE,
                           error=StatusRejected)
    return None if data is None else parse_record(data, STATUS_SCHEMA, path, error=StatusRejected)


__all__ = [
    "FORMAT_VERSION", "NodeLocalDirRejected", "NodeLocalStore", "Shard", "ShardKey", "ShardRejected", "StatusRejected",
    "attachment", "read_status_document", "run_namespace", "shard_key_of", "temp_scope",
]
