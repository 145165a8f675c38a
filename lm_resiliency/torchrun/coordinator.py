"""`TorchrunRecoveryCoordinator`: an external manager takes the recovery decisions the built-in
policy otherwise takes, over the c10d store the `lm_resiliency` rendezvous uses.

Agents run in manager mode with `--rdzv-conf lm_resiliency_manager=1` (every agent of a run must
agree; the first registration fixes it). In that mode every generation after the initial one
starts only from a successor the manager published for that rendezvous round: its step, trust
and reason go into `context.json`, and an agent whose slot the successor retires leaves. After
publishing, the coordinator renews a generation-specific lease (sequence number + remaining
seconds) until the request's deadline; an agent accepts the generation only after it sees the
sequence advance with time remaining, measured on its own monotonic clock (no wall-clock
comparison between hosts). A successor never published, or a lease that stopped or ran out,
stops the agent with RendezvousRefused.

Store keys, under the running launch's part of the store (`lm_resiliency/<run id>/launch/<launch
id>/`, launches.py; the coordinator finds the launch whose agents are alive): `placement/initial`,
`gen/<g>/placement`, `successor/<g>`, `lease/<g>`. Every document is read through the record layer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

from torch.distributed import Store

from lm_resiliency._values import is_int
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import (RecordRejected, RecordSchema, array, check_record, encode_record, integer, number,
                                 parse_record, text)
from lm_resiliency.torchrun.context import ID, RUN_ID, TRUST_LATEST, TRUST_VERIFIED, topology_digest
from lm_resiliency.torchrun.launches import Launch, LaunchError, inner_run_id, launch_store, live_launch

logger = logging.getLogger(__name__)

MANAGER_OPTION = "lm_resiliency_manager"
SUCCESSOR_SCHEMA = "lm-resiliency-torchrun-successor/1"
PLACEMENT_SCHEMA = "lm-resiliency-torchrun-placement/1"
_SOURCES = ("gemini", "none")
_SECONDS = number(None, None)


class TorchrunCoordinatorError(ResiliencyError, RuntimeError):
    """A coordinator operation failed (bad request, second publication, lost lease store)."""


class _Rejected(RecordRejected):
    pass


PLACEMENT_RECORD = RecordSchema(what="placement record", identity=("schema", PLACEMENT_SCHEMA), fields={
    "run_id": RUN_ID, "generation": integer(0), "nodes": integer(1), "node_ids": array(ID, nonempty=True),
    "topology_digest": ID})
# Ranges are the successor's own rules (`_successor_problem`), which name the field in words.
SUCCESSOR_RECORD = RecordSchema(what="successor placement", identity=("schema", SUCCESSOR_SCHEMA), fields={
    "run_id": RUN_ID, "generation": integer(None), "kind": text(), "retire_slots": array(integer(None)),
    "checkpoint_step": integer(None), "checkpoint_source": text(), "trust": text(), "reason": text(nonempty=False,
                                                                                                   max_length=16384),
    "nodes": integer(None), "topology_digest": text(nonempty=False, max_length=64), "deadline_s": _SECONDS,
    "renew_interval_s": _SECONDS, "publication": text(nonempty=False, max_length=64)})
LEASE_RECORD = RecordSchema(what="lease", fields={"sequence": integer(0), "remaining_s": number(0.0)})


def _parse(data: Any, schema: RecordSchema, where: str) -> Dict[str, Any]:
    try:
        return parse_record(data, schema, where, error=_Rejected)
    except _Rejected as exc:
        raise TorchrunCoordinatorError(str(exc)) from None


@dataclass(frozen=True)
class TorchrunInitialPlacement:
    """The committed first generation: which node id holds each slot, the width and topology digest."""

    run_id: str
    generation: int
    nodes: int
    node_ids: Tuple[str, ...]
    topology_digest: str


@dataclass(frozen=True)
class TorchrunRecoveryRequest:
    """A manager's decision for rendezvous round `generation` (after the initial one): every worker
    loads `checkpoint_step` (source "gemini"; "none" with step 0 starts fresh), under `trust`;
    the agents holding `retire_slots` leave and standbys take those slots (empty: a same-node
    successor). The agents may start it for `deadline_s` seconds after publication."""

    generation: int
    checkpoint_step: int
    deadline_s: float
    trust: str = TRUST_VERIFIED
    retire_slots: Tuple[int, ...] = ()
    checkpoint_source: str = "gemini"
    reason: str = "selected by the recovery manager"


@dataclass(frozen=True)
class TorchrunSuccessorPlacement:
    """A published successor generation (immutable): `kind` is "same-node" or "replacement"."""

    run_id: str
    generation: int
    kind: str
    retire_slots: Tuple[int, ...]
    checkpoint_step: int
    checkpoint_source: str
    trust: str
    reason: str
    nodes: int
    topology_digest: str
    deadline_s: float
    renew_interval_s: float
    publication: str = field(default="", repr=False)

    def to_json(self) -> Dict[str, Any]:
        return dict(asdict(self), retire_slots=list(self.retire_slots), schema=SUCCESSOR_SCHEMA)

    @classmethod
    def from_json(cls, data: Any, where: str) -> "TorchrunSuccessorPlacement":
        try:
            doc = check_record(data, SUCCESSOR_RECORD, where, error=_Rejected)
        except _Rejected as exc:
            raise TorchrunCoordinatorError(str(exc)) from None
        values = {k: v for k, v in doc.items() if k != "schema"}
        placement = cls(**dict(values, retire_slots=tuple(values["retire_slots"])))
        problem = _successor_problem(placement)
        if problem:
            raise TorchrunCoordinatorError(f"{where}: {problem}")
        return placement


def _successor_problem(p: TorchrunSuccessorPlacement) -> str:
    if not is_int(p.generation) or p.generation < 1:
        return f"generation must be a positive rendezvous round, got {p.generation!r}"
    if not is_int(p.checkpoint_step) or p.checkpoint_step < 0:
        return f"checkpoint_step must be a non-negative integer, got {p.checkpoint_step!r}"
    if p.checkpoint_source not in _SOURCES or (p.checkpoint_source == "none" and p.checkpoint_step != 0):
        return f"checkpoint_source must be one of {_SOURCES} ('none' only with step 0), got {p.checkpoint_source!r}"
    if p.trust not in (TRUST_LATEST, TRUST_VERIFIED):
        return f"trust must be {TRUST_LATEST!r} or {TRUST_VERIFIED!r}, got {p.trust!r}"
    if not is_int(p.nodes) or p.nodes < 1:
        return f"nodes must be a positive integer, got {p.nodes!r}"
    slots = p.retire_slots
    if slots is None or not all(is_int(s) and 0 <= s < p.nodes for s in slots) or list(slots) != sorted(set(slots)):
        return f"retire_slots must be sorted distinct node slots below {p.nodes}, got {slots!r}"
    if p.kind != ("replacement" if slots else "same-node"):
        return f"kind must say whether slots are retired, got {p.kind!r}"
    for name in ("deadline_s", "renew_interval_s"):
        value = getattr(p, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e7:
            return f"{name} must be a positive number of seconds, got {value!r}"
    if not all(isinstance(getattr(p, n), str) for n in ("run_id", "reason", "topology_digest", "publication")):
        return "run_id, reason, topology_digest and publication must be strings"
    return ""


def _placement_json(placement: TorchrunInitialPlacement) -> bytes:
    return encode_record(dict(asdict(placement), node_ids=list(placement.node_ids), schema=PLACEMENT_SCHEMA),
                         PLACEMENT_RECORD)


def commit_placement(store: Store, run_id: str, generation: int, node_ids: Tuple[str, ...]) -> None:
    """Agents: record round `generation`'s slots -> node ids in their launch's part of the store
    (`store`); the first one is the initial placement."""
    text = _placement_json(TorchrunInitialPlacement(run_id, generation, len(node_ids), node_ids,
                                                    topology_digest(run_id, len(node_ids))))
    store.set(f"gen/{generation}/placement", text)
    store.compare_set("placement/initial", "", text)


def read_placement(data: Any, where: str = "placement record") -> TorchrunInitialPlacement:
    doc = _parse(data, PLACEMENT_RECORD, where)
    if doc["nodes"] != len(doc["node_ids"]):
        raise TorchrunCoordinatorError(f"{where}: nodes {doc['nodes']} but {len(doc['node_ids'])} node ids")
    return TorchrunInitialPlacement(doc["run_id"], doc["generation"], doc["nodes"], tuple(doc["node_ids"]),
                                    doc["topology_digest"])


class TorchrunRecoveryCoordinator:
    """The manager's side. `store` is the c10d store of the rendezvous (what `--rdzv-endpoint`
    names: `torch.distributed.FileStore(path)` for `store_type=file`, a `TCPStore` client for
    `tcp`; `from_endpoint` builds either). Keep it alive through successor admission and poll
    `check_health()` while waiting; `close()` stops renewing."""

    def __init__(self, store: Store, run_id: str, *, renew_interval_s: float = 1.0,
                 failure_tolerance_s: float = 10.0) -> None:
        if not isinstance(run_id, str) or not run_id:
            raise TorchrunCoordinatorError("run_id must be the --rdzv-id of the run")
        if not 0 < renew_interval_s < failure_tolerance_s:
            raise TorchrunCoordinatorError(f"renew_interval_s ({renew_interval_s}) must be positive and below "
                                           f"failure_tolerance_s ({failure_tolerance_s})")
        self.run_id = run_id
        self.renew_interval_s = float(renew_interval_s)
        self.failure_tolerance_s = float(failure_tolerance_s)
        self._raw = store
        self._launch: Optional[Launch] = None
        self._launch_store: Optional[Store] = None
        self._lock = threading.Lock()  # one store operation at a time (the lease thread shares it)
        self._error: Optional[TorchrunCoordinatorError] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_endpoint(cls, endpoint: str, run_id: str, *, store_type: str = "file", timeout_s: float = 60.0,
                      **kwargs: Any) -> "TorchrunRecoveryCoordinator":
        """Connect to the store of `--rdzv-endpoint` (a file path, or host:port of the agents' TCPStore)."""
        from torch.distributed import FileStore, TCPStore

        if store_type == "file":
            return cls(FileStore(endpoint), run_id, **kwargs)
        if store_type != "tcp":
            raise TorchrunCoordinatorError(f"store_type must be 'file' or 'tcp', got {store_type!r}")
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise TorchrunCoordinatorError(f"endpoint {endpoint!r}: expected host:port for store_type=tcp")
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, run_id, **kwargs)

    # ------------------------------------------------------------------ manager API

    def check_health(self) -> None:
        """Raise the latched lease-renewal failure, if any."""
        if self._error is not None:
            raise self._error

    @property
    def launch_id(self) -> Optional[str]:
        """The launch of the run this coordinator manages (None until it found a live one)."""
        return None if self._launch is None else self._launch.launch_id

    def _store_of_launch(self, timeout_s: float) -> Store:
        """The running launch's part of the store: found once (the launch whose agents beat), then kept."""
        if self._launch_store is None:
            try:
                self._launch = live_launch(self._raw, self.run_id, timeout_s)
            except LaunchError as exc:
                raise TorchrunCoordinatorError(str(exc)) from None
            self._launch_store = launch_store(self._raw, self.run_id, self._launch.launch_id)
            logger.info("lm_resiliency coordinator: managing launch %s of run %r", self._launch.launch_id[:12],
                        self.run_id)
        return self._launch_store

    def initial_placement(self, timeout_s: float = 300.0) -> TorchrunInitialPlacement:
        """The committed generation-0 placement of the running launch (waits up to `timeout_s` for
        the agents to start and commit it)."""
        self.check_health()
        deadline = time.monotonic() + timeout_s
        store = self._store_of_launch(timeout_s)
        key = "placement/initial"
        return read_placement(self._wait_get(store, key, max(0.0, deadline - time.monotonic())), f"store key {key}")

    def publish_successor(self, request: TorchrunRecoveryRequest) -> TorchrunSuccessorPlacement:
        """Publish the successor for round `request.generation` (once: a second publication for the
        same round fails) and renew its lease until `request.deadline_s` has passed."""
        self.check_health()
        if not isinstance(request, TorchrunRecoveryRequest):
            raise TorchrunCoordinatorError(f"publish_successor expects a TorchrunRecoveryRequest, got "
                                           f"{type(request).__name__}")
        initial = self.initial_placement(timeout_s=0.0)
        slots = tuple(request.retire_slots) if isinstance(request.retire_slots, (tuple, list)) else None
        placement = TorchrunSuccessorPlacement(
            run_id=self.run_id, generation=request.generation,
            kind="replacement" if slots else "same-node", retire_slots=slots or (),
            checkpoint_step=request.checkpoint_step, checkpoint_source=request.checkpoint_source,
            trust=request.trust, reason=request.reason, nodes=initial.nodes, topology_digest=initial.topology_digest,
            deadline_s=request.deadline_s, renew_interval_s=self.renew_interval_s, publication=uuid.uuid4().hex)
        problem = _successor_problem(placement) if slots is not None else "retire_slots must be a tuple of slots"
        if not problem and placement.generation <= initial.generation:
            problem = f"generation {placement.generation} is not after the initial generation {initial.generation}"
        if problem:
            raise TorchrunCoordinatorError(f"TorchrunRecoveryRequest: {problem}")
        text = encode_record(placement.to_json(), SUCCESSOR_RECORD).decode()
        store = self._store_of_launch(0.0)
        with self._lock:
            held = store.compare_set(f"successor/{placement.generation}", "", text).decode()
        if held != text:
            raise TorchrunCoordinatorError(f"a successor for generation {placement.generation} of run {self.run_id!r} "
                                           "is already published; successors are immutable")
        self._start_lease(store, placement)
        logger.warning("lm_resiliency coordinator: published %s successor generation %d of run %r: step %d (%s), "
                       "retiring slots %s, deadline %gs", placement.kind, placement.generation, self.run_id,
                       placement.checkpoint_step, placement.trust, list(placement.retire_slots), placement.deadline_s)
        return placement

    def close_run(self) -> None:
        """Close the rendezvous: parked standbys wake and exit, no agent joins a later round."""
        self.check_health()
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self._store_of_launch(0.0)
        assert self._launch is not None
        inner = inner_run_id(self.run_id, self._launch.launch_id)  # torch's rendezvous of this launch
        params = RendezvousParameters("c10d", "", inner, 1, 1)
        create_handler(self._raw, C10dRendezvousBackend(self._raw, inner), params).set_closed()

    def close(self) -> None:
        """Stop renewing the lease (agents then refuse the generation once they see it stopped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.renew_interval_s + self.failure_tolerance_s + 5.0)

    def __enter__(self) -> "TorchrunRecoveryCoordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------- lease

    def _wait_get(self, store: Store, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if store.check([key]):
                    return store.get(key)
            if time.monotonic() >= deadline:
                raise TorchrunCoordinatorError(f"run {self.run_id!r} has no {key} in the rendezvous store after "
                                               f"{timeout_s:g}s: have the agents formed the first generation?")
            time.sleep(0.2)

    def _start_lease(self, store: Store, placement: TorchrunSuccessorPlacement) -> None:
        self.close()  # a newer successor supersedes the previous lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, args=(store, placement, self._stop), daemon=True,
                                        name=f"lm-resiliency-lease-{placement.generation}")
        self._thread.start()

    def _renew(self, store: Store, placement: TorchrunSuccessorPlacement, stop: threading.Event) -> None:
        start = last_ok = time.monotonic()
        key, sequence = f"lease/{placement.generation}", 0
        while True:
            remaining = placement.deadline_s - (time.monotonic() - start)
            sequence += 1
            try:
                with self._lock:
                    store.set(key, encode_record({"sequence": sequence, "remaining_s": max(remaining, 0.0)},
                                                 LEASE_RECORD))
                last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - store clients raise several types; retried
                if time.monotonic() - last_ok > self.failure_tolerance_s:
                    self._error = TorchrunCoordinatorError(
                        f"lease of generation {placement.generation} of run {self.run_id!r}: the store refused "
                        f"renewals for more than {self.failure_tolerance_s:g}s ({type(exc).__name__}: {exc}); agents "
                        "will refuse the generation. Check the rendezvous store, then publish a new successor")
                    logger.error("lm_resiliency coordinator: %s", self._error)
                    return
                logger.warning("lm_resiliency coordinator: lease renewal failed, retrying: %s", exc)
            if remaining <= 0 or stop.wait(self.renew_interval_s):
                return


def successor_for(store: Store, run_id: str, generation: int, timeout_s: float) -> TorchrunSuccessorPlacement:
    """Agents: wait up to `timeout_s` for the successor published for round `generation`."""
    key = f"successor/{generation}"
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several store error types
        raise TorchrunCoordinatorError(f"run {run_id!r} is managed ({MANAGER_OPTION}=1) and no successor for "
                                       f"generation {generation} was published within {timeout_s:g}s") from exc
    where = f"store key {key}"
    placement = TorchrunSuccessorPlacement.from_json(_parse(store.get(key), SUCCESSOR_RECORD, where), where)
    if placement.run_id != run_id or placement.generation != generation:
        raise TorchrunCoordinatorError(f"store key {key}: the successor names run {placement.run_id!r} generation "
                                       f"{placement.generation}")
    return placement


def check_lease(store: Store, placement: TorchrunSuccessorPlacement) -> float:
    """Agents: the seconds this generation may still start, on this host's monotonic clock. The
    lease counts only once its sequence advances (the coordinator is alive); raises when it did not
    advance within three renewal intervals or no time remains."""
    key = f"lease/{placement.generation}"
    limit = time.monotonic() + 3 * placement.renew_interval_s
    first: Optional[int] = None
    while time.monotonic() < limit:
        if store.check([key]):
            lease = _parse(store.get(key), LEASE_RECORD, f"store key {key}")
            seen = time.monotonic()
            if first is None:
                first = lease["sequence"]
            elif lease["sequence"] != first:
                valid_until = seen + float(lease["remaining_s"])
                if valid_until <= time.monotonic():
                    break
                return valid_until - time.monotonic()
        time.sleep(min(0.2, placement.renew_interval_s / 4))
    raise TorchrunCoordinatorError(
        f"the lease of successor generation {placement.generation} is expired or no longer renewed (sequence "
        f"{first}); the recovery manager's deadline passed or it stopped. Not starting the generation")
