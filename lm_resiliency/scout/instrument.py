"""Training-thread instrumentation that feeds a `ProgressBeacon` for the SCOUT OOB monitor.

* `instrument_dataloader(loader, beacon, name)`: marks every `next()` as op "dataloader:<name>".
* `checkpoint_io(beacon, kind, name)`: marks a checkpoint read or write as "checkpoint:<kind>:<name>".
* `trace_collectives(beacon)`: marks every Python-level torch.distributed collective and
  point-to-point call by its function name, "<name>(group=[ranks])" on a non-default group,
  except lm-resiliency's own traffic (`CollectiveTrace.exclude`, `CollectiveTrace.untraced`).

Each mark is a `beacon.enter`/`beacon.exit` pair: no I/O on the training thread. All three
accept `beacon=None` and then change nothing (SCOUT disabled).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from lm_resiliency.scout.monitor import (
    CHECKPOINT_OP_PREFIX,
    COLLECTIVE_OPS,
    DATALOADER_OP_PREFIX,
    ProgressBeacon,
)

logger = logging.getLogger(__name__)

CHECKPOINT_IO_KINDS = ("read", "write")


def _require_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: must be a non-empty string, got {name!r}")
    return name


def _require_beacon(beacon: Any, where: str) -> ProgressBeacon:
    if not isinstance(beacon, ProgressBeacon):
        raise TypeError(f"{where}.beacon: must be a ProgressBeacon or None, got {type(beacon).__name__}")
    return beacon


# ------------------------------------------------------------------------------------- DataLoader


class InstrumentedDataLoader:
    """An iterable proxy for a DataLoader whose iterators mark each `next()` on the beacon.

    `len()`, attribute reads and attribute writes pass through to the wrapped loader
    (`.dataloader`), so `loader.dataset`, `loader.batch_size`, `loader.sampler.set_epoch(e)` work
    unchanged. It is NOT a DataLoader subclass: `isinstance(x, DataLoader)` is False and
    frameworks that re-create a DataLoader from its constructor arguments (or that type-check it)
    must receive `.dataloader` instead. Instrument before creating the long-lived iterator.
    """

    _OWN = frozenset({"_lmr_loader", "_lmr_beacon", "_lmr_op"})

    def __init__(self, dataloader: Iterable, beacon: ProgressBeacon, name: str = "train") -> None:
        object.__setattr__(self, "_lmr_loader", dataloader)
        object.__setattr__(self, "_lmr_beacon", _require_beacon(beacon, "instrument_dataloader"))
        object.__setattr__(self, "_lmr_op", DATALOADER_OP_PREFIX + _require_name(name, "instrument_dataloader"))

    @property
    def dataloader(self) -> Iterable:
        """The wrapped DataLoader."""
        return self._lmr_loader

    @property
    def op(self) -> str:
        return self._lmr_op

    def __iter__(self) -> "InstrumentedIterator":
        return InstrumentedIterator(iter(self._lmr_loader), self._lmr_beacon, self._lmr_op)

    def __len__(self) -> int:
        return len(self._lmr_loader)

    def __getattr__(self, item: str) -> Any:
        # Only called when normal lookup fails: everything else belongs to the wrapped loader.
        if item in InstrumentedDataLoader._OWN:
            raise AttributeError(item)
        return getattr(self._lmr_loader, item)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self._lmr_loader, key, value)

    def __repr__(self) -> str:
        return f"InstrumentedDataLoader({self._lmr_op!r}, {self._lmr_loader!r})"


class InstrumentedIterator:
    """Iterator proxy: `next()` runs between `beacon.enter(op)` and `beacon.exit(op)`."""

    __slots__ = ("_it", "_beacon", "_op")

    def __init__(self, iterator: Iterator, beacon: ProgressBeacon, op: str) -> None:
        self._it, self._beacon, self._op = iterator, beacon, op

    def __iter__(self) -> "InstrumentedIterator":
        return self

    def __next__(self) -> Any:
        beacon, op = self._beacon, self._op
        beacon.enter(op)
        try:
            return next(self._it)
        finally:
            beacon.exit(op)

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, item: str) -> Any:
        return getattr(self._it, item)


def instrument_dataloader(dataloader: Any, beacon: Optional[ProgressBeacon], name: str = "train") -> Any:
    """Return `dataloader` wrapped so each `next()` is visible to the OOB monitor as
    "dataloader:<name>" (a stall longer than `dataloader_stall_threshold_s` is reported).

    With `beacon=None` (SCOUT disabled) the loader is returned unchanged; a loader already
    instrumented on the same beacon under the same name is returned as is.
    """
    if beacon is None:
        return dataloader
    _require_name(name, "instrument_dataloader")
    if (isinstance(dataloader, InstrumentedDataLoader) and dataloader._lmr_beacon is beacon
            and dataloader._lmr_op == DATALOADER_OP_PREFIX + name):
        return dataloader
    return InstrumentedDataLoader(dataloader, beacon, name)


# -------------------------------------------------------------------------------- checkpoint I/O


class checkpoint_io:  # used as a function: `with checkpoint_io(beacon, "write", "periodic"):`
    """Mark a checkpoint read or write as "checkpoint:<kind>:<name>" for the OOB monitor.

    `kind` must be "read" or "write" (ValueError otherwise, raised at the call). With
    `beacon=None` it marks nothing. Reusable, not reentrant across threads (use one per call).
    """

    __slots__ = ("_beacon", "op")

    def __init__(self, beacon: Optional[ProgressBeacon], kind: str, name: str) -> None:
        if kind not in CHECKPOINT_IO_KINDS:
            raise ValueError(f"checkpoint_io.kind: must be 'read' or 'write', got {kind!r}")
        _require_name(name, "checkpoint_io")
        self._beacon = None if beacon is None else _require_beacon(beacon, "checkpoint_io")
        self.op = f"{CHECKPOINT_OP_PREFIX}{kind}:{name}"

    def __enter__(self) -> "checkpoint_io":
        if self._beacon is not None:
            self._beacon.enter(self.op)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._beacon is not None:
            self._beacon.exit(self.op)


# ----------------------------------------------------------------------------------- collectives


class CollectiveTrace:
    """Handle returned by `trace_collectives`. `remove()` restores the originals (idempotent).

    A namespace entry that someone else replaced after installation is left alone (their
    wrapper stays); our wrapper inside it becomes a pass-through once removed.

    Only training collectives are marked. lm-resiliency's own transfers are not: their counts
    differ between healthy ranks (a recovery serves peer replicas from some ranks only), they run
    on background threads (replication) and they would pose as the training thread's last
    operation, so the hang rule would compare and blame the wrong thing. They are excluded by
    process group where the library owns the group (`exclude`: GEMINI's and the certification
    agreement group, used from any thread), and by section where SCOUT talks on the training
    thread (`untraced`: replay and probe, which the harness marks as one op of their own).
    """

    def __init__(self, beacon: ProgressBeacon) -> None:
        self.beacon = beacon
        self.active = False
        # Sees every traced training collective (entering(name, args, kwargs) -> token, then
        # left(token, async_op)): SCOUT's own-work timing and non-finite check (local_trace.py).
        self.observer: Optional[Any] = None
        self._installed: List[Tuple[Any, str, Callable, Callable]] = []
        self._labels: Dict[int, Tuple[Any, Optional[str]]] = {}
        self._excluded: Dict[int, Any] = {}   # id -> group; holding it keeps the id from being reused
        self._sections = threading.local()
        self._lock = threading.Lock()

    @property
    def names(self) -> Tuple[str, ...]:
        """The function names this handle wrapped."""
        return tuple(sorted({name for _, name, _, _ in self._installed}))

    def remove(self) -> None:
        with self._lock:
            self.active = False
            installed, self._installed = self._installed, []
        for namespace, name, original, wrapper in reversed(installed):
            if namespace.__dict__.get(name) is wrapper:
                setattr(namespace, name, _unwrap_inactive(original))
            else:
                logger.debug("trace_collectives: %s.%s was replaced after installation; left in place",
                             namespace.__name__, name)

    def exclude(self, *groups: Any) -> None:
        """Calls on these process groups (lm-resiliency's own; None is skipped) are not marked.
        Call it when a group is created, before it carries traffic."""
        with self._lock:
            for group in groups:
                if group is not None:
                    self._excluded[id(group)] = group
                    self._labels.pop(id(group), None)

    @contextlib.contextmanager
    def untraced(self) -> Iterator[None]:
        """Calls made by this thread inside the block are not marked (other threads unaffected)."""
        self._sections.depth = getattr(self._sections, "depth", 0) + 1
        try:
            yield
        finally:
            self._sections.depth -= 1

    def _traced_here(self) -> bool:
        return self.active and not getattr(self._sections, "depth", 0)

    def __enter__(self) -> "CollectiveTrace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _label(self, name: str, group: Any) -> Optional[str]:
        """The op for `name` on `group`; None for an excluded group (the call is not marked)."""
        # Cached per group object: one dict lookup per call on the hot path.
        cached = self._labels.get(id(group))
        if cached is not None and cached[0] is group:
            return None if cached[1] is None else f"{name}({cached[1]})"
        try:
            import torch.distributed as dist

            if self._excluded.get(id(group)) is group:
                label = None
            elif group is dist.GroupMember.WORLD:
                label = ""
            else:
                ranks = dist.get_process_group_ranks(group)
                label = "group=" + (repr(list(ranks)).replace(" ", "") if len(ranks) <= 8
                                    else f"[{ranks[0]},{ranks[1]},...,{ranks[-1]}]#{len(ranks)}")
        except Exception:  # noqa: BLE001 - unregistered or destroyed group: fall back to its name
            label = f"group={getattr(group, 'group_name', '?')}"
        if len(self._labels) > 4096:
            self._labels.clear()
        self._labels[id(group)] = (group, label)
        if label is None:
            return None
        return f"{name}({label})" if label else name


def _unwrap_inactive(fn: Callable) -> Callable:
    while True:
        handle = getattr(fn, "_lmr_trace_handle", None)
        if handle is None or handle.active:
            return fn
        fn = fn._lmr_trace_original  # type: ignore[attr-defined]


def _group_index(fn: Callable) -> Optional[int]:
    try:
        parameters = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return parameters.index("group") if "group" in parameters else None


def _wrap(fn: Callable, name: str, handle: CollectiveTrace) -> Callable:
    beacon = handle.beacon
    index = _group_index(fn)

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not handle._traced_here():
            return fn(*args, **kwargs)
        group = kwargs.get("group") if index is None or len(args) <= index else args[index]
        op = name if group is None else handle._label(name, group)
        if op is None:
            return fn(*args, **kwargs)
        observer = handle.observer
        started = observer.entering(name, args, kwargs) if observer is not None else None
        beacon.enter(op)
        result = None
        try:
            result = fn(*args, **kwargs)
            return result
        finally:
            beacon.exit(op)
            if observer is not None:
                observer.left(started, result is not None)   # an async call returns its Work

    traced._lmr_trace_handle = handle  # type: ignore[attr-defined]
    traced._lmr_trace_original = fn  # type: ignore[attr-defined]
    return traced


def trace_collectives(beacon: ProgressBeacon, names: Optional[Sequence[str]] = None) -> CollectiveTrace:
    """Wrap the Python-level torch.distributed collectives so each call is a beacon op.

    Wraps every function of `names` (default: `COLLECTIVE_OPS`) that exists in
    `torch.distributed.distributed_c10d`, and the same object wherever `torch.distributed`
    exposes it (internal calls such as `all_gather_object` -> `all_gather` are traced too, nested).
    Async calls (`isend`, `irecv`, `async_op=True`) are marked only while they launch; waiting on
    the returned Work is not traced, and neither are C++ collectives (DDP's gradient buckets,
    functional collectives used by DTensor) or names a module imported by value before this call.
    With NCCL a collective returns after launch; the hang rule still localizes by completed-op
    counts. Calls on groups passed to `handle.exclude(...)` and calls a thread makes inside
    `handle.untraced()` are not marked (lm-resiliency's own traffic, see `CollectiveTrace`).
    Returns a handle; `handle.remove()` restores the original functions exactly.
    """
    _require_beacon(beacon, "trace_collectives")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    handle = CollectiveTrace(beacon)
    wanted = sorted(COLLECTIVE_OPS if names is None else set(names))
    unknown = [n for n in wanted if n not in COLLECTIVE_OPS]
    if unknown:
        raise ValueError(f"trace_collectives.names: unknown collectives {unknown}")
    for name in wanted:
        original = c10d.__dict__.get(name)
        if not callable(original):
            continue
        wrapper = _wrap(original, name, handle)
        for namespace in (c10d, dist):
            if namespace.__dict__.get(name) is original:
                setattr(namespace, name, wrapper)
                handle._installed.append((namespace, name, original, wrapper))
        if dist.__dict__.get(name) is not wrapper and callable(dist.__dict__.get(name)):
            # torch.distributed exposes a different object under this name (someone wrapped it):
            # wrap that one separately so calls through either namespace are traced.
            other = dist.__dict__[name]
            other_wrapper = _wrap(other, name, handle)
            setattr(dist, name, other_wrapper)
            handle._installed.append((dist, name, other, other_wrapper))
    handle.active = True
    return handle
