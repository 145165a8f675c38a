"""SCOUT out-of-band (OOB) monitor: hangs, DataLoader stalls and checkpoint I/O stalls.

The training thread only updates a `ProgressBeacon` (a lock, a clock read and a list append per
event; no I/O). A daemon thread, `OOBMonitor`, does everything else out of band, so it keeps
working while the training thread is blocked inside a collective:

* every `monitor_poll_interval_s` it publishes this rank's beacon snapshot as a JSON document to
  the c10d key-value store (`<prefix>/snapshot/<rank>`; `store.set`, never pickle). The store is
  independent of the training process group: no collective is ever issued by the monitor.
* observer ranks read every rank's snapshot and apply the hang rule (`localize_hang`).
* every rank checks its own beacon for an instrumented DataLoader `next()` or checkpoint
  read/write that has run longer than its threshold.

Hang rule (see `localize_hang` for the full cascade). Progress means *completing* something:
leaving an instrumented op (`ProgressBeacon.exit`) or `ProgressBeacon.progress(step)`. Entering an
op is not progress, because a rank that enters a collective nobody else joins has stopped. A rank
is stalled when it made no progress for `hang_stall_threshold_s`; the job is then hung. The culprit
is localized among the ranks that stopped too (idle for at least half the threshold), narrowing
step by step: lower step, fewer completed collectives, blocked outside any collective while others
wait inside one, the minority current op, then the op that started earliest. The usual pattern:
rank R blocks in a collective the others never join; they block in their next collective waiting
for R. R is named, not the waiters; every rank's op and progress go into the evidence.

Who reports. Only the observer ranks (`observers`, spread across the rank range) read all
snapshots and evaluate the hang rule; every observer could compute the verdict. Each hang is
reported once, by the lowest-rank *healthy observer*: the lowest observer whose monitor thread is
alive, i.e. whose snapshot changed within `max(5 * poll, 2 s)`. A blocked training thread does not
make a monitor unhealthy (the monitor is out of band), so the culprit may report its own hang; a
dead or frozen process does, and the next observer takes over. The election does not depend on
the verdict, so observers whose views differ slightly still agree on who speaks. The reporter
claims the fault with an atomic `store.add` on a key derived from the culprits and their progress
counters, so a take-over never re-reports a hang already reported; after reporting, the rank stays
quiet until the hang clears (no rank stalled), and a later hang is a new fault.
Local stalls are reported by the stalled rank itself, once per op instance. A hang whose culprits
are all inside an instrumented DataLoader/checkpoint op, with live monitors, is left to that rank's
own (more specific) stall report.

Bounded waits: the monitor works on `store.clone()` with a short timeout where the store supports
an independent clone (TCPStore, FileStore, PrefixStore over either); it only `get`s keys that
`check` found, so no read waits for a missing key. `close()` joins the thread with a bound; the
thread is a daemon either way.

Why one module of this size: the beacon, the store protocol and the hang rule share one snapshot
format and one clock; split, they would each restate it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordSchema, array, integer, nested, nullable, number, parse_record, text
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.reports import (
    CHECKPOINT_IO_STALL,
    DATALOADER_STALL,
    HANG,
    SCOPE_PEER_GROUP,
    SCOPE_RANK,
    SCOUTFaultReport,
)

logger = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "lm-resiliency-"
DEFAULT_PREFIX = "lm_resiliency/oob"
DATALOADER_OP_PREFIX = "dataloader:"
CHECKPOINT_OP_PREFIX = "checkpoint:"
COMMUNICATION_OP_PREFIX = "comm:"
SNAPSHOT_VERSION = 1
DEFAULT_OBSERVERS = 4
_MAX_PUBLISHED_ACTIVE = 8
_OP = text(nonempty=False, max_length=256)
_ACTIVE_OP = RecordSchema(what="open op", fields={"op": _OP, "age_s": number(0), "seq": integer(0),
                                                  "thread": integer(None)})
# What each rank's monitor publishes in the store (`Beacon.snapshot` plus who and when).
SNAPSHOT_SCHEMA = RecordSchema(what="OOB monitor snapshot", identity=("v", SNAPSHOT_VERSION), fields={
    "rank": integer(0), "host": text(nonempty=False, max_length=256), "pid": integer(0), "seq": integer(0),
    "time": number(), "completed": integer(0), "collectives": integer(0), "activity": integer(0),
    "step": nullable(integer(0)), "idle_s": number(0), "last_op": nullable(_OP), "op": nullable(_OP),
    "op_age_s": nullable(number(0)), "active": array(nested(_ACTIVE_OP), max_length=_MAX_PUBLISHED_ACTIVE)})
_MAX_KEPT_ERRORS = 8

# Python-level torch.distributed entry points. `trace_collectives` wraps the ones that exist; an op
# named after one of them (optionally followed by "(group=...)") or prefixed "comm:" is a
# communication op for the hang rule.
COLLECTIVE_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list",
    "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv",
    "all_gather_single", "reduce_scatter_single",   # FSDP2 issues its sharded collectives through these
})

# Confidence of a hang verdict, by the rule that last narrowed the culprits.
_RULE_CONFIDENCE = {
    "stalled_subset": 0.7,
    "step_lag": 0.9,
    "collective_lag": 0.85,
    "self_blocked": 0.85,
    "minority_op": 0.75,
    "earliest_op": 0.5,
    "missing_monitor": 0.5,
    "all_stalled": 0.3,
}


class MonitorError(ResiliencyError, RuntimeError):
    """The OOB monitor failed: its report callback raised or its thread died."""


def is_communication_op(op: Optional[str]) -> bool:
    """True for an op that waits on peers: a traced torch.distributed call or a "comm:" op."""
    if not op:
        return False
    if op.startswith(COMMUNICATION_OP_PREFIX):
        return True
    return op.split("(", 1)[0] in COLLECTIVE_OPS


_COMMUNICATION_CACHE: Dict[str, bool] = {}


def is_local_stall_op(op: Optional[str]) -> bool:
    """True for an op with its own stall report: an instrumented DataLoader or checkpoint I/O."""
    return op is not None and (op.startswith(DATALOADER_OP_PREFIX) or op.startswith(CHECKPOINT_OP_PREFIX))


# --------------------------------------------------------------------------------------------- beacon


class ProgressBeacon:
    """Thread-safe record of this rank's training progress, written by the training thread.

    `enter(op)` / `exit(op)` bracket an operation (a collective, a DataLoader `next()`, a
    checkpoint write); `progress(step)` marks a completed training step. Each call takes one lock,
    reads the monotonic clock and appends to or truncates a per-thread list: no I/O, no allocation
    beyond a tuple. Ops nest per thread; `exit(op)` closes the innermost open op of that name
    (and anything opened inside it and never closed, e.g. after an exception). An unmatched `exit`
    is ignored.

    Progress (what resets the idle clock) is an `exit` or a `progress`; `enter` is not progress.
    The "current op" published for the hang rule is the innermost open op of the thread that last
    called `progress()` (the training thread), or, before any `progress()` call, the most recently
    entered open op of any thread.
    """

    __slots__ = ("_lock", "_stacks", "_seq", "_completed", "_collectives", "_activity", "_step",
                 "_last_progress", "_last_op", "_progress_thread")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stacks: Dict[int, List[Tuple[str, float, int]]] = {}
        self._seq = 0                 # entries ever made; identifies one op instance
        self._completed = 0           # ops exited
        self._collectives = 0         # communication ops exited
        self._activity = 0            # enters + exits + progress calls
        self._step: Optional[int] = None
        self._last_progress = time.monotonic()
        self._last_op: Optional[str] = None
        self._progress_thread: Optional[int] = None

    def enter(self, op: str, step: Optional[int] = None, *, on_training_thread: bool = False) -> None:
        """Mark the start of `op` on the calling thread (optionally recording the current step).

        `on_training_thread`: record it as the training thread's op (the thread that calls
        `progress()`) even when called from another thread, e.g. DDP's gradient hooks, which run
        on the autograd engine's device threads on GPUs while the training thread waits."""
        now = time.monotonic()
        tid = threading.get_ident()
        with self._lock:
            if on_training_thread and self._progress_thread is not None:
                tid = self._progress_thread
            self._seq += 1
            stack = self._stacks.get(tid)
            if stack is None:
                stack = self._stacks[tid] = []
            stack.append((op, now, self._seq))
            self._activity += 1
            if step is not None:
                self._step = step

    def exit(self, op: str) -> None:
        """Mark the end of the innermost open `op` of the calling thread (any thread as fallback)."""
        now = time.monotonic()
        tid = threading.get_ident()
        with self._lock:
            owner, index = tid, _find_open(self._stacks.get(tid), op)
            if index is None:
                for other, stack in self._stacks.items():
                    index = _find_open(stack, op)
                    if index is not None:
                        owner = other
                        break
                else:
                    return
            stack = self._stacks[owner]
            del stack[index:]
            if not stack:
                del self._stacks[owner]
            self._completed += 1
            communication = _COMMUNICATION_CACHE.get(op)
            if communication is None:
                communication = is_communication_op(op)
                if len(_COMMUNICATION_CACHE) < 4096:
                    _COMMUNICATION_CACHE[op] = communication
            if communication:
                self._collectives += 1
            self._activity += 1
            self._last_progress = now
            self._last_op = op

    def progress(self, step: int) -> None:
        """Mark training step `step` as reached (call it from the optimizer-step boundary)."""
        now = time.monotonic()
        tid = threading.get_ident()
        with self._lock:
            self._step = step
            self._activity += 1
            self._last_progress = now
            self._progress_thread = tid

    @contextmanager
    def track(self, op: str, step: Optional[int] = None) -> Iterator[None]:
        """`with beacon.track("forward"):` is `enter` then `exit`, also on an exception."""
        self.enter(op, step)
        try:
            yield
        finally:
            self.exit(op)

    @property
    def step(self) -> Optional[int]:
        return self._step

    def snapshot(self) -> Dict[str, Any]:
        """A JSON-ready view: counters, step, idle time, current op and every open op with its age."""
        now = time.monotonic()
        with self._lock:
            open_ops = [(op, start, seq, tid) for tid, stack in self._stacks.items() for op, start, seq in stack]
            completed, collectives, activity = self._completed, self._collectives, self._activity
            step, last_progress, last_op = self._step, self._last_progress, self._last_op
            progress_thread = self._progress_thread
            main_stack = self._stacks.get(progress_thread) if progress_thread is not None else None
            current = main_stack[-1] if main_stack else None
        open_ops.sort(key=lambda entry: entry[2])
        if progress_thread is None and open_ops:
            current = open_ops[-1][:3]
        return {
            "completed": completed,
            "collectives": collectives,
            "activity": activity,
            "step": step,
            "idle_s": max(0.0, now - last_progress),
            "last_op": last_op,
            "op": None if current is None else current[0],
            "op_age_s": None if current is None else max(0.0, now - current[1]),
            "active": [{"op": op, "age_s": max(0.0, now - start), "seq": seq, "thread": tid}
                       for op, start, seq, tid in open_ops],
        }


