"""SCOUT checkpoint certification: which captured step a restart after SDC may trust.

Checkpoint states
-----------------
- *latest*: a step GEMINI captured after an accepted SCOUT check. Usable after a straggler or a
  clean hang sweep, never after SDC.
- ``CANDIDATE``: (dynamic catalogs only) the boundary at the end of a complete accepted recipe
  cycle. It stays excluded from conservative (SDC) recovery.
- ``RECOVERY_VERIFIED``: dense catalog (K=1): every accepted boundary, at once. Dynamic catalog
  (K>1): the previous candidate, once the *following* complete cycle was accepted too, so
  verification covers two consecutive K-recipe cycles.
- ``QUARANTINED``: a durable candidate rejected by SDC (or left uncertified by an inconclusive or
  incomplete cycle). Never loaded.

Rules, per boundary (`CertificationLedger.boundary`, collective over the checkpoint group)
------------------------------------------------------------------------------------------
All ranks first exchange their local verdicts and cycle flags (JSON, no pickle) so that checkpoint
acceptance is job-wide even though SCOUT comparison groups are topology-specific:

- every rank "clean" or "straggler": accepted; GEMINI may capture this step;
- "sdc" on any rank: the capture is vetoed everywhere, the current candidate is rejected
  (quarantined), the preceding RECOVERY_VERIFIED generation is kept, ``sdc_detected_step`` is
  recorded and verified recovery is required. Until `resume_from` (or `load_verified_durable`)
  says training state was restored from verified state, no later boundary captures or certifies
  anything: SDC folded into all replicas by a gradient all-reduce is no longer visible to replay,
  so post-SDC state must never be certified;
- "inconclusive" or "incomplete" on any rank (and no SDC): no capture, and no certification for
  the cycle it belongs to; at the end of that cycle a pending candidate is retired (quarantined,
  not marked SDC) and the two-cycle protocol restarts.
- non-finite state (NaN/Inf in parameters or optimizer state, ``finite=False``) on any rank is
  treated the same way: a state that replay cannot tell from healthy (the NaN reached every
  replica through the gradient all-reduce, so peers agree) is never captured or certified.

A cycle counts as complete only if every rank flags ``cycle_complete`` at the same boundary and
the ledger saw exactly K boundaries since the previous cycle end (a cycle joined midway after a
restart never counts). Boundary steps must increase; a step at or below the previous boundary
means training rolled back: the candidate and any verified entry at or after that step (which the
new timeline will overwrite) are dropped.

Persistence
-----------
Every change is written to the per-rank status sidecar (`status_store.write_status`, GEMINI's
`NodeLocalStore`) under the key ``"trust"``, keeping any other keys of the sidecar; a new ledger
on the same storage loads it, so a restart after SDC still knows the verified step and cannot
pick a newer candidate. With a group, construction is collective: ranks reconcile what they
loaded conservatively (common verified steps only, a candidate only if all agree).

Durable checkpoints
-------------------
With a `DurableCheckpointConfig`, the framework's own checkpoint store follows the same states
through the adapter callbacks and JSON manifests in ``manifest_dir`` (one per checkpoint id plus
``latest_verified.json``, each published by same-directory temp file, fsync, atomic rename and
directory fsync; directory 0700, files 0600). **Only rank 0 of the group** calls
``save_candidate``, ``commit_candidate`` and ``quarantine_candidate`` and writes manifests; the
framework callback is assumed to coordinate its own ranks (for example by saving from rank 0, or
by signalling the other ranks itself). Rank 0's outcome is then shared with every rank, and a
callback failure raises `DurableCheckpointError` on every rank. ``load_checkpoint`` is called on
every rank by `load_verified_durable`, so ``manifest_dir`` must be readable by every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Tuple, runtime_checkable

import torch.distributed as dist

from lm_resiliency._values import is_int as _is_int
from lm_resiliency.config import ConfigError
from lm_resiliency.files import atomic_write, fsync_dir, loads_strict_json
from lm_resiliency.scout.reports import ReplayResult
from lm_resiliency.wire import all_gather_json

logger = logging.getLogger(__name__)

CANDIDATE = "CANDIDATE"
RECOVERY_VERIFIED = "RECOVERY_VERIFIED"
QUARANTINED = "QUARANTINED"
MANIFEST_STATES = (CANDIDATE, RECOVERY_VERIFIED, QUARANTINED)

VERDICTS = ("clean", "straggler", "sdc", "inconclusive", "incomplete", "error")
_ACCEPTED = ("clean", "straggler")
# "error": a SCOUT check failed for an internal reason. No evidence either way: the step is
# captured, but the cycle cannot certify it (it stays plain latest state, never RECOVERY_VERIFIED).
_CAPTURED_UNCERTIFIED = ("error",)
_PRECEDENCE = ("sdc", "inconclusive", "incomplete", "error", "straggler", "clean")

TRUST_SCHEMA_VERSION = 1
MANIFEST_SCHEMA_VERSION = 1
VERIFIED_HISTORY_LIMIT = 8
LATEST_VERIFIED_FILE = "latest_verified.json"

_TRUST_KEYS = frozenset({"schema_version", "catalog_size", "candidate_step", "candidate_checkpoint_id",
                         "recovery_verified_step", "verified_history", "sdc_detected_step", "sdc_pending",
                         "last_boundary_step"})
_MANIFEST_KEYS = frozenset({"schema_version", "checkpoint_id", "step", "state", "environment_id",
                            "updated_at", "reason"})
_MANIFEST_RE = re.compile(r"checkpoint-[0-9a-f]{40}\.json")
_ADAPTER_METHODS = ("save_candidate", "load_checkpoint", "commit_candidate", "quarantine_candidate")


class CertificationError(RuntimeError):
    """Certification state is unusable or the ranks do not agree; the message says why."""


class ManifestRejected(CertificationError):
    """A durable manifest is malformed, foreign (environment id), unsafe, or inconsistent."""


class DurableCheckpointError(CertificationError):
    """A durable adapter callback failed on rank 0. Raised on every rank after the trust change
    that did succeed was persisted; `decision` is the boundary's decision (its capture permission
    is still valid: it depends only on the SCOUT verdicts)."""

    def __init__(self, message: str, decision: "BoundaryDecision") -> None:
        super().__init__(message)
        self.decision = decision


def _is_step(value: object) -> bool:
    return _is_int(value) and value >= 0


# ---------------------------------------------------------------------------- durable adapter


@runtime_checkable
class DurableCheckpointAdapter(Protocol):
    """What certification needs from the framework's own checkpoint store (see
    `CallbackDurableCheckpointAdapter` for the contract of each method)."""

    def save_candidate(self, step: int) -> str: ...
    def load_checkpoint(self, checkpoint_id: str, step: int) -> None: ...
    def commit_candidate(self, checkpoint_id: str, step: int) -> None: ...
    def quarantine_candidate(self, checkpoint_id: str, step: int, reason: str) -> None: ...


@dataclass(frozen=True)
class CallbackDurableCheckpointAdapter:
    """A durable-checkpoint adapter built from four plain callables.

    Contract (rank 0 of the checkpoint group calls the first, third and fourth; every rank calls
    `load_checkpoint_fn`):

    - ``save_candidate_fn(step) -> str``: write the framework checkpoint of the training state
      at optimizer step `step` (the state at the SCOUT boundary, before the next forward) and
      return its checkpoint id: a non-empty string, unique for every save (never the id of a
      RECOVERY_VERIFIED checkpoint; reusing a candidate's or quarantined id is allowed). Return
      only once the bytes are durable. It runs on rank 0 only: if the framework's save is
      collective, the callback must coordinate the other ranks itself.
    - ``load_checkpoint_fn(checkpoint_id, step)``: restore the training state from that
      checkpoint, on the calling rank. Called only with a RECOVERY_VERIFIED checkpoint.
    - ``commit_candidate_fn(checkpoint_id, step)``: the candidate is now RECOVERY_VERIFIED;
      make it permanent (for example: protect it from retention). Idempotent.
    - ``quarantine_candidate_fn(checkpoint_id, step, reason)``: the candidate must never be used
      for recovery (`reason` says why: detected SDC, or an uncertified cycle); the framework may
      delete or move it. Idempotent.

    Any exception fails the boundary on every rank with `DurableCheckpointError`.
    """

    save_candidate_fn: Any
    load_checkpoint_fn: Any
    commit_candidate_fn: Any
    quarantine_candidate_fn: Any

    def __post_init__(self) -> None:
        for name in ("save_candidate_fn", "load_checkpoint_fn", "commit_candidate_fn", "quarantine_candidate_fn"):
            value = getattr(self, name)
            if not callable(value):
                raise ConfigError(f"CallbackDurableCheckpointAdapter.{name}: must be callable, got "
                                  f"{type(value).__name__} {value!r}")

    def save_candidate(self, step: int) -> str:
        """Save the candidate at `step`; returns its checkpoint id."""
        return self.save_candidate_fn(step)

    def load_checkpoint(self, checkpoint_id: str, step: int) -> None:
        """Restore the RECOVERY_VERIFIED checkpoint `checkpoint_id` (taken at `step`)."""
        self.load_checkpoint_fn(checkpoint_id, step)

    def commit_candidate(self, checkpoint_id: str, step: int) -> None:
        """Mark the candidate RECOVERY_VERIFIED in the framework store."""
        self.commit_candidate_fn(checkpoint_id, step)

    def quarantine_candidate(self, checkpoint_id: str, step: int, reason: str) -> None:
        """Exclude the candidate from recovery for `reason`."""
        self.quarantine_candidate_fn(checkpoint_id, step, reason)


@dataclass(frozen=True)
class DurableCheckpointConfig:
    """Connects SCOUT certification to framework-owned durable checkpoints.

    manifest_dir: where certification manifests live (created 0700). It needs durability
        equivalent to the framework checkpoint store and must be readable by every rank.
    environment_id: identifies the job environment; manifests written for another one are
        refused when read.
    adapter: the framework callbacks (`CallbackDurableCheckpointAdapter` or any object with
        ``save_candidate``, ``load_checkpoint``, ``commit_candidate``, ``quarantine_candidate``).
    """

    manifest_dir: str
    environment_id: str
    adapter: Any

    def __post_init__(self) -> None:
        directory = self.manifest_dir
        if isinstance(directory, os.PathLike):
            directory = os.fspath(directory)
        if not isinstance(directory, str) or not directory.strip():
            raise ConfigError(f"DurableCheckpointConfig.manifest_dir: must be a non-empty path string, got "
                              f"{self.manifest_dir!r}")
        object.__setattr__(self, "manifest_dir", directory)
        if not isinstance(self.environment_id, str) or not self.environment_id.strip():
            raise ConfigError(f"DurableCheckpointConfig.environment_id: must be a non-empty string, got "
                              f"{self.environment_id!r}")
        missing = [name for name in _ADAPTER_METHODS if not callable(getattr(self.adapter, name, None))]
        if missing:
            raise ConfigError(f"DurableCheckpointConfig.adapter: must provide callable "
                              f"{', '.join(_ADAPTER_METHODS)}; {type(self.adapter).__name__} lacks "
                              f"{', '.join(missing)}")


def verdict_of(result: Optional[ReplayResult]) -> str:
    """The local verdict `CertificationLedger.boundary` expects for one SCOUT result on this rank
    (None: the check did not produce a result, "incomplete")."""
    if result is None:
        return "incomplete"
    if result.sdc:
        return "sdc"
    if result.inconclusive:
        return "inconclusive"
    if result.errors:
        return "error"
    if any(s.confirmed for s in result.stragglers):
        return "straggler"
    return "clean"


# ---------------------------------------------------------------------------- boundary decision


@dataclass(frozen=True)
class BoundaryDecision:
    """The job-wide outcome of one SCOUT boundary (identical on every rank of the group).

    step: the boundary's optimizer step.
    verdict: the job-wide verdict ("sdc" > "inconclusive" > "incomplete" > "error" > "straggler" > "clean"; "error" is captured uncertified).
    capture: whether GEMINI may capture this step.
    cycle_complete: every rank finished the scheduled recipe cycle at this boundary (all K
        recipes seen, no incomplete check).
    state: trust of this step's checkpoint: "RECOVERY_VERIFIED" (dense), "CANDIDATE" (dynamic)
        or None (plain latest, or not captured).
    verified_step: the step that became RECOVERY_VERIFIED at this boundary, if any.
    candidate_step: the ledger's candidate after this boundary (this step or an older one).
    rejected_step: the candidate rejected (quarantined) at this boundary, if any.
    sdc_detected: some rank reported SDC at this boundary.
    requires_verified_recovery: SDC was detected and training has not yet been restored from a
        RECOVERY_VERIFIED checkpoint.
    reporting_ranks: group ranks whose local verdict was not accepted (sdc, inconclusive or
        incomplete).
    nonfinite_ranks: group ranks whose parameters or optimizer state held NaN or Inf.
    checkpoint_id: the durable checkpoint id saved for this step, if any.
    reason: a sentence for logs and reports.
    """

    step: int
    verdict: str
    capture: bool
    cycle_complete: bool
    state: Optional[str]
    verified_step: Optional[int]
    candidate_step: Optional[int]
    rejected_step: Optional[int]
    sdc_detected: bool
    requires_verified_recovery: bool
    reporting_ranks: Tuple[int, ...]
    checkpoint_id: Optional[str]
    reason: str
    nonfinite_ranks: Tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {
            "step": self.step, "verdict": self.verdict, "capture": self.capture,
            "cycle_complete": self.cycle_complete, "state": self.state, "verified_step": self.verified_step,
            "candidate_step": self.candidate_step, "rejected_step": self.rejected_step,
            "sdc_detected": self.sdc_detected, "requires_verified_recovery": self.requires_verified_recovery,
            "reporting_ranks": list(self.reporting_ranks), "checkpoint_id": self.checkpoint_id,
            "reason": self.reason, "nonfinite_ranks": list(self.nonfinite_ranks),
        }


# ---------------------------------------------------------------------------- manifests


def manifest_name(checkpoint_id: str) -> str:
    """The manifest file name of a checkpoint id (a hash: ids may contain any character)."""
    return "checkpoint-" + hashlib.sha256(checkpoint_id.encode("utf-8")).hexdigest()[:40] + ".json"


class _ManifestStore:
    """JSON manifests of durable checkpoints in one owner-only directory."""

    def __init__(self, directory: str, environment_id: str) -> None:
        self.directory = os.path.abspath(directory)
        self.environment_id = environment_id
        self._uid = os.geteuid()

    # ------------------------------------------------------------ directory

    def ensure_directory(self) -> None:
        """Create the directory 0700 (writer side) and check it is ours and not a link."""
        os.makedirs(os.path.dirname(self.directory), exist_ok=True)
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            pass
        self._check_directory(writer=True)

    def _check_directory(self, writer: bool) -> bool:
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise ManifestRejected(f"{self.directory}: manifest directory is a symbolic link; refusing to follow it")
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestRejected(f"{self.directory}: manifest directory is not a directory")
        if st.st_uid != self._uid:
            raise ManifestRejected(f"{self.directory}: manifest directory is owned by uid {st.st_uid}, not by "
                                   f"this process (uid {self._uid}); refusing to trust it")
        mode = stat.S_IMODE(st.st_mode)
        if writer and mode != 0o700:
            os.chmod(self.directory, 0o700)
        elif not writer and mode & 0o022:
            raise ManifestRejected(f"{self.directory}: manifest directory is writable by group or others "
                                   f"(mode {mode:o}); refusing to trust it")
        return True

    # ------------------------------------------------------------ write

    def _publish(self, name: str, doc: dict) -> None:
        data = json.dumps(doc, sort_keys=True, allow_nan=False, indent=1).encode("utf-8") + b"\n"
        atomic_write(os.path.join(self.directory, name), data)

    def write(self, checkpoint_id: str, step: int, state: str, reason: str = "") -> dict:
        """Publish the manifest of `checkpoint_id`; a RECOVERY_VERIFIED one also becomes the
        ``latest_verified.json`` pointer (after its own manifest)."""
        doc = {"schema_version": MANIFEST_SCHEMA_VERSION, "checkpoint_id": checkpoint_id, "step": step,
               "state": state, "environment_id": self.environment_id, "updated_at": time.time(),
               "reason": reason}
        self._publish(manifest_name(checkpoint_id), doc)
        if state == RECOVERY_VERIFIED:
            self._publish(LATEST_VERIFIED_FILE, doc)
        logger.info("durable checkpoint %r (step %d) is %s%s", checkpoint_id, step, state,
                    f": {reason}" if reason else "")
        return doc

    def refresh_pointer(self) -> None:
        """Point ``latest_verified.json`` at the newest RECOVERY_VERIFIED manifest (or remove it)."""
        verified = [d for d in self.scan() if d["state"] == RECOVERY_VERIFIED]
        path = os.path.join(self.directory, LATEST_VERIFIED_FILE)
        if verified:
            self._publish(LATEST_VERIFIED_FILE, max(verified, key=lambda d: (d["step"], d["updated_at"])))
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            fsync_dir(self.directory)

    # ------------------------------------------------------------ read

    def read(self, name: str) -> Optional[dict]:
        """One validated manifest, or None if the file does not exist."""
        path = os.path.join(self.directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise ManifestRejected(f"{path}: manifest is a symbolic link; refusing to follow it")
        try:
            # O_NONBLOCK: a FIFO named like a manifest must be refused below, not block this open.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ManifestRejected(f"{path}: cannot open manifest: {exc}") from exc
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ManifestRejected(f"{path}: manifest is not a regular file")
            if st.st_uid != self._uid:
                raise ManifestRejected(f"{path}: manifest is owned by uid {st.st_uid}, not by this process "
                                       f"(uid {self._uid}); refusing to trust it")
            if stat.S_IMODE(st.st_mode) & 0o022:
                raise ManifestRejected(f"{path}: manifest is writable by group or others "
                                       f"(mode {stat.S_IMODE(st.st_mode):o}); refusing to trust it")
            data = f.read()
        try:
            doc = loads_strict_json(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestRejected(f"{path}: manifest is not valid strict JSON ({exc}); refusing to trust it") from exc
        self._validate(doc, path, name)
        return doc

    def _validate(self, doc: Any, path: str, name: str) -> None:
        def bad(reason: str) -> ManifestRejected:
            return ManifestRejected(f"{path}: {reason}; refusing to trust it")

        if not isinstance(doc, dict) or set(doc) != _MANIFEST_KEYS:
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise bad(f"manifest keys {got} are not exactly {sorted(_MANIFEST_KEYS)}")
        if not _is_int(doc["schema_version"]) or doc["schema_version"] != MANIFEST_SCHEMA_VERSION:
            raise bad(f"manifest schema_version {doc['schema_version']!r} is not {MANIFEST_SCHEMA_VERSION}")
        if not isinstance(doc["checkpoint_id"], str) or not doc["checkpoint_id"]:
            raise bad(f"checkpoint_id {doc['checkpoint_id']!r} is not a non-empty string")
        if not _is_step(doc["step"]):
            raise bad(f"step {doc['step']!r} is not a non-negative integer")
        if doc["state"] not in MANIFEST_STATES:
            raise bad(f"state {doc['state']!r} is not one of {', '.join(MANIFEST_STATES)}")
        if not isinstance(doc["environment_id"], str):
            raise bad("environment_id is not a string")
        updated = doc["updated_at"]
        if isinstance(updated, bool) or not isinstance(updated, (int, float)) or not math.isfinite(updated):
            raise bad(f"updated_at {updated!r} is not a finite number")
        if not isinstance(doc["reason"], str):
            raise bad("reason is not a string")
        if doc["environment_id"] != self.environment_id:
            raise bad(f"written for environment {doc['environment_id']!r}, but this job's environment_id is "
                      f"{self.environment_id!r}")
        if name == LATEST_VERIFIED_FILE:
            if doc["state"] != RECOVERY_VERIFIED:
                raise bad(f"the latest-verified pointer has state {doc['state']!r}")
        elif name != manifest_name(doc["checkpoint_id"]):
            raise bad(f"file name does not match checkpoint_id {doc['checkpoint_id']!r} "
                      f"(expected {manifest_name(doc['checkpoint_id'])})")

    def scan(self) -> List[dict]:
        """Every checkpoint manifest (pointer excluded), validated; [] if the directory is missing."""
        if not self._check_directory(writer=False):
            return []
        docs = []
        for name in sorted(os.listdir(self.directory)):
            if _MANIFEST_RE.fullmatch(name):
                doc = self.read(name)
                if doc is not None:
                    docs.append(doc)
        return docs

    def newest_verified(self) -> dict:
        """The newest RECOVERY_VERIFIED manifest; never a candidate or quarantined one."""
        if not self._check_directory(writer=False):
            raise CertificationError(f"no RECOVERY_VERIFIED durable checkpoint: manifest directory "
                                     f"{self.directory} does not exist")
        docs = self.scan()
        verified = [d for d in docs if d["state"] == RECOVERY_VERIFIED]
        if not verified:
            states = ", ".join(f"{d['checkpoint_id']!r}@{d['step']}={d['state']}" for d in docs) or "none"
            raise CertificationError(f"no RECOVERY_VERIFIED durable checkpoint in {self.directory} for "
                                     f"environment {self.environment_id!r} (manifests: {states}); refusing to "
                                     "load a candidate or quarantined checkpoint")
        newest = max(verified, key=lambda d: (d["step"], d["updated_at"]))
        pointer = self.read(LATEST_VERIFIED_FILE)
        if pointer is not None:
            target = next((d for d in docs if d["checkpoint_id"] == pointer["checkpoint_id"]), None)
            if target is None or target["state"] != RECOVERY_VERIFIED or target["step"] != pointer["step"]:
                found = "missing" if target is None else f"{target['state']} at step {target['step']}"
                raise ManifestRejected(
                    f"{os.path.join(self.directory, LATEST_VERIFIED_FILE)}: names checkpoint "
                    f"{pointer['checkpoint_id']!r} at step {pointer['step']}, but its manifest is {found}; "
                    "refusing ambiguous trust")
            if target["checkpoint_id"] != newest["checkpoint_id"]:
                logger.warning("latest_verified.json names %r (step %d) but %r (step %d) is newer and "
                               "RECOVERY_VERIFIED (a publication was interrupted); using the newer one",
                               target["checkpoint_id"], target["step"], newest["checkpoint_id"], newest["step"])
        return newest


# ---------------------------------------------------------------------------- ledger


@dataclass
class _Plan:
    quarantine: Optional[Tuple[int, Optional[str], str]] = None   # (step, id, reason)
    commit: Optional[Tuple[int, Optional[str]]] = None            # (step, id)
    save: Optional[int] = None                                    # step
    verify_new: bool = False                                      # dense: commit the save at once

    def durable_work(self) -> bool:
        return ((self.quarantine is not None and self.quarantine[1] is not None)
                or (self.commit is not None and self.commit[1] is not None) or self.save is not None)


class CertificationLedger:
    """The checkpoint-trust state machine of one rank (see the module docstring for the rules).

    catalog_size: K, the number of replay-shape recipes in one cycle (1 = dense).
    status_store: an object with ``write_status(dict)`` and ``read_status() -> dict | None``
        (GEMINI's `NodeLocalStore`); trust lives under its ``"trust"`` key.
    group: the gloo process group of the checkpoint ranks for job-wide agreement; None only for a
        single-process job. With a group, construction, `boundary` and `load_verified_durable` are
        collective: call them on every rank of the group in the same order.
    durable: optional `DurableCheckpointConfig`.
    """

    def __init__(self, catalog_size: int, status_store: Any, *, group: Any = None,
                 durable: Optional[DurableCheckpointConfig] = None) -> None:
        if not _is_int(catalog_size) or catalog_size < 1:
            raise ConfigError(f"CertificationLedger.catalog_size: must be a positive integer, got {catalog_size!r}")
        for method in ("write_status", "read_status"):
            if not callable(getattr(status_store, method, None)):
                raise ConfigError(f"CertificationLedger.status_store: must provide callable write_status and "
                                  f"read_status (GEMINI's NodeLocalStore); {type(status_store).__name__} lacks {method}")
        if durable is not None and not isinstance(durable, DurableCheckpointConfig):
            raise ConfigError(f"CertificationLedger.durable: must be a DurableCheckpointConfig or None, got "
                              f"{type(durable).__name__}")
        initialized = dist.is_available() and dist.is_initialized()
        if group is None and initialized and dist.get_world_size() > 1:
            raise ConfigError(f"CertificationLedger.group: None means a single-process job, but torch.distributed "
                              f"runs {dist.get_world_size()} ranks; pass the checkpoint process group "
                              "(for example dist.group.WORLD) so trust decisions are agreed job-wide")
        if group is not None and not initialized:
            raise ConfigError("CertificationLedger.group: a process group was given but torch.distributed is "
                              "not initialized")
        self._catalog_size = catalog_size
        self._store = status_store
        self._group = group
        self._durable = durable
        self._manifests = _ManifestStore(durable.manifest_dir, durable.environment_id) if durable else None
        self._candidate: Optional[Tuple[int, Optional[str]]] = None
        self._history: List[Tuple[int, Optional[str]]] = []      # newest first
        self._sdc_step: Optional[int] = None
        self._sdc_pending = False
        self._last_step: Optional[int] = None
        self._cycle_seen = 0
        self._cycle_tainted = False

        error: Optional[BaseException] = None
        try:
            loaded = self._load()
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks below, then raised
            error, loaded = exc, False
        if group is None:
            if error is not None:
                raise error
        else:
            views = self._gather({"error": None if error is None else f"{type(error).__name__}: {error}",
                                  "catalog_size": catalog_size, "trust": self._trust_doc()})
            failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
            if failed:
                raise CertificationError("CertificationLedger: could not load certification trust: "
                                         + "; ".join(f"rank {r}: {e}" for r, e in failed)) from error
            sizes = sorted({v["catalog_size"] for v in views})
            if len(sizes) > 1:
                raise CertificationError(f"CertificationLedger: ranks disagree on catalog_size ({sizes}); every "
                                         "rank of the group must use the same replay-shape catalog")
            loaded |= self._reconcile([v["trust"] for v in views])
        if loaded:
            self._persist()

    # ------------------------------------------------------------ properties

    @property
    def catalog_size(self) -> int:
        return self._catalog_size

    @property
    def candidate_step(self) -> Optional[int]:
        """The current CANDIDATE step (dynamic catalogs), or None."""
        return self._candidate[0] if self._candidate else None

    @property
    def candidate_checkpoint_id(self) -> Optional[str]:
        return self._candidate[1] if self._candidate else None

    @property
    def recovery_verified_step(self) -> Optional[int]:
        """The newest RECOVERY_VERIFIED step, or None."""
        return self._history[0][0] if self._history else None

    @property
    def recovery_verified_checkpoint_id(self) -> Optional[str]:
        """The durable checkpoint id of the newest RECOVERY_VERIFIED step, if it has one."""
        return self._history[0][1] if self._history else None

    @property
    def sdc_detected_step(self) -> Optional[int]:
        """The newest boundary step at which SDC was detected, or None."""
        return self._sdc_step

    @property
    def requires_verified_recovery(self) -> bool:
        """SDC was detected and training state has not been restored from verified state since:
        a restart must use RECOVERY_VERIFIED, and no boundary captures or certifies until then."""
        return self._sdc_pending

    def verified_steps(self) -> List[int]:
        """RECOVERY_VERIFIED steps, newest first (bounded history; exact recovery still requires
        the shards of the selected step to be present)."""
        return [s for s, _ in self._history]

    def trust(self) -> dict:
        """The persisted trust record (JSON)."""
        return self._trust_doc()

    # ------------------------------------------------------------ boundary

    def boundary(self, step: int, local_verdict: str, cycle_complete: bool,
                 finite: bool = True) -> BoundaryDecision:
        """Agree on one SCOUT boundary job-wide and apply the certification rules. Collective.

        Call it after SCOUT's check at `step` and before GEMINI's capture of `step`; capture only if
        the returned decision says ``capture``. `local_verdict` is this rank's outcome for its
        comparison group (`verdict_of`); `cycle_complete` is True at the last recipe of a cycle
        (always True for a dense catalog). `finite` is False when this rank's parameters or
        optimizer state hold NaN or Inf: then nothing is captured or certified anywhere.
        """
        problem = None
        if not _is_step(step):
            problem = f"step must be a non-negative integer, got {step!r}"
        elif local_verdict not in VERDICTS:
            problem = f"local_verdict must be one of {', '.join(VERDICTS)}, got {local_verdict!r}"
        elif not isinstance(cycle_complete, bool):
            problem = f"cycle_complete must be True or False, got {cycle_complete!r}"
        elif not isinstance(finite, bool):
            problem = f"finite must be True or False, got {finite!r}"
        views = self._gather({
            "error": problem, "step": step if problem is None else None,
            "verdict": local_verdict if problem is None else None,
            "cycle_complete": cycle_complete if problem is None else None, "finite": finite,
            "catalog_size": self._catalog_size, "trust": self._trust_doc(),
            "cycle": [self._cycle_seen, self._cycle_tainted],
        })
        failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
        if failed:
            raise CertificationError("boundary: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        steps = sorted({v["step"] for v in views})
        if len(steps) > 1:
            raise CertificationError(f"boundary: ranks are at different steps {steps}; the SCOUT schedule is not "
                                     "aligned across the checkpoint group, refusing any trust decision")
        sizes = sorted({v["catalog_size"] for v in views})
        if len(sizes) > 1:
            raise CertificationError(f"boundary: ranks disagree on catalog_size ({sizes})")
        before = self._trust_doc()
        if any(v["trust"] != views[0]["trust"] for v in views):
            logger.warning("certification trust differed across ranks at step %d; keeping only what every "
                           "rank holds", step)
            self._reconcile([v["trust"] for v in views])
        if any(v["cycle"] != views[0]["cycle"] for v in views):
            self._cycle_seen = max(v["cycle"][0] for v in views)
            self._cycle_tainted = True
        if self._last_step is not None and step <= self._last_step:
            self._rolled_back(step)

        verdicts = [v["verdict"] for v in views]
        flags = [v["cycle_complete"] for v in views]
        reporting = tuple(r for r, v in enumerate(verdicts) if v not in _ACCEPTED)
        sdc_ranks = tuple(r for r, v in enumerate(verdicts) if v == "sdc")
        verdict = next(v for v in _PRECEDENCE if v in verdicts)
        nonfinite = tuple(r for r, v in enumerate(views) if v["finite"] is not True)
        latched = self._sdc_pending
        accepted = verdict in _ACCEPTED and not latched and not nonfinite
        cycle_end = any(flags)
        self._cycle_seen += 1
        if not accepted or len(set(flags)) > 1:
            self._cycle_tainted = True
        complete = all(flags) and self._cycle_seen == self._catalog_size and "incomplete" not in verdicts
        certified = complete and not self._cycle_tainted

        plan = _Plan()
        if sdc_ranks:
            self._sdc_step, self._sdc_pending = step, True
            if self._candidate is not None:
                plan.quarantine = (self._candidate[0], self._candidate[1],
                                   f"SDC detected at step {step} (reported by group ranks {list(sdc_ranks)})")
            verified = self.recovery_verified_step
            reason = (f"SDC reported by group ranks {list(sdc_ranks)}: capture vetoed on every rank; recovery must "
                      + (f"use RECOVERY_VERIFIED step {verified}" if verified is not None
                         else "use a RECOVERY_VERIFIED checkpoint, and none exists yet"))
        elif latched:
            reason = (f"SDC was detected at step {self._sdc_step} and training has not been restored from "
                      "RECOVERY_VERIFIED state since; nothing is captured or certified")
        elif nonfinite:
            reason = (f"non-finite parameters or optimizer state (NaN/Inf) on group ranks {list(nonfinite)}: no "
                      "capture, and the current cycle cannot certify anything")
        elif verdict in _CAPTURED_UNCERTIFIED:
            reason = (f"a SCOUT check failed internally on group ranks {list(reporting)}: captured uncertified, "
                      "and the current cycle cannot certify anything")
        elif not accepted:
            reason = (f"{verdict} SCOUT evidence from group ranks {list(reporting)}: no capture, and the current "
                      "cycle cannot certify anything")
        else:
            reason = f"accepted ({verdict})"
        if cycle_end and not sdc_ranks and not latched:
            if certified and self._catalog_size == 1:
                plan.save, plan.verify_new = step, True
            elif certified:
                plan.commit = self._candidate
                plan.save = step
            elif self._cycle_tainted and self._candidate is not None and self._catalog_size > 1:
                plan.quarantine = (self._candidate[0], self._candidate[1],
                                   f"not certified: the cycle ending at step {step} was not a complete accepted "
                                   "cycle (inconclusive or incomplete SCOUT evidence)")
                reason += "; the pending candidate is retired uncertified"
            elif not complete:
                reason += "; the cycle was not seen complete (joined midway), nothing certified"
        if cycle_end:
            self._cycle_seen, self._cycle_tainted = 0, False
        self._last_step = step

        outcome = self._execute(plan)
        state, verified_step, rejected_step, checkpoint_id = None, None, None, None
        if plan.quarantine is not None:
            self._candidate, rejected_step = None, plan.quarantine[0]
        if outcome["invalidated_id"] is not None:
            self._history = [h for h in self._history if h[1] != outcome["invalidated_id"]]
        if plan.commit is not None:
            self._candidate = None
            if outcome["committed"]:
                self._add_verified(plan.commit)
                verified_step = plan.commit[0]
                reason += f"; candidate step {verified_step} promoted to RECOVERY_VERIFIED"
        if plan.save is not None and outcome["saved"]:
            checkpoint_id = outcome["saved_id"]
            if plan.verify_new:
                if outcome["verified_new"]:
                    self._add_verified((step, checkpoint_id))
                    state, verified_step = RECOVERY_VERIFIED, step
                    reason += "; dense catalog: RECOVERY_VERIFIED at once"
            else:
                self._candidate = (step, checkpoint_id)
                state = CANDIDATE
                reason += "; this boundary is the new CANDIDATE"
        decision = BoundaryDecision(
            step=step, verdict=verdict, capture=accepted or (verdict in _CAPTURED_UNCERTIFIED and not latched and not nonfinite),
            cycle_complete=complete, state=state,
            verified_step=verified_step, candidate_step=self.candidate_step, rejected_step=rejected_step,
            sdc_detected=bool(sdc_ranks), requires_verified_recovery=self._sdc_pending,
            reporting_ranks=reporting, checkpoint_id=checkpoint_id, reason=reason, nonfinite_ranks=nonfinite)
        if self._trust_doc() != before:
            self._persist()
        if sdc_ranks or nonfinite:
            logger.error("lm-resiliency certification: %s", reason)
        if outcome["error"] is not None:
            raise DurableCheckpointError(f"boundary {step}: durable checkpoint callback failed on rank 0: "
                                         f"{outcome['error']}", decision)
        return decision

    # ------------------------------------------------------------ recovery

    def note_sdc(self, step: int, reason: str) -> None:
        """Latch verified-only recovery for SDC found outside a boundary (the full replay sweep of
        `prepare_recovery`). Rank-local and non-collective, because the process group may be
        unusable; persisted, and merged job-wide at the next construction or boundary (any rank's
        latch wins)."""
        if not _is_step(step):
            raise ValueError(f"note_sdc: step must be a non-negative integer, got {step!r}")
        self._sdc_step, self._sdc_pending = step, True
        self._persist()
        logger.error("lm-resiliency certification: %s; recovery must use a RECOVERY_VERIFIED step (known: %s)",
                     reason, self.verified_steps())

    def resume_from(self, step: int) -> None:
        """Record that training state was just restored to `step` (call on every rank, same step).

        Drops a candidate newer than `step` and verified entries newer than `step` (the new
        timeline will overwrite those shards), restarts cycle counting, and clears the post-SDC
        latch. While SDC is pending, `step` must be a RECOVERY_VERIFIED step (fails closed).
        Non-collective; deterministic given the same trust on every rank.
        """
        if not _is_step(step):
            raise ValueError(f"resume_from: step must be a non-negative integer, got {step!r}")
        if self._sdc_pending and step not in self.verified_steps():
            raise CertificationError(
                f"resume_from({step}): SDC was detected at step {self._sdc_step}, so training must restart from "
                f"a RECOVERY_VERIFIED step (known: {self.verified_steps()}); step {step} is not one")
        self._resume(step)

    def load_verified_durable(self) -> int:
        """Load the newest RECOVERY_VERIFIED durable checkpoint on every rank through the adapter's
        ``load_checkpoint`` and return its step. Collective with a group: ranks must agree on the
        manifest. Never loads a candidate or quarantined checkpoint; raises CertificationError if
        there is no verified one or a manifest is malformed or foreign. Afterwards the ledger
        resumes from that step (as `resume_from`, clearing the post-SDC latch)."""
        if self._durable is None or self._manifests is None:
            raise CertificationError("load_verified_durable: no durable_checkpoint is configured")
        choice, error = None, None
        try:
            doc = self._manifests.newest_verified()
            choice = [doc["checkpoint_id"], doc["step"]]
        except (CertificationError, OSError) as exc:
            if self._group is None:
                raise
            error = f"{type(exc).__name__}: {exc}"
        if self._group is not None:
            views = self._gather({"error": error, "choice": choice})
            failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
            if failed:
                raise CertificationError("load_verified_durable: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
            choices = {tuple(v["choice"]) for v in views}
            if len(choices) > 1:
                raise CertificationError(f"load_verified_durable: ranks see different newest verified durable "
                                         f"checkpoints {sorted(choices)}; manifest_dir must be shared and consistent")
        checkpoint_id, step = choice
        logger.info("loading RECOVERY_VERIFIED durable checkpoint %r (step %d)", checkpoint_id, step)
        self._durable.adapter.load_checkpoint(checkpoint_id, step)
        self._resume(step, verified=(step, checkpoint_id))
        return step

    # ------------------------------------------------------------ internals

    def _gather(self, value: dict) -> List[dict]:
        if self._group is None:
            return [json.loads(json.dumps(value, allow_nan=False))]
        return all_gather_json(value, self._group)

    def _is_rank0(self) -> bool:
        return self._group is None or dist.get_rank(self._group) == 0

    def _add_verified(self, entry: Tuple[int, Optional[str]]) -> None:
        history = [h for h in self._history if h[0] != entry[0]] + [entry]
        history.sort(key=lambda h: -h[0])
        self._history = history[:VERIFIED_HISTORY_LIMIT]

    def _resume(self, step: int, verified: Optional[Tuple[int, Optional[str]]] = None) -> None:
        if self._candidate is not None and self._candidate[0] > step:
            logger.info("resumed from step %d: dropping newer candidate step %d", step, self._candidate[0])
            self._candidate = None
        self._history = [h for h in self._history if h[0] <= step]
        if verified is not None and verified[0] not in self.verified_steps():
            self._add_verified(verified)
        self._sdc_pending = False
        self._last_step = step
        self._cycle_seen, self._cycle_tainted = 0, False
        self._persist()

    def _rolled_back(self, step: int) -> None:
        logger.warning("boundary step %d is not after the previous boundary %d: training rolled back without "
                       "resume_from(); dropping the candidate and verified entries at or after step %d",
                       step, self._last_step, step)
        self._candidate = None
        self._history = [h for h in self._history if h[0] < step]
        self._cycle_seen, self._cycle_tainted = 0, False

    def _execute(self, plan: _Plan) -> dict:
        """Run the durable side of `plan` on rank 0 and share the outcome with every rank."""
        outcome = {"committed": plan.commit is not None, "saved": plan.save is not None, "saved_id": None,
                   "verified_new": plan.verify_new, "invalidated_id": None, "error": None}
        if self._durable is None or not plan.durable_work():
            return outcome
        local = self._run_durable(plan) if self._is_rank0() else {}
        return self._gather(local)[0]

    def _run_durable(self, plan: _Plan) -> dict:
        adapter, manifests = self._durable.adapter, self._manifests
        out = {"committed": False, "saved": False, "saved_id": None, "verified_new": False,
               "invalidated_id": None, "error": None}
        try:
            manifests.ensure_directory()
            if plan.quarantine is not None and plan.quarantine[1] is not None:
                q_step, q_id, q_reason = plan.quarantine
                manifests.write(q_id, q_step, QUARANTINED, q_reason)       # excluded before anything else
                adapter.quarantine_candidate(q_id, q_step, q_reason)
            if plan.commit is not None:
                c_step, c_id = plan.commit
                if c_id is None:
                    out["committed"] = True                                # no durable copy to commit
                else:
                    current = manifests.read(manifest_name(c_id))
                    if current is None or current["state"] != CANDIDATE or current["step"] != c_step:
                        found = "missing" if current is None else f"{current['state']} at step {current['step']}"
                        raise ManifestRejected(f"candidate {c_id!r} (step {c_step}) has manifest {found}; "
                                               "refusing to promote it")
                    adapter.commit_candidate(c_id, c_step)
                    manifests.write(c_id, c_step, RECOVERY_VERIFIED)
                    out["committed"] = True
            if plan.save is not None:
                new_id = adapter.save_candidate(plan.save)
                if not isinstance(new_id, str) or not new_id:
                    raise CertificationError(f"save_candidate({plan.save}) returned {new_id!r}, not a non-empty "
                                             "checkpoint id string")
                existing = manifests.read(manifest_name(new_id))
                if existing is not None and existing["state"] == RECOVERY_VERIFIED:
                    out["invalidated_id"] = new_id
                    manifests.write(new_id, existing["step"], QUARANTINED,
                                    f"checkpoint id reused by save_candidate({plan.save}); the verified bytes "
                                    "may have been overwritten")
                    manifests.refresh_pointer()
                    raise CertificationError(f"save_candidate({plan.save}) returned {new_id!r}, the id of a "
                                             f"RECOVERY_VERIFIED checkpoint (step {existing['step']}); ids must be "
                                             "unique and a verified checkpoint must never be overwritten")
                manifests.write(new_id, plan.save, CANDIDATE)
                out["saved"], out["saved_id"] = True, new_id
                if plan.verify_new:
                    adapter.commit_candidate(new_id, plan.save)
                    manifests.write(new_id, plan.save, RECOVERY_VERIFIED)
                    out["verified_new"] = True
        except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised there
            logger.exception("durable checkpoint callback or manifest publication failed")
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    # ------------------------------------------------------------ persistence

    def _trust_doc(self) -> dict:
        return {
            "schema_version": TRUST_SCHEMA_VERSION,
            "catalog_size": self._catalog_size,
            "candidate_step": self.candidate_step,
            "candidate_checkpoint_id": self.candidate_checkpoint_id,
            "recovery_verified_step": self.recovery_verified_step,
            "verified_history": [{"step": s, "checkpoint_id": i} for s, i in self._history],
            "sdc_detected_step": self._sdc_step,
            "sdc_pending": self._sdc_pending,
            "last_boundary_step": self._last_step,
        }

    def _persist(self) -> None:
        current = self._store.read_status()
        status = dict(current) if isinstance(current, dict) else {}
        status["trust"] = self._trust_doc()
        self._store.write_status(status)

    def _load(self) -> bool:
        """Load persisted trust; True if it had to be adjusted (and should be rewritten)."""
        status = self._store.read_status()
        if status is None or "trust" not in status:
            return False
        trust = self._parse_trust(status["trust"])
        history = [(e["step"], e["checkpoint_id"]) for e in trust["verified_history"]]
        self._history = history[:VERIFIED_HISTORY_LIMIT]
        self._sdc_step = trust["sdc_detected_step"]
        self._sdc_pending = trust["sdc_pending"]
        self._last_step = trust["last_boundary_step"]
        changed = len(history) > VERIFIED_HISTORY_LIMIT
        if trust["candidate_step"] is not None:
            if trust["catalog_size"] != self._catalog_size:
                logger.warning("certification catalog changed from %d to %d recipes: dropping candidate step %d "
                               "(verified steps are kept)", trust["catalog_size"], self._catalog_size,
                               trust["candidate_step"])
                changed = True
            else:
                self._candidate = (trust["candidate_step"], trust["candidate_checkpoint_id"])
        changed |= trust["catalog_size"] != self._catalog_size
        if self._sdc_pending:
            logger.warning("certification: SDC was detected at step %s and no verified recovery has been recorded; "
                           "restore RECOVERY_VERIFIED state (verified steps %s) and call resume_from()",
                           self._sdc_step, self.verified_steps())
        return changed

    @staticmethod
    def _parse_trust(trust: Any) -> dict:
        def bad(reason: str) -> CertificationError:
            return CertificationError(f"persisted certification trust is invalid: {reason}; refusing to use it")

        def step_or_none(name: str) -> None:
            if trust[name] is not None and not _is_step(trust[name]):
                raise bad(f"{name} {trust[name]!r} is not None or a non-negative integer")

        if not isinstance(trust, dict) or set(trust) != _TRUST_KEYS:
            got = sorted(trust) if isinstance(trust, dict) else type(trust).__name__
            raise bad(f"keys {got} are not exactly {sorted(_TRUST_KEYS)}")
        if not _is_int(trust["schema_version"]) or trust["schema_version"] != TRUST_SCHEMA_VERSION:
            raise bad(f"schema_version {trust['schema_version']!r} is not {TRUST_SCHEMA_VERSION}")
        if not _is_int(trust["catalog_size"]) or trust["catalog_size"] < 1:
            raise bad(f"catalog_size {trust['catalog_size']!r} is not a positive integer")
        for name in ("candidate_step", "recovery_verified_step", "sdc_detected_step", "last_boundary_step"):
            step_or_none(name)
        if not isinstance(trust["sdc_pending"], bool):
            raise bad("sdc_pending is not a boolean")
        cid = trust["candidate_checkpoint_id"]
        if cid is not None and (not isinstance(cid, str) or not cid or trust["candidate_step"] is None):
            raise bad(f"candidate_checkpoint_id {cid!r} does not go with candidate_step {trust['candidate_step']!r}")
        history = trust["verified_history"]
        if not isinstance(history, list):
            raise bad("verified_history is not a list")
        previous = None
        for entry in history:
            if (not isinstance(entry, dict) or set(entry) != {"step", "checkpoint_id"} or not _is_step(entry["step"])
                    or not (entry["checkpoint_id"] is None
                            or (isinstance(entry["checkpoint_id"], str) and entry["checkpoint_id"]))):
                raise bad(f"verified_history entry {entry!r} is not {{'step': int, 'checkpoint_id': str|None}}")
            if previous is not None and entry["step"] >= previous:
                raise bad("verified_history is not strictly newest first")
            previous = entry["step"]
        newest = history[0]["step"] if history else None
        if trust["recovery_verified_step"] != newest:
            raise bad(f"recovery_verified_step {trust['recovery_verified_step']!r} is not the newest verified_history "
                      f"step {newest!r}")
        return trust

    def _reconcile(self, trusts: List[dict]) -> bool:
        """Keep only what every rank holds (conservative); True if this rank's trust changed."""
        before = self._trust_doc()
        candidates = {(t["candidate_step"], t["candidate_checkpoint_id"]) for t in trusts}
        if len(candidates) == 1:
            step, cid = candidates.pop()
            self._candidate = (step, cid) if step is not None else None
        else:
            logger.warning("certification: ranks hold different candidates %s; dropping the candidate",
                           sorted(candidates, key=str))
            self._candidate = None
        common = None
        for t in trusts:
            entries = {(e["step"], e["checkpoint_id"]) for e in t["verified_history"]}
            common = entries if common is None else common & entries
        history = sorted(common or (), key=lambda h: -h[0])
        steps = [s for s, _ in history]
        if len(set(steps)) != len(steps):   # same step, different ids: ambiguous, keep neither
            history = [h for h in history if steps.count(h[0]) == 1]
        self._history = history[:VERIFIED_HISTORY_LIMIT]
        sdc = [t["sdc_detected_step"] for t in trusts if t["sdc_detected_step"] is not None]
        self._sdc_step = max(sdc) if sdc else None
        self._sdc_pending = any(t["sdc_pending"] for t in trusts)
        last = [t["last_boundary_step"] for t in trusts if t["last_boundary_step"] is not None]
        self._last_step = max(last) if last else None
        return self._trust_doc() != before


__all__ = [
    "BoundaryDecision",
    "CallbackDurableCheckpointAdapter",
    "CANDIDATE",
    "CertificationError",
    "CertificationLedger",
    "DurableCheckpointAdapter",
    "DurableCheckpointConfig",
    "DurableCheckpointError",
    "LATEST_VERIFIED_FILE",
    "ManifestRejected",
    "QUARANTINED",
    "RECOVERY_VERIFIED",
    "VERDICTS",
    "manifest_name",
    "verdict_of",
]
