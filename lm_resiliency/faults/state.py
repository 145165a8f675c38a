"""Campaign state stores: who claimed which occurrence, shared by old and replacement workers.

A store holds one JSON document. `compare_and_swap(expected, updated)` replaces it only if it
still equals `expected`, atomically with respect to every other user of the store; that is what
lets two workers of the same rank (an old one that has not died yet and its replacement) race
for a restart-stable occurrence and have exactly one of them win.
"""

from __future__ import annotations

import copy
import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Dict, Optional

from lm_resiliency.files import (CONFIG, Field, RecordSchema, atomic_write, encode_record, make_parents, parse_record,
                                 read_file_bytes)

from ._fields import check_json_ready
from ._files import locked

STATE_SCHEMA_VERSION = 1
_CAS_ATTEMPTS = 1000
_OBJECT = Field(types=(dict,), required=False)
# The shared state file; tooling may keep more top-level keys beside claims and values.
STATE_SCHEMA = RecordSchema(what="campaign state", identity=("schema_version", STATE_SCHEMA_VERSION),
                            fields={"claims": _OBJECT, "values": _OBJECT}, open_keys=True,
                            max_bytes=64 * 1024 * 1024)


def empty_state() -> Dict[str, Any]:
    return {"schema_version": STATE_SCHEMA_VERSION, "claims": {}, "values": {}}


def _checked(state: Any, where: str) -> Dict[str, Any]:
    if not isinstance(state, dict):
        raise ValueError(f"{where}: campaign state must be a JSON object, got {type(state).__name__}")
    return check_json_ready(state, where)


class CampaignStateStore(ABC):
    """Interface: `load()`, `save(state)` and atomic `compare_and_swap(expected, updated)`.

    Implementations must make `compare_and_swap` atomic across every process that uses the
    same store (not only threads). `claim` and `setdefault` are built on top of it."""

    @abstractmethod
    def load(self) -> Dict[str, Any]:
        """The current state (a fresh copy; `empty_state()` when nothing was saved yet)."""

    @abstractmethod
    def save(self, state: Dict[str, Any]) -> None:
        """Replace the state unconditionally (initialization and tooling; workers use CAS)."""

    @abstractmethod
    def compare_and_swap(self, expected: Dict[str, Any], updated: Dict[str, Any]) -> bool:
        """Replace the state with `updated` iff it still equals `expected`; True if replaced."""

    def claim(self, key: str, owner: Dict[str, Any]) -> bool:
        """Claim `key` for `owner` unless someone already has; True for exactly one caller."""
        return claim(self, key, owner)

    def claims(self) -> Dict[str, Any]:
        return self.load().get("claims", {})

    def setdefault(self, name: str, value: Any) -> Any:
        """The stored value `name`, storing `value` first if there is none (atomically)."""
        return setdefault(self, name, value)


def claim(store: Any, key: str, owner: Dict[str, Any]) -> bool:
    """Claim `key` in any object with `load()` and `compare_and_swap()` (a CampaignStateStore
    or a duck-typed one); True for exactly one of any number of concurrent callers."""
    owner = check_json_ready(owner, "claim owner")
    for _ in range(_CAS_ATTEMPTS):
        current = store.load()
        if key in current.get("claims", {}):
            return False
        updated = copy.deepcopy(current)
        updated.setdefault("claims", {})[key] = owner
        if store.compare_and_swap(current, updated):
            return True
    raise TimeoutError(f"could not claim {key!r}: the campaign state kept changing "
                       f"({_CAS_ATTEMPTS} compare-and-swap attempts)")


def setdefault(store: Any, name: str, value: Any) -> Any:
    """`store`'s value `name`, storing `value` first if there is none (compare-and-swap)."""
    value = check_json_ready(value, name)
    for _ in range(_CAS_ATTEMPTS):
        current = store.load()
        values = current.get("values", {})
        if name in values:
            return values[name]
        updated = copy.deepcopy(current)
        updated.setdefault("values", {})[name] = value
        if store.compare_and_swap(current, updated):
            return value
    raise TimeoutError(f"could not set {name!r}: the campaign state kept changing")


class MemoryCampaignStateStore(CampaignStateStore):
    """In-process store (threads only). Does not survive the process: restarts re-inject."""

    def __init__(self, state: Optional[Dict[str, Any]] = None) -> None:
        self._lock = threading.Lock()
        self._state = _checked(state, "initial state") if state is not None else empty_state()

    def load(self) -> Dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._state)

    def save(self, state: Dict[str, Any]) -> None:
        state = _checked(state, "save")
        with self._lock:
            self._state = state

    def compare_and_swap(self, expected: Dict[str, Any], updated: Dict[str, Any]) -> bool:
        updated = _checked(updated, "compare_and_swap")
        with self._lock:
            if self._state != expected:
                return False
            self._state = updated
            return True


class JsonCampaignStateStore(CampaignStateStore):
    """A JSON file shared by processes on one host (or a shared file system with working
    ``flock``). Writers hold an exclusive lock on ``<path>.lock`` and publish by atomic rename
    after fsync, so readers never see a partial document. A malformed state file fails closed
    (ValueError naming the file); it is never reset."""

    def __init__(self, path: str, *, timeout_s: float = 30.0) -> None:
        self._path = os.path.abspath(os.fspath(path))
        self._lock_path = self._path + ".lock"
        self._timeout_s = float(timeout_s)
        make_parents(self._path)

    @property
    def path(self) -> str:
        return self._path

    def _read(self) -> Dict[str, Any]:
        # Other processes steer injection through this file: not writable by group or others.
        data = read_file_bytes(self._path, "campaign state", max_bytes=STATE_SCHEMA.max_bytes, trust=CONFIG)
        if data is None:
            return empty_state()
        return parse_record(data, STATE_SCHEMA, self._path)

    def _write(self, state: Dict[str, Any]) -> None:
        atomic_write(self._path, encode_record(state, STATE_SCHEMA))

    def load(self) -> Dict[str, Any]:
        with locked(self._lock_path, exclusive=False, timeout_s=self._timeout_s):
            return self._read()

    def save(self, state: Dict[str, Any]) -> None:
        state = _checked(state, "save")
        with locked(self._lock_path, timeout_s=self._timeout_s):
            self._write(state)

    def compare_and_swap(self, expected: Dict[str, Any], updated: Dict[str, Any]) -> bool:
        updated = _checked(updated, "compare_and_swap")
        with locked(self._lock_path, timeout_s=self._timeout_s):
            if self._read() != expected:
                return False
            self._write(updated)
            return True

    def __repr__(self) -> str:
        return f"JsonCampaignStateStore({self._path!r})"


__all__ = ["CampaignStateStore", "JsonCampaignStateStore", "MemoryCampaignStateStore",
           "STATE_SCHEMA_VERSION", "claim", "empty_state", "setdefault"]