def _find_open(stack: Optional[List[Tuple[str, float, int]]], op: str) -> Optional[int]:
    if not stack:
        return None
    for index in range(len(stack) - 1, -1, -1):
        if stack[index][0] == op:
            return index
    return None


# ---------------------------------------------------------------------------------------- hang rule


@dataclass(frozen=True)
class RankView:
    """One rank as an observer sees it. Ages already include how long the snapshot is old."""

    rank: int
    host: str = ""
    idle_s: float = 0.0                 # since the last completed op / progress()
    op: Optional[str] = None            # current (innermost) op, None outside any op
    op_age_s: Optional[float] = None    # how long the current op has run
    last_op: Optional[str] = None       # the last op completed
    completed: int = 0
    collectives: int = 0
    step: Optional[int] = None
    activity: int = 0
    monitor_age_s: float = 0.0          # how long this rank's published snapshot has not changed

    def to_json(self) -> Dict[str, Any]:
        doc = asdict(self)
        for key in ("idle_s", "op_age_s", "monitor_age_s"):
            if doc[key] is not None:
                doc[key] = round(doc[key], 3)
        return doc


@dataclass(frozen=True)
class HangVerdict:
    """The outcome of `localize_hang`: who is stuck, by which rule, how sure."""

    culprits: Tuple[int, ...]
    rule: str                           # the rule that last narrowed the culprits
    confidence: float
    stalled: Tuple[int, ...]            # idle >= threshold
    candidates: Tuple[int, ...]         # idle >= threshold / 2: the ranks considered
    missing: Tuple[int, ...] = ()       # ranks that never published a snapshot
    rules: Tuple[str, ...] = ()         # every narrowing step, in order


