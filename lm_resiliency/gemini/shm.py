"""Node-owned shared-memory host slots: GEMINI's in-memory tier survives a worker crash.

One `SharedSlotArena` per rank owns the directory

    <root>/<namespace>/rank-<rank>.<scope>/        (root default: /dev/shm/lm-resiliency-<uid>)
        owner.json                                  who uses this directory: scope, pid, start time
        own_a.seg  own_a.json                       payload segment + READY sidecar, per slot
        own_b.seg  own_b.json
        peer_a.seg peer_a.json
        peer_b.seg peer_b.json

`<namespace>` is `storage.run_namespace(run_id, topology)` plus a short hash of the node-local
disk folder (the in-memory tier and the disk tier hold one checkpoint series; two jobs that
reuse a run id with different `disk_folder`s never see each other's slots). `<scope>` is
`storage.temp_scope()` (boot id + PID namespace): slots are only ever adopted, or reaped, by a
process of the same boot and PID namespace, so a PID check means something and a reboot
(or a container with another PID namespace) never picks up bytes it cannot vouch for.

Other runs' slots are left alone: a relaunch of a crashed job (same run id) adopts them. A
starting arena removes the rank directories of another namespace only when their owner is dead
AND they were last written at least `reap_other_runs_after_s` ago (default 24 h);
`python -m lm_resiliency.cleanup` removes dead runs' slots on demand.

Publication discipline (the same as node-local files). A segment holds only payload bytes;
its sidecar ``<slot>.json`` holds identity (run id, topology, holder rank, owner rank), step,
layout, structure, extra, the segment's size/device/inode and, with `verify_integrity`, a
CRC-32 over the metadata and the payload. A slot is READY exactly when its sidecar exists:

- `retract()` unlinks the sidecar BEFORE the first payload byte is overwritten;
- `publish()` writes the sidecar to a same-directory temporary file and renames it into place
  AFTER the payload is complete (host copy finished, CUDA event synchronized, or replica
  fully received).

A writer killed at any point therefore leaves either the previous READY sidecar describing
bytes that were not touched, or no sidecar at all. A separate sidecar (rather than a header
inside the mapped segment) keeps the READY bit out of memory that a dying writer may be
scribbling on, and gives the same atomic-rename semantics as the disk tier without relying on
store ordering inside a mapping. No fsync is issued: a process crash keeps the page cache
(tmpfs pages are the page cache), and after a power loss the boot id differs so nothing is
adopted.

Ownership and safety: every directory is 0700 and owned by this uid, every file is 0600 and
owned by this uid; nothing is opened through a symbolic link (directory file descriptors,
``O_NOFOLLOW``, ``lstat``/``fstat`` checks). A rank directory is taken over only when its
recorded owner is dead (PID gone, zombie, or PID reused by a process with another start
time); otherwise the arena is unavailable and the manager falls back to heap slots.

Memory is bounded: four slots per rank at most (`SLOT_NAMES`), each reserved with
`posix_fallocate` so a full /dev/shm fails at allocation (heap fallback, warning) rather than
with SIGBUS in the middle of a copy.

Why one module of this size: the directory protocol (ownership, takeover, reaping, sidecars,
page-locking) is security-critical and must be reviewed as one unit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from lm_resiliency.checksum import crc32, tensor_crc32
from lm_resiliency.config import DEFAULT_REAP_OTHER_RUNS_AFTER_S
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import CLOEXEC as _CLOEXEC, NOFOLLOW as _NOFOLLOW, open_owned
from lm_resiliency.codec import Layout, StateSchemaError, check_structure
from lm_resiliency.files import (PRIVATE, Field, RecordRejected, RecordSchema, any_json, atomic_write, integer, nested,
                                 nullable, open_private_dir, parse_record, read_file_bytes, text)
from lm_resiliency.gemini.integrity import CRC_KEY, checksum_problem
from lm_resiliency.gemini.storage import process_alive, process_start_time, run_namespace, temp_scope

logger = logging.getLogger(__name__)

SHM_VERSION = 1
SLOT_NAMES = ("own_a", "own_b", "peer_a", "peer_b")
MAX_SLOTS = len(SLOT_NAMES)
OWNER_FILE = "owner.json"
_OBJECT = Field(types=(dict,))
_SEGMENT_SCHEMA = RecordSchema(what="slot segment description",
                               fields={"size": integer(0), "dev": integer(0), "ino": integer(0)})
# A slot's READY sidecar; its structure may describe a large state dict.
SIDECAR_SCHEMA = RecordSchema(
    what="shared-memory slot sidecar", identity=("version", SHM_VERSION), max_bytes=512 * 1024 * 1024,
    fields={"run_id": text(max_length=None), "topology": text(max_length=None), "holder_rank": integer(0),
            "slot": text(choices=SLOT_NAMES), "owner_rank": integer(0), "step": integer(0), "layout": _OBJECT,
            "structure": any_json(), "extra": _OBJECT, "crc32": nullable(integer(0, 2 ** 32 - 1)),
            "segment": nested(_SEGMENT_SCHEMA)})
OWNER_SCHEMA = RecordSchema(what="rank directory owner record", identity=("version", SHM_VERSION), max_bytes=4096,
                            fields={"scope": text(), "pid": integer(None), "start_time": nullable(integer(None))})
_TAKEOVER_LOCK_S = 5.0
NAMESPACE_RE = re.compile(r"gemini-[0-9a-f]{24}-[0-9a-f]{8}")
_RANK_DIR_RE = re.compile(r"rank-(?P<rank>\d{5})\.(?P<scope>[0-9a-f]+)")
_TEMP_RE = re.compile(r"\.(?P<final>.+)\.tmp-(?P<scope>[0-9a-f]+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)")

# Rank directories held by a live arena in this process (a same-process successor may adopt
# a directory only after its predecessor arena closed).
_held: set = set()
_held_lock = threading.Lock()


class SharedMemoryUnavailable(ResiliencyError, OSError):
    """Shared-memory slots cannot be used here; the manager falls back to heap slots."""


class SegmentRejected(RecordRejected):
    """A predecessor's slot exists but must not be used. The message says which and why."""