def localize_hang(views: Mapping[int, RankView], world_size: int, threshold_s: float, *,
                  op_margin_s: float = 0.5) -> Optional[HangVerdict]:
    """Decide whether the job is hung and which ranks are stuck; None when nothing is stalled.

    Armed once any rank recorded activity (so a slow start-up before the first op is not a hang).
    A rank is stalled when `idle_s >= threshold_s`. With at least one stalled rank, the candidates
    are the ranks idle for at least `threshold_s / 2` (ranks that got stuck together with the
    first one); ranks still progressing are never blamed. If every published rank is a candidate
    and some ranks never published, the silent ranks are named ("missing_monitor"). Otherwise the
    candidates are narrowed by the first-to-last applicable rule, each applied only when it singles
    out a strict subset:

    1. step_lag: the lowest step (when every candidate reports a step);
    2. collective_lag: the fewest completed communication ops (the others got further);
    3. self_blocked: outside any communication op, while other candidates wait inside one
       (a rank inside a collective waits on a peer; a rank outside is blocked on itself);
    4. minority_op: the least common current op (or, outside any op, "after:<last op>");
    5. earliest_op: the current op (or idle period) that started earliest, by more than
       `op_margin_s`.

    Confidence comes from the last rule that narrowed ("all_stalled", 0.3, when none did).
    """
    present = {r: v for r, v in views.items() if 0 <= r < world_size}
    if not present or not any(v.activity > 0 for v in present.values()):
        return None
    stalled = tuple(sorted(r for r, v in present.items() if v.idle_s >= threshold_s))
    if not stalled:
        return None
    candidates = tuple(sorted(r for r, v in present.items() if v.idle_s >= threshold_s / 2))
    missing = tuple(r for r in range(world_size) if r not in present)
    if missing and len(candidates) == len(present):
        return HangVerdict(culprits=missing, rule="missing_monitor", confidence=_RULE_CONFIDENCE["missing_monitor"],
                           stalled=stalled, candidates=candidates, missing=missing, rules=("missing_monitor",))

    rules: List[str] = []
    current = [present[r] for r in candidates]
    if len(current) < len(present):
        rules.append("stalled_subset")

    def narrow(rule: str, keep: Sequence[RankView]) -> None:
        nonlocal current
        if 0 < len(keep) < len(current):
            current = list(keep)
            rules.append(rule)

    if all(v.step is not None for v in current):
        low = min(v.step for v in current)  # type: ignore[type-var]
        narrow("step_lag", [v for v in current if v.step == low])
    low = min(v.collectives for v in current)
    narrow("collective_lag", [v for v in current if v.collectives == low])
    if any(is_communication_op(v.op) for v in current):
        narrow("self_blocked", [v for v in current if not is_communication_op(v.op)])
    by_op: Dict[str, List[RankView]] = {}
    for v in current:
        by_op.setdefault(v.op if v.op else f"after:{v.last_op}", []).append(v)
    if len(by_op) > 1:
        smallest = min(len(group) for group in by_op.values())
        if smallest < max(len(group) for group in by_op.values()):
            narrow("minority_op", [v for group in by_op.values() if len(group) == smallest for v in group])

    def started(v: RankView) -> float:
        return v.op_age_s if v.op is not None and v.op_age_s is not None else v.idle_s

    oldest = max(started(v) for v in current)
    narrow("earliest_op", [v for v in current if started(v) >= oldest - op_margin_s])

    rule = rules[-1] if rules else "all_stalled"
    return HangVerdict(culprits=tuple(sorted(v.rank for v in current)), rule=rule,
                       confidence=_RULE_CONFIDENCE[rule], stalled=stalled, candidates=candidates,
                       missing=missing, rules=tuple(rules))


def observer_ranks(world_size: int, count: int = DEFAULT_OBSERVERS) -> Tuple[int, ...]:
    """The ranks that read every snapshot: `count` ranks spread evenly over the rank range (so
    they usually sit on different nodes). Every other rank only publishes and checks itself."""
    count = max(1, min(count, world_size))
    return tuple(sorted({(i * world_size) // count for i in range(count)}))


# ------------------------------------------------------------------------------------------ monitor


class OOBMonitor:
    """Out-of-band hang and stall monitor for one rank (see the module docstring).

    store: a c10d Store shared by every rank and independent of the training process group
    (in a session: `torch.distributed.distributed_c10d._get_default_store()`; the monitor uses a
    clone with a short timeout). `on_report` runs on the monitor thread, once per fault, on the one
    rank that reports it: the lowest healthy observer for a hang, the stalled rank itself for a
    DataLoader or checkpoint I/O stall. `observers` is how many ranks read all snapshots (default 4, spread over
    the rank range); store load per poll interval is `world_size` sets plus `observers *
    world_size` reads.
    """

    def __init__(self, store: Any, rank: int, world_size: int, config: ReplayHarnessConfig,
                 beacon: ProgressBeacon, *, on_report: Callable[[SCOUTFaultReport], None],
                 host: Optional[str] = None, prefix: str = DEFAULT_PREFIX,
                 observers: int = DEFAULT_OBSERVERS) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"OOBMonitor.world_size: must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"OOBMonitor.rank: must be an integer in [0, {world_size}), got {rank!r}")
        if not isinstance(config, ReplayHarnessConfig):
            raise TypeError(f"OOBMonitor.config: must be a ReplayHarnessConfig, got {type(config).__name__}")
        if not isinstance(beacon, ProgressBeacon):
            raise TypeError(f"OOBMonitor.beacon: must be a ProgressBeacon, got {type(beacon).__name__}")
        if not callable(on_report):
            raise TypeError("OOBMonitor.on_report: must be callable")
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(f"OOBMonitor.prefix: must be a non-empty key prefix, got {prefix!r}")
        if not isinstance(observers, int) or isinstance(observers, bool) or observers < 1:
            raise ValueError(f"OOBMonitor.observers: must be a positive integer, got {observers!r}")
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.beacon = beacon
        self.host = host if host is not None else socket.gethostname()
        self._on_report = on_report
        self._prefix = prefix.rstrip("/")
        self._poll_s = float(config.monitor_poll_interval_s)
        self._stale_s = max(5 * self._poll_s, 2.0)
        self._store_timeout_s = max(1.0, min(10.0, 5 * self._poll_s))
        self._store = self._private_store(store)
        self._observers = observer_ranks(world_size, observers)
        self._is_observer = rank in self._observers

        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._cycle_lock = threading.Lock()
        self._closed = False
        self._publish_seq = 0
        self._present: Set[int] = set()
        self._seen: Dict[int, Tuple[int, float]] = {}        # rank -> (snapshot seq, first seen at)
        self._local_reported: Set[int] = set()                # beacon op seq already reported
        self._hang_handled = False                             # this hang episode reported/claimed
        self._reports: List[SCOUTFaultReport] = []
        self._errors: List[BaseException] = []
        self._store_errors = 0
        self._last_store_warning = 0.0

    # lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "OOBMonitor":
        """Start the daemon thread (idempotent). Publishes a first snapshot immediately."""
        if self._closed:
            raise MonitorError("OOBMonitor.start: the monitor is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{THREAD_NAME_PREFIX}oob-monitor-{self.rank}",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Stop the thread and wait for it at most `timeout_s` (default: a few store timeouts).

        Idempotent. Safe to call from `on_report` (it does not join its own thread)."""
        self._closed = True
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        bound = timeout_s if timeout_s is not None else 3 * self._store_timeout_s + self._poll_s + 1.0
        thread.join(bound)
        if thread.is_alive():
            logger.warning("OOB monitor thread of rank %d did not stop within %.1fs (a store call is "
                           "blocked); it is a daemon and ends with the process", self.rank, bound)

    def __enter__(self) -> "OOBMonitor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def reports(self) -> Tuple[SCOUTFaultReport, ...]:
        """Every report this rank emitted, oldest first."""
        return tuple(self._reports)

    @property
    def observers(self) -> Tuple[int, ...]:
        return self._observers

    def check(self) -> None:
        """Raise MonitorError if the report callback raised or the monitor thread died.

        Call it from the training loop's step boundary so background failures surface."""
        if self._errors:
            raise MonitorError(f"OOB monitor of rank {self.rank} failed: {self._errors[0]!r}") from self._errors[0]
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise MonitorError(f"OOB monitor thread of rank {self.rank} died")

    def poll(self) -> None:
        """Run one publish-and-check cycle on the calling thread (the thread does this every poll)."""
        with self._cycle_lock:
            self._cycle()

    # internals ---------------------------------------------------------------------------------

    def _private_store(self, store: Any) -> Any:
        try:
            clone = store.clone()
        except Exception as exc:  # noqa: BLE001 - custom stores may not clone
            logger.debug("store.clone() unavailable (%r); the OOB monitor shares the store", exc)
            return store
        if clone is not store:
            try:
                clone.set_timeout(timedelta(seconds=self._store_timeout_s))
            except Exception as exc:  # noqa: BLE001
                logger.debug("could not bound the OOB store clone's timeout: %r", exc)
        return clone

    def _key(self, *parts: Any) -> str:
        return "/".join([self._prefix, *(str(p) for p in parts)])

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                with self._cycle_lock:
                    self._cycle()
            except BaseException as exc:  # keep monitoring; surface via check()
                if len(self._errors) < _MAX_KEPT_ERRORS:
                    logger.exception("OOB monitor cycle failed on rank %d", self.rank)
                    self._errors.append(exc)
                if not isinstance(exc, Exception):
                    raise
            next_at += self._poll_s
            now = time.monotonic()
            if next_at < now:  # fell behind (loaded host): do not burst
                next_at = now + self._poll_s
            self._stop.wait(next_at - now)

    def _cycle(self) -> None:
        now = time.monotonic()
        snap = self.beacon.snapshot()
        self._check_local(snap)
        self._publish_seq += 1
        doc = dict(snap, v=SNAPSHOT_VERSION, rank=self.rank, host=self.host, pid=os.getpid(),
                   seq=self._publish_seq, time=time.time(), active=snap["active"][-_MAX_PUBLISHED_ACTIVE:])
        try:
            self._store.set(self._key("snapshot", self.rank), json.dumps(doc, separators=(",", ":")))
        except Exception as exc:  # noqa: BLE001 - the store may be gone; keep checking locally
            self._store_failed("publish", exc)
        if self._is_observer:
            views = self._read_views(now, snap)
            if views is not None:
                self._check_hang(views)

    def _store_failed(self, what: str, exc: BaseException) -> None:
        self._store_errors += 1
        now = time.monotonic()
        if now - self._last_store_warning >= 60.0:
            self._last_store_warning = now
            logger.warning("OOB monitor of rank %d: store %s failed (%d failures so far): %r",
                           self.rank, what, self._store_errors, exc)

    def _read_views(self, now: float, own: Dict[str, Any]) -> Optional[Dict[int, RankView]]:
        views = {self.rank: _view(self.rank, own, self.host, lag=0.0)}
        try:
            for r in range(self.world_size):
                if r != self.rank and r not in self._present and self._store.check([self._key("snapshot", r)]):
                    self._present.add(r)
            others = sorted(self._present)
            raw = self._multi_get([self._key("snapshot", r) for r in others]) if others else []
        except Exception as exc:  # noqa: BLE001
            self._store_failed("read", exc)
            return None
        for r, value in zip(others, raw):
            try:
                doc = parse_record(bytes(value), SNAPSHOT_SCHEMA, f"store key {self._key('snapshot', r)}")
                if doc["rank"] != r:
                    raise ValueError(f"the snapshot of rank {r} names rank {doc['rank']}")
                seq = doc["seq"]
            except ValueError as exc:  # fail closed: a malformed snapshot (a RecordRejected) is ignored
                self._store_failed(f"snapshot of rank {r} is malformed", exc)
                continue
            seen = self._seen.get(r)
            if seen is None or seen[0] != seq:
                seen = self._seen[r] = (seq, now)
            views[r] = _view(r, doc, str(doc.get("host", "")), lag=now - seen[1])
        return views

    def _multi_get(self, keys: List[str]) -> List[bytes]:
        multi_get = getattr(self._store, "multi_get", None)
        if multi_get is not None:
            return list(multi_get(keys))
        return [self._store.get(key) for key in keys]

    def _check_local(self, snap: Dict[str, Any]) -> None:
        active = snap["active"]
        self._local_reported &= {entry["seq"] for entry in active}
        for entry in active:
            op, age, seq = entry["op"], entry["age_s"], entry["seq"]
            if seq in self._local_reported or not is_local_stall_op(op):
                continue
            if op.startswith(DATALOADER_OP_PREFIX):
                kind, threshold = DATALOADER_STALL, self.config.dataloader_stall_threshold_s
            else:
                kind, threshold = CHECKPOINT_IO_STALL, self.config.checkpoint_io_stall_threshold_s
            if age < threshold:
                continue
            self._local_reported.add(seq)
            self._emit(SCOUTFaultReport(
                kind=kind, scope=SCOPE_RANK, ranks=(self.rank,), hosts=(self.host,), resource=op,
                evidence={"op": op, "duration_s": round(age, 3), "threshold_s": threshold,
                          "idle_s": round(snap["idle_s"], 3), "last_op": snap["last_op"],
                          "open_ops": [e["op"] for e in active], "observer": self.rank},
                confidence=1.0, step=snap["step"]))

    def _check_hang(self, views: Dict[int, RankView]) -> None:
        threshold = self.config.hang_stall_threshold_s
        verdict = localize_hang(views, self.world_size, threshold, op_margin_s=max(3 * self._poll_s, 0.25))
        if verdict is None:
            self._hang_handled = False  # progress resumed: a later hang is a new episode
            return
        if self._hang_handled:
            return
        culprit_views = [views.get(r) for r in verdict.culprits]
        if all(v is not None and is_local_stall_op(v.op) and v.monitor_age_s <= self._stale_s
               for v in culprit_views):
            return  # the stuck ranks are alive inside an instrumented op: their own stall report covers it
        # The reporter is the lowest observer whose monitor is alive. It does not matter whether its
        # training thread is stuck (a culprit's monitor reports its own hang just as well); what
        # matters is that every observer elects the same rank without depending on its verdict.
        live = [r for r in self._observers if r in views and views[r].monitor_age_s <= self._stale_s]
        reporter = min(live) if live else self.rank
        if reporter != self.rank:
            return  # not ours to report; if the reporter's monitor goes silent we take over
        identity = ",".join(f"{r}.{v.collectives}.{v.completed}.{v.step}" if v is not None else f"{r}.missing"
                            for r, v in zip(verdict.culprits, culprit_views))
        claim = self._key("claim", HANG, identity)
        try:
            first = self._store.add(claim, 1) == 1
        except Exception as exc:  # noqa: BLE001 - cannot dedupe across ranks: report (at least once)
            self._store_failed("claim", exc)
            first = True
        self._hang_handled = True
        if not first:
            return
        report = _hang_report(verdict, views, threshold, self.rank, self.world_size, self._stale_s)
        try:
            self._store.set(claim + "/report", json.dumps(report.to_json(), separators=(",", ":"), default=str))
        except Exception as exc:  # noqa: BLE001
            self._store_failed("report publish", exc)
        self._emit(report)

    def _emit(self, report: SCOUTFaultReport) -> None:
        self._reports.append(report)
        logger.warning("SCOUT OOB %s on rank(s) %s (%s, confidence %.2f, reported by rank %d)",
                       report.kind, list(report.ranks), report.resource, report.confidence, self.rank)
        try:
            self._on_report(report)
        except Exception as exc:  # surfaced by check()
            logger.exception("OOB on_report callback raised on rank %d", self.rank)
            if len(self._errors) < _MAX_KEPT_ERRORS:
                self._errors.append(exc)


def _view(rank: int, doc: Mapping[str, Any], host: str, lag: float) -> RankView:
    op_age = doc.get("op_age_s")
    return RankView(
        rank=rank, host=host, idle_s=float(doc.get("idle_s", 0.0)) + lag, op=doc.get("op"),
        op_age_s=None if op_age is None else float(op_age) + lag, last_op=doc.get("last_op"),
        completed=int(doc.get("completed", 0)), collectives=int(doc.get("collectives", 0)),
        step=doc.get("step"), activity=int(doc.get("activity", 0)), monitor_age_s=lag)


def _hang_report(verdict: HangVerdict, views: Mapping[int, RankView], threshold_s: float, observer: int,
                 world_size: int, stale_s: float) -> SCOUTFaultReport:
    culprits = [views.get(r) for r in verdict.culprits]
    ops = sorted({(v.op or f"after:{v.last_op}") if v is not None else "unknown" for v in culprits})
    steps = [v.step for v in culprits if v is not None and v.step is not None]
    return SCOUTFaultReport(
        kind=HANG,
        scope=SCOPE_PEER_GROUP if verdict.rule == "all_stalled" else SCOPE_RANK,
        ranks=verdict.culprits,
        hosts=tuple(v.host if v is not None else "" for v in culprits),
        resource=",".join(ops),
        evidence={
            "rule": verdict.rule,
            "rules": list(verdict.rules),
            "threshold_s": threshold_s,
            "stalled_s": {str(v.rank): round(v.idle_s, 3) for v in culprits if v is not None},
            "stalled_ranks": list(verdict.stalled),
            "candidate_ranks": list(verdict.candidates),
            "missing_ranks": list(verdict.missing),
            # ranks whose monitor stopped publishing: the process is dead or frozen (inaccessible)
            "monitor_silent": sorted(r for r, v in views.items() if v.monitor_age_s > stale_s),
            "ranks": {str(r): views[r].to_json() for r in sorted(views)},
            "world_size": world_size,
            "observer": observer,
        },
        confidence=verdict.confidence,
        step=min(steps) if steps else None,
    )