@dataclass(frozen=True)
class HostMemoryReport:
    """GEMINI host-slot memory of one rank (`InMemoryCheckpointManager.host_memory()`)."""

    mode: str                       # "shared" or "heap"
    directory: Optional[str]        # the rank's shared-memory directory, None for heap slots
    slot_bytes: Dict[str, int] = field(default_factory=dict)  # slot name -> bytes
    max_slots: int = MAX_SLOTS

    @property
    def total_bytes(self) -> int:
        return sum(self.slot_bytes.values())


@dataclass(frozen=True, eq=False)
class AdoptedSlot:
    """A predecessor's READY slot, validated and mapped into this process."""

    name: str
    buffer: torch.Tensor
    layout: Layout
    structure: Any
    step: int
    owner_rank: int
    extra: dict
    crc32: Optional[int]
    predecessor_pid: int


def default_shared_memory_dir() -> str:
    return f"/dev/shm/lm-resiliency-{os.geteuid()}"


def shared_namespace(run_id: str, topology: str, series: str) -> str:
    """Opaque name binding shared slots to one run id, topology and checkpoint series."""
    return shared_namespace_of(run_namespace(run_id, topology), series)


def shared_namespace_of(disk_namespace: str, series: str) -> str:
    """The shared-memory namespace of the node-local namespace `disk_namespace` under `series`."""
    digest = hashlib.sha256(os.path.abspath(series).encode("utf-8")).hexdigest()[:8]
    return f"{disk_namespace}-{digest}"


# ------------------------------------------------------------------------------- CUDA seam
# Like gemini/device.py: the only CUDA-specific code of this module. Mapped pages are
# page-locked with cudaHostRegister so GPU->host copies into them stay asynchronous.


def _register_host_memory(tensor: torch.Tensor) -> bool:
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 1))
    except Exception as exc:  # noqa: BLE001 - pinning is an optimization; copies stay correct
        logger.warning("GEMINI: cannot page-lock shared host slot (%s); GPU copies into it will "
                       "not overlap with compute", exc)
        return False
    if code != 0:
        logger.warning("GEMINI: cudaHostRegister failed with cudaError %d; GPU copies into the "
                       "shared host slot will not overlap with compute", code)
        return False
    return True


def _unregister_host_memory(tensor: torch.Tensor) -> None:
    try:
        torch.cuda.synchronize()  # no copy may still target these pages
        code = int(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
        if code != 0:
            logger.warning("GEMINI: cudaHostUnregister failed with cudaError %d", code)
    except Exception as exc:  # noqa: BLE001 - teardown continues
        logger.warning("GEMINI: cudaHostUnregister failed: %s", exc)


# ------------------------------------------------------------------------------ processes


# ---------------------------------------------------------------------------------- helpers


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _slot_crc(doc: dict, payload: torch.Tensor) -> int:
    """CRC-32 over the sidecar metadata and the payload. When the metadata carries the capture
    checksum (integrity.CRC_KEY in `extra`), the payload is covered by that record (checked by
    `verify`) and is not read a second time here."""
    canonical = json.dumps({k: v for k, v in doc.items() if k != "crc32"}, sort_keys=True,
                           allow_nan=False, separators=(",", ":")).encode("utf-8")
    crc = crc32(canonical)
    extra = doc.get("extra")
    if isinstance(extra, dict) and CRC_KEY in extra:
        return crc
    return tensor_crc32(payload, crc)


def _check_private(st: os.stat_result, what: str, path: str, uid: int, directory: bool) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise SegmentRejected(f"{path}: {what} is a symbolic link; refusing to follow it")
    if directory and not stat.S_ISDIR(st.st_mode):
        raise SegmentRejected(f"{path}: {what} is not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise SegmentRejected(f"{path}: {what} is not a regular file")
    if st.st_uid != uid:
        raise SegmentRejected(f"{path}: {what} is owned by uid {st.st_uid}, not by this process (uid {uid})")
    if not directory and stat.S_IMODE(st.st_mode) & 0o077:
        raise SegmentRejected(f"{path}: {what} has mode {stat.S_IMODE(st.st_mode):o}; expected 0600")


class _Mapping:
    """One mapped segment: the mmap (kept alive by the tensor) and whether it is page-locked."""

    __slots__ = ("tensor", "size", "dev", "ino", "pinned")

    def __init__(self, tensor: torch.Tensor, st: os.stat_result, pinned: bool) -> None:
        self.tensor = tensor
        self.size = st.st_size
        self.dev = st.st_dev
        self.ino = st.st_ino
        self.pinned = pinned

    def release(self) -> None:
        if self.pinned:
            _unregister_host_memory(self.tensor)
            self.pinned = False
        self.tensor = None


def _map_fd(fd: int, size: int) -> torch.Tensor:
    # No MAP_POPULATE: pre-mapping costs about what the page faults it saves cost (measured),
    # and an adopted slot that recovery does not select is then never touched at all.
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor keeps the mapping alive


# ------------------------------------------------------------------------------------ arena


class SharedSlotArena:
    """This rank's node-owned shared-memory slots for one run, topology and checkpoint series.

    Construction creates (or takes over from a dead predecessor) the rank directory and reaps
    directories of other runs whose owner of this scope is dead and which were last written at
    least `reap_other_runs_after_s` seconds ago; it raises `SharedMemoryUnavailable` when the
    directory cannot be used safely. `allocate` is a slot allocator (`(name, nbytes) -> tensor`);
    `retract`/`publish` implement `slots.SlotMirror`; `adopt()` returns the predecessor's READY
    slots; `close(keep=...)` removes the segments or leaves them for a restart.
    """

    def __init__(self, root: str, run_id: str, topology: str, rank: int, *, series: str,
                 verify_integrity: bool, pin_memory: bool, peer_owner: Optional[int],
                 reap_other_runs_after_s: float = DEFAULT_REAP_OTHER_RUNS_AFTER_S) -> None:
        self._uid = os.geteuid()
        self._reap_after_s = float(reap_other_runs_after_s)
        self._root = os.path.abspath(root)
        self._run_id = run_id
        self._topology = topology
        self._rank = rank
        self._verify = verify_integrity
        self._pin = pin_memory and torch.cuda.is_available()
        self._peer_owner = peer_owner
        self._scope = temp_scope()
        self._namespace = shared_namespace(run_id, topology, series)
        self._rank_name = f"rank-{rank:05d}.{self._scope}"
        self._dir = os.path.join(self._root, self._namespace, self._rank_name)
        self._maps: Dict[str, _Mapping] = {}
        self._heap: Dict[str, int] = {}
        self._docs: Dict[str, dict] = {}
        self._degraded = False
        self._lock = threading.RLock()
        self._predecessor: Optional[int] = None
        self._fd: Optional[int] = None
        self._closed = False
        fds: List[int] = []
        try:
            root_fd = self._open_root()
            fds.append(root_fd)
            self._reap(root_fd)
            ns_path = os.path.join(self._root, self._namespace)
            ns_fd = self._private_subdir(root_fd, self._namespace, ns_path)
            fds.append(ns_fd)
            self._reap_namespace(ns_fd, ns_path, temps_only=True)
            self._fd = self._claim_rank_dir(ns_fd)
        except SegmentRejected as exc:
            raise SharedMemoryUnavailable(errno.EPERM, str(exc)) from exc
        except SharedMemoryUnavailable:
            raise
        except OSError as exc:
            raise SharedMemoryUnavailable(exc.errno or errno.EIO,
                                          f"cannot set up GEMINI shared-memory slots: {exc}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        self._reap_temps(self._fd, self._dir)

    # ----------------------------------------------------------------- properties

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def predecessor_pid(self) -> Optional[int]:
        """PID of the dead process whose rank directory this arena took over, if any."""
        return self._predecessor

    def report(self) -> HostMemoryReport:
        with self._lock:
            sizes = {name: m.size for name, m in self._maps.items()}
            sizes.update(self._heap)
        return HostMemoryReport("shared", self._dir, sizes)

    def is_shared(self, name: str, buffer: Optional[torch.Tensor]) -> bool:
        with self._lock:
            mapping = self._maps.get(name)
            return mapping is not None and buffer is not None and mapping.tensor is buffer

    # ------------------------------------------------------------------ allocator

    def allocate(self, name: str, nbytes: int) -> torch.Tensor:
        """A shared segment of at least `nbytes` for slot `name`; a heap buffer (warning) if
        shared memory cannot be had."""
        if name not in SLOT_NAMES:
            raise ValueError(f"GEMINI shared slot name must be one of {SLOT_NAMES}, got {name!r}")
        with self._lock:
            self._check_open()
            self._drop(name)
            self._remove_files(name)  # its sidecar was retracted before; the old segment goes too
            if not self._degraded:
                try:
                    tensor = self._create_segment(name, max(int(nbytes), 1))
                    self._log_allocation(name, "shared memory")
                    return tensor
                except OSError as exc:
                    self._degraded = True
                    self._remove_files(name)
                    logger.warning(
                        "GEMINI: rank %d cannot allocate %d bytes of shared memory for slot %s in %s "
                        "(%s); using process heap memory for this and later slots, which does not "
                        "survive a worker crash. Free space in /dev/shm (or set "
                        "InMemoryCkptConfig.shared_memory_dir), or set host_memory='heap' to silence "
                        "this.", self._rank, nbytes, name, self._dir, exc.strerror or exc)
            from lm_resiliency.gemini.device import allocate_host_buffer

            tensor = allocate_host_buffer(nbytes, self._pin)
            self._heap[name] = tensor.numel()
            self._log_allocation(name, "heap memory")
            return tensor

    def _log_allocation(self, name: str, where: str) -> None:
        report = self.report()
        logger.info("GEMINI: rank %d slot %s: %d bytes of %s; rank total %d bytes in %d of %d slots (%s)",
                    self._rank, name, report.slot_bytes[name], where, report.total_bytes,
                    len(report.slot_bytes), MAX_SLOTS, self._dir)

    def _create_segment(self, name: str, size: int) -> torch.Tensor:
        seg = f"{name}.seg"
        fd = os.open(seg, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=self._fd)
        try:
            os.fchmod(fd, 0o600)
            try:
                # Reserve the pages now: a full tmpfs fails here, not with SIGBUS mid-copy.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            st = os.fstat(fd)
            tensor = _map_fd(fd, size)
        finally:
            os.close(fd)
        pinned = _register_host_memory(tensor) if self._pin else False
        self._maps[name] = _Mapping(tensor, st, pinned)
        return tensor

    # ---------------------------------------------------------------- publication

    def retract(self, name: str) -> None:
        """Un-READY `name` before its payload is overwritten (no-op for heap slots)."""
        with self._lock:
            if self._closed:
                return
            self._docs.pop(name, None)
            self._unlink(f"{name}.json")

    def publish(self, slot: Any, step: int, structure: Any, owner_rank: int, extra: Optional[dict]) -> None:
        """Make the completely written slot READY for a successor process. A failure only costs
        crash survival of this slot (warning), never the capture."""
        name = slot.name
        with self._lock:
            if self._closed or not self.is_shared(name, slot.buffer):
                return
            mapping = self._maps[name]
        doc = {
            "version": SHM_VERSION, "run_id": self._run_id, "topology": self._topology,
            "holder_rank": self._rank, "slot": name, "owner_rank": owner_rank, "step": step,
            "layout": slot.layout.to_json(), "structure": structure, "extra": dict(extra or {}),
            "crc32": None, "segment": {"size": mapping.size, "dev": mapping.dev, "ino": mapping.ino},
        }
        try:
            if self._verify:
                doc["crc32"] = _slot_crc(doc, slot.buffer[: slot.layout.total_bytes])
            data = _dumps(doc)
            with self._lock:
                if self._closed:
                    return
                self._write_atomic(f"{name}.json", data)
                self._docs[name] = doc
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("GEMINI: rank %d could not publish shared slot %s (step %d) in %s: %s; this "
                           "copy will not survive a worker crash", self._rank, name, step, self._dir, exc)

    def _write_atomic(self, final: str, data: bytes) -> None:
        # The temp name carries scope and pid, so a dead writer's leftover is reaped (_reap_temps).
        atomic_write(final, data, temp_name=f".{final}.tmp-{self._scope}-{os.getpid()}-{secrets.token_hex(6)}",
                     dir_fd=self._fd)

    # -------------------------------------------------------------------- adoption

    def adopt(self) -> List[AdoptedSlot]:
        """The predecessor's READY slots of this rank, validated and mapped (newest first).

        A segment without sidecar (being written when its writer died) and any rejected slot are
        removed; a rejected slot is logged with the reason and never used."""
        adopted = []
        with self._lock:
            self._check_open()
            for name in SLOT_NAMES:
                if name.startswith("peer") and self._peer_owner is None:
                    self._remove_files(name)
                    continue
                try:
                    slot = self._adopt_one(name)
                except SegmentRejected as exc:
                    logger.warning("GEMINI: rank %d refuses shared slot %s: %s", self._rank, name, exc)
                    self._drop(name)
                    self._remove_files(name)
                    continue
                except OSError as exc:
                    logger.warning("GEMINI: rank %d cannot map shared slot %s: %s", self._rank, name, exc)
                    self._drop(name)
                    self._remove_files(name)
                    continue
                if slot is not None:
                    adopted.append(slot)
        adopted.sort(key=lambda s: -s.step)
        if adopted:
            logger.info("GEMINI: rank %d adopted %d shared slot(s) from predecessor pid %s: %s (%d bytes)",
                        self._rank, len(adopted), self._predecessor,
                        ", ".join(f"{s.name}=step {s.step}" for s in adopted),
                        sum(s.buffer.numel() for s in adopted))
        return adopted

    def _adopt_one(self, name: str) -> Optional[AdoptedSlot]:
        sidecar_path = os.path.join(self._dir, f"{name}.json")
        seg_path = os.path.join(self._dir, f"{name}.seg")
        data = self._read_owned(f"{name}.json", "slot sidecar")
        if data is None:
            if self._exists(f"{name}.seg"):
                logger.info("GEMINI: rank %d discards shared slot %s: no READY sidecar (its writer died "
                            "while writing it)", self._rank, name)
                self._remove_files(name)
            return None
        doc = self._checked_sidecar(data, name, sidecar_path)
        layout = Layout.from_json(doc["layout"])
        fd = self._open_owned(f"{name}.seg", "slot segment", os.O_RDWR)
        if fd is None:
            raise SegmentRejected(f"{seg_path}: READY sidecar without a segment")
        try:
            st = os.fstat(fd)
            _check_private(st, "slot segment", seg_path, self._uid, directory=False)
            want = doc["segment"]
            if (st.st_dev, st.st_ino) != (want["dev"], want["ino"]):
                raise SegmentRejected(f"{seg_path}: segment was replaced after its sidecar was written "
                                      f"(inode {st.st_ino}, sidecar says {want['ino']})")
            if st.st_size != want["size"]:
                raise SegmentRejected(f"{seg_path}: segment has {st.st_size} bytes, its sidecar says "
                                      f"{want['size']} (truncated or resized)")
            if st.st_size < max(layout.total_bytes, 1):
                raise SegmentRejected(f"{seg_path}: segment of {st.st_size} bytes cannot hold layout of "
                                      f"{layout.total_bytes} bytes")
            tensor = _map_fd(fd, st.st_size)
        finally:
            os.close(fd)
        pinned = _register_host_memory(tensor) if self._pin else False
        self._maps[name] = _Mapping(tensor, st, pinned)
        self._docs[name] = doc
        return AdoptedSlot(name, tensor, layout, doc["structure"], doc["step"], doc["owner_rank"],
                           doc["extra"], doc["crc32"], self._predecessor or -1)

    def _checked_sidecar(self, data: bytes, name: str, path: str) -> dict:
        def bad(reason: str) -> SegmentRejected:
            return SegmentRejected(f"{path}: {reason}")

        doc = parse_sidecar(data, path)
        if doc["run_id"] != self._run_id:
            raise bad(f"wrong run id (sidecar {doc['run_id']!r}, expected {self._run_id!r})")
        if doc["topology"] != self._topology:
            raise bad(f"wrong topology (sidecar {doc['topology']!r}, expected {self._topology!r})")
        if doc["holder_rank"] != self._rank:
            raise bad(f"wrong holder rank (sidecar {doc['holder_rank']!r}, expected {self._rank})")
        if doc["slot"] != name:
            raise bad(f"wrong slot name (sidecar {doc['slot']!r}, expected {name!r})")
        expected_owner = self._rank if name.startswith("own") else self._peer_owner
        if doc["owner_rank"] != expected_owner:
            raise bad(f"wrong owner rank (sidecar {doc['owner_rank']!r}, expected {expected_owner})")
        if self._verify and doc["crc32"] is None:
            raise bad("written without integrity checksum (verify_integrity=False); with "
                      "verify_integrity=True only checksummed slots are eligible")
        return doc

    def verify(self, name: str) -> Optional[str]:
        """Recompute the CRC-32 of an adopted slot; the reason it is unusable, or None if intact."""
        with self._lock:
            doc = self._docs.get(name)
            mapping = self._maps.get(name)
        if doc is None or mapping is None or mapping.tensor is None:
            return f"slot {name} is not a published shared slot"
        if doc["crc32"] is None:
            return f"slot {name} has no integrity checksum"
        total = doc["layout"]["total_bytes"]
        actual = _slot_crc(doc, mapping.tensor[:total])
        if actual != doc["crc32"]:
            return (f"{os.path.join(self._dir, name + '.seg')}: CRC-32 mismatch (stored "
                    f"{doc['crc32']:#010x}, computed {actual:#010x}): shared memory bytes are corrupt")
        if CRC_KEY in doc["extra"]:
            problem = checksum_problem(doc["extra"], mapping.tensor[:total])
            if problem is not None:
                return f"{os.path.join(self._dir, name + '.seg')}: {problem}"
        return None

    def private_view(self, name: str, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy-on-write private mapping of shared slot `name` (zero-copy recovery), or None
        when `buffer` is not that slot's shared segment or it cannot be mapped.

        Reads come straight from the shared pages; the caller's writes stay private to the
        caller. Linux shows later writes to the file through pages the caller has not written,
        so the slot must be rewritten into a fresh segment (`SlotPair.lend`), never in place.
        """
        with self._lock:
            if self._closed or not self.is_shared(name, buffer):
                return None
            mapping = self._maps[name]
            try:
                fd = self._open_owned(f"{name}.seg", "slot segment", os.O_RDONLY)
            except (SegmentRejected, OSError) as exc:
                logger.warning("GEMINI: cannot map shared slot %s copy-on-write: %s", name, exc)
                return None
            if fd is None:
                return None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size) != (mapping.dev, mapping.ino, mapping.size):
                    logger.warning("GEMINI: shared slot %s changed on disk; copying it instead", name)
                    return None
                mm = mmap.mmap(fd, mapping.size, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                logger.warning("GEMINI: cannot map shared slot %s copy-on-write: %s", name, exc)
                return None
            finally:
                os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8)

    # ------------------------------------------------------------------- lifecycle

    def close(self, keep: bool) -> None:
        """Unmap everything. `keep=False` removes this rank's directory; `keep=True` leaves the
        READY slots for a successor process (a restart of the same run)."""
        with self._lock:
            if self._closed:
                return
            for name in list(self._maps):
                self._drop(name)
            removed_dir = self._dir
            if not keep and self._fd is not None:
                removed_dir = self._retire_dir()
                for name in SLOT_NAMES:
                    self._unlink(f"{name}.json")  # sidecars first: never READY without a segment
                for name in SLOT_NAMES:
                    self._unlink(f"{name}.seg")
                self._reap_temps(self._fd, self._dir, only_ours=True)
                self._unlink(OWNER_FILE)
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            with _held_lock:
                _held.discard(self._dir)
        if not keep:
            for path in (removed_dir, os.path.dirname(self._dir)):
                try:
                    os.rmdir(path)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                        logger.warning("GEMINI: cannot remove shared-memory directory %s: %s", path, exc)
                    break
            logger.info("GEMINI: rank %d removed its shared-memory slots (%s)", self._rank, self._dir)
        else:
            logger.info("GEMINI: rank %d keeps its shared-memory slots for a restart (%s)",
                        self._rank, self._dir)

    # ------------------------------------------------------------------- internals

    def _retire_dir(self) -> str:
        """Rename this rank's directory to a temporary name of this process before emptying it:
        another job's reaper then skips it (a temp of a live process) instead of finding a rank
        directory without an owner record while it is being removed. Returns the path to remove."""
        temp = os.path.join(os.path.dirname(self._dir),
                            f".{self._rank_name}.tmp-{self._scope}-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            os.rename(self._dir, temp)
        except OSError as exc:
            logger.debug("GEMINI: removing %s in place: %s", self._dir, exc)
            return self._dir
        return temp

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("GEMINI shared slot arena is closed")

    def _drop(self, name: str) -> None:
        mapping = self._maps.pop(name, None)
        if mapping is not None:
            mapping.release()
        self._heap.pop(name, None)

    def _open_root(self) -> int:
        if self._root == default_shared_memory_dir() and not os.path.isdir(os.path.dirname(self._root)):
            raise SharedMemoryUnavailable(errno.ENOENT, f"{os.path.dirname(self._root)} does not exist (no POSIX "
                                          "shared memory filesystem on this host)")
        return open_private_dir(self._root, "shared-memory directory", parents=True, error=SegmentRejected)

    def _private_subdir(self, parent_fd: int, name: str, path: str) -> int:
        return open_private_dir(name, "shared-memory directory", dir_fd=parent_fd, shown=path, error=SegmentRejected)

    def _owner_doc(self) -> bytes:
        return _dumps({"version": SHM_VERSION, "scope": self._scope, "pid": os.getpid(),
                       "start_time": process_start_time(os.getpid())})

    def _claim_rank_dir(self, ns_fd: int) -> int:
        """Create this rank's directory, or take it over from a dead owner of this scope."""
        with _held_lock:
            if self._dir in _held:
                raise SharedMemoryUnavailable(errno.EBUSY, f"{self._dir} is used by another GEMINI manager "
                                              "of this process")
            try:
                os.lstat(os.path.join(self._root, self._namespace, self._rank_name))
                exists = True
            except FileNotFoundError:
                exists = False
            if not exists:
                exists = not self._create_rank_dir(ns_fd)
            fd = self._private_subdir(ns_fd, self._rank_name, self._dir)
            try:
                if exists:
                    with _exclusive(fd, self._dir):
                        self._take_over(fd)
                _held.add(self._dir)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def _create_rank_dir(self, ns_fd: int) -> bool:
        """Publish a new rank directory (owner record inside) by rename; False if one appeared
        meanwhile (then it must be taken over like any existing one)."""
        temp = f".{self._rank_name}.tmp-{self._scope}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = self._private_subdir(ns_fd, temp, os.path.join(self._root, self._namespace, temp))
        try:
            try:
                atomic_write(OWNER_FILE, self._owner_doc(), dir_fd=fd)
            finally:
                os.close(fd)
            os.rename(temp, self._rank_name, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
        except OSError as exc:
            remove_tree(ns_fd, temp)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return False
        return True

    def _take_over(self, fd: int) -> None:
        owner = read_owner(fd, self._dir, self._uid)
        if owner is None:
            raise SegmentRejected(f"{self._dir}: rank directory has no valid {OWNER_FILE}; refusing to use it")
        if owner["scope"] != self._scope:
            raise SegmentRejected(f"{self._dir}: owner record names another boot or PID namespace "
                                  f"({owner['scope']}); refusing to use it")
        if owner["pid"] == os.getpid() and owner["start_time"] == process_start_time(os.getpid()):
            self._predecessor = os.getpid()  # a closed manager of this process kept its slots
        elif process_alive(owner["pid"], owner["start_time"]):
            raise SharedMemoryUnavailable(errno.EBUSY, f"{self._dir} is in use by live process "
                                          f"{owner['pid']} (same run, topology and rank)")
        else:
            self._predecessor = owner["pid"]
        prev_fd, self._fd = self._fd, fd
        try:
            self._write_atomic(OWNER_FILE, self._owner_doc())
        finally:
            self._fd = prev_fd

    def _reap(self, root_fd: int) -> None:
        """Remove rank directories of other runs (namespaces) whose owner, of this scope, is dead
        and which nobody wrote for `reap_other_runs_after_s`. Directories of another scope, of a
        live owner, younger ones (a relaunch of that run adopts them) or that cannot be attributed
        are kept."""
        for entry in os.scandir(root_fd):
            if entry.name == self._namespace or not NAMESPACE_RE.fullmatch(entry.name):
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            ns_path = os.path.join(self._root, entry.name)
            try:
                ns_fd = self._private_subdir(root_fd, entry.name, ns_path)
            except (SegmentRejected, OSError) as exc:
                logger.warning("GEMINI: not reaping %s: %s", ns_path, exc)
                continue
            try:
                self._reap_namespace(ns_fd, ns_path)
            finally:
                os.close(ns_fd)
            try:
                os.rmdir(entry.name, dir_fd=root_fd)
            except OSError:
                pass  # still holds live or foreign directories

    def _reap_namespace(self, ns_fd: int, ns_path: str, temps_only: bool = False) -> None:
        """Directories left half-created by dead processes and, unless `temps_only` (our own
        namespace: its rank directories are adopted by their rank's next process), the rank
        directories `judge_rank_dirs` finds stale."""
        remove_dead_temp_dirs(ns_fd, self._scope)
        if temps_only:
            return
        for verdict in judge_rank_dirs(ns_fd, ns_path, self._uid, self._scope, self._reap_after_s):
            if verdict.kind == "unattributable":
                logger.warning("GEMINI: not reaping %s: %s", verdict.path, verdict.reason)
            elif verdict.kind == "young":
                logger.info("GEMINI: keeping shared-memory slots %s of another run (%s): its relaunch can "
                            "still recover from them; they are reaped after %g s "
                            "(InMemoryCkptConfig.reap_other_runs_after_s) or by python -m lm_resiliency.cleanup",
                            verdict.path, verdict.reason, self._reap_after_s)
            elif verdict.kind == "stale":
                with _held_lock:
                    if verdict.path in _held:
                        continue
                freed = remove_tree(ns_fd, verdict.name)
                logger.info("GEMINI: reaped stale shared-memory slots %s (%s; %d bytes)", verdict.path,
                            verdict.reason, freed)

    def _reap_temps(self, dir_fd: int, path: str, only_ours: bool = False) -> None:
        for entry in os.scandir(dir_fd):
            match = _TEMP_RE.fullmatch(entry.name)
            if not match or match.group("scope") != self._scope or entry.is_dir(follow_symlinks=False):
                continue
            pid = int(match.group("pid"))
            if (pid == os.getpid()) if only_ours else not process_alive(pid):
                try:
                    os.unlink(entry.name, dir_fd=dir_fd)
                except OSError:
                    pass

    def _read_owned(self, name: str, what: str) -> Optional[bytes]:
        return read_file_bytes(name, what, max_bytes=SIDECAR_SCHEMA.max_bytes, trust=PRIVATE, dir_fd=self._fd,
                               shown=os.path.join(self._dir, name), uid=self._uid, error=SegmentRejected)

    def _open_owned(self, name: str, what: str, mode: int) -> Optional[int]:
        """Open a private regular file of ours in the rank directory without following symlinks."""
        return open_owned(name, what, SegmentRejected, flags=mode, dir_fd=self._fd,
                          shown=os.path.join(self._dir, name), uid=self._uid, forbidden_mode=0o077)

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _remove_files(self, name: str) -> None:
        self._unlink(f"{name}.json")
        self._unlink(f"{name}.seg")

    def _unlink(self, name: str) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError:
            pass


def parse_sidecar(data: bytes, path: str) -> dict:
    """A slot sidecar's document, schema-checked (SIDECAR_SCHEMA, its layout, the structure against
    the layout) but not yet bound to a run, topology or rank: `SharedSlotArena` checks those;
    `lm-resiliency inspect` reports them."""
    doc = parse_record(data, SIDECAR_SCHEMA, path, error=SegmentRejected)
    try:
        layout = Layout.from_json(doc["layout"])
    except StateSchemaError as exc:
        raise SegmentRejected(f"{path}: bad layout: {exc}") from exc
    try:
        check_structure(doc["structure"], layout)
    except StateSchemaError as exc:
        raise SegmentRejected(f"{path}: its structure does not match its layout of {len(layout.specs)} tensors: "
                              f"{exc}") from exc
    return doc


def read_sidecar(dir_fd: int, name: str, path: str, uid: int) -> Optional[dict]:
    """The sidecar `name` of the rank directory open as `dir_fd`, schema-checked (`parse_sidecar`),
    or None when there is none; SegmentRejected for one that must not be used."""
    shown = os.path.join(path, name)
    data = read_file_bytes(name, "slot sidecar", max_bytes=SIDECAR_SCHEMA.max_bytes, trust=PRIVATE, dir_fd=dir_fd,
                           shown=shown, uid=uid, error=SegmentRejected)
    return None if data is None else parse_sidecar(data, shown)


@contextlib.contextmanager
def _exclusive(dir_fd: int, path: str) -> Iterator[None]:
    """Hold an exclusive lock on a rank directory while its owner record is checked and replaced:
    two processes of a host that both find its owner dead (a successor of that rank, another
    rank claiming what a moved rank left) never both take it over."""
    deadline = time.monotonic() + _TAKEOVER_LOCK_S
    while True:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SharedMemoryUnavailable(errno.EBUSY, f"{path} is being taken over by another process") from None
            time.sleep(0.01)
    try:
        yield
    finally:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)


def read_owner(dir_fd: int, path: str, uid: int) -> Optional[dict]:
    """The owner record of the rank directory open as `dir_fd`, or None if missing or invalid."""
    where = os.path.join(path, OWNER_FILE)
    try:
        data = read_file_bytes(OWNER_FILE, "owner record", max_bytes=OWNER_SCHEMA.max_bytes, trust=PRIVATE,
                               dir_fd=dir_fd, shown=where, uid=uid, error=SegmentRejected)
        return None if data is None else parse_record(data, OWNER_SCHEMA, where, error=SegmentRejected)
    except (SegmentRejected, OSError):
        return None


@dataclass(frozen=True)
class RankDirVerdict:
    """What the reaping policy says about one rank directory of a namespace.

    kind: "stale" (owner of this scope dead, last written at least the age bound ago: may be
    removed), "young" (owner dead, written more recently: kept for a relaunch), "live" (owner
    runs), "foreign" (another boot or PID namespace: a local PID check says nothing) or
    "unattributable" (no readable owner record, or not a private directory of ours)."""

    name: str
    path: str
    kind: str
    reason: str


def judge_rank_dirs(ns_fd: int, ns_path: str, uid: int, scope: str, min_age_s: float) -> List[RankDirVerdict]:
    """The reaping policy for every rank directory in one namespace directory (nothing is removed
    here). Shared by a starting arena and `python -m lm_resiliency.cleanup`."""
    verdicts = []
    for entry in os.scandir(ns_fd):
        match = _RANK_DIR_RE.fullmatch(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        path = os.path.join(ns_path, entry.name)
        if match.group("scope") != scope:
            verdicts.append(RankDirVerdict(entry.name, path, "foreign", "owned in another boot or PID namespace"))
            continue
        try:
            fd = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=ns_fd)
        except OSError as exc:
            verdicts.append(RankDirVerdict(entry.name, path, "unattributable", f"cannot open it: {exc}"))
            continue
        try:
            _check_private(os.fstat(fd), "shared-memory directory", path, uid, directory=True)
            owner = read_owner(fd, path, uid)
            age = time.time() - last_written(fd)
        except (SegmentRejected, OSError) as exc:
            verdicts.append(RankDirVerdict(entry.name, path, "unattributable", str(exc)))
            continue
        finally:
            os.close(fd)
        if owner is None or owner["scope"] != scope:
            verdicts.append(RankDirVerdict(entry.name, path, "unattributable", f"no valid {OWNER_FILE}"))
        elif process_alive(owner["pid"], owner["start_time"]):
            verdicts.append(RankDirVerdict(entry.name, path, "live", f"live process {owner['pid']}"))
        else:
            kind = "stale" if age >= min_age_s else "young"
            verdicts.append(RankDirVerdict(entry.name, path, kind, f"dead process {owner['pid']}, last written "
                                           f"{age:.0f} s ago"))
    return verdicts


def remove_dead_temp_dirs(ns_fd: int, scope: str, dry_run: bool = False) -> List[str]:
    """Remove directories half-created or half-removed by dead processes of this scope (never
    usable state); returns their names (with `dry_run`, removes nothing)."""
    removed = []
    for entry in os.scandir(ns_fd):
        temp = _TEMP_RE.fullmatch(entry.name)
        if (temp and entry.is_dir(follow_symlinks=False) and temp.group("scope") == scope
                and not process_alive(int(temp.group("pid")))):
            if not dry_run:
                remove_tree(ns_fd, entry.name)
            removed.append(entry.name)
    return removed


def last_written(dir_fd: int) -> float:
    """Newest modification time of a directory and the files in it (seconds since the epoch):
    every slot publication renames a sidecar into the directory."""
    newest = os.fstat(dir_fd).st_mtime
    for entry in os.scandir(dir_fd):
        try:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
    return newest


def remove_tree(parent_fd: int, name: str) -> int:
    """Remove directory `name` (one level of files, never following links); bytes freed."""
    freed = 0
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return 0
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                continue
            try:
                freed += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.name, dir_fd=fd)
            except OSError as exc:
                logger.warning("GEMINI: could not remove %s: %s", entry.name, exc)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError as exc:
        logger.warning("GEMINI: could not remove directory %s: %s", name, exc)
    return freed


def open_arena(root: Optional[str], run_id: str, topology: str, rank: int, *, series: str,
               verify_integrity: bool, pin_memory: bool, peer_owner: Optional[int],
               reap_other_runs_after_s: float) -> Tuple[Optional[SharedSlotArena], Optional[str]]:
    """The arena, or (None, reason) when shared memory cannot be used (the caller warns)."""
    try:
        arena = SharedSlotArena(root or default_shared_memory_dir(), run_id, topology, rank, series=series,
                                verify_integrity=verify_integrity, pin_memory=pin_memory,
                                peer_owner=peer_owner, reap_other_runs_after_s=reap_other_runs_after_s)
    except SharedMemoryUnavailable as exc:
        return None, str(exc.strerror or exc)
    return arena, None


__all__ = [
    "AdoptedSlot", "HostMemoryReport", "MAX_SLOTS", "NAMESPACE_RE", "RankDirVerdict", "SLOT_NAMES", "SegmentRejected",
    "SharedMemoryUnavailable", "SharedSlotArena", "default_shared_memory_dir", "judge_rank_dirs", "last_written",
    "open_arena", "parse_sidecar", "read_owner", "read_sidecar",
    "remove_dead_temp_dirs", "remove_tree", "shared_namespace", "shared_namespace_of",
]
