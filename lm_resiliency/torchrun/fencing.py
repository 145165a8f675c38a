"""Fencing: an agent cut off from the rendezvous store, or unresponsive, for the fence bound never
takes part in its launch again.

The store is the one arbiter. Every agent's keep-alive adds to its node's counter
`beat/<node id>` (launches.py). While a generation runs, every agent watches the counters of the
other nodes of the generation; a node whose counter stood still for the fence bound (twice the
keep-alive expiry, the time after which a parked standby takes a missing node's place) is fenced:
`fenced/<node id>` names that node's agent (its claim token), the generation and how long it was
silent, first writer wins. The agents that still reach the store stop their workers (whose
collectives wait on the lost ranks) and form the next generation, a standby in the lost slot.

The cut-off side cannot read the store, so it fences itself: an agent whose own keep-alive has not
reached the store for the fence bound stops its workers and exits refusing to rejoin; so does an
agent that finds its own fence record. Nothing a fenced agent's workers recorded is ever part of
a generation of the launch again, so no recovery can select it. A new agent started on that
machine later holds a new token: it parks as a standby like any other.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from torch.distributed import DistError, Store
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from lm_resiliency.files import RecordSchema, encode_record, integer, number, parse_record, text
from lm_resiliency.torchrun.launches import beat_key

FENCE_SCHEMA = "lm-resiliency-torchrun-fence/1"
FENCE_RECORD = RecordSchema(what="fence record", identity=("schema", FENCE_SCHEMA), fields={
    "node_id": text(max_length=128), "token": text(max_length=64), "generation": integer(0), "slot": integer(0),
    "silent_s": number(0.0), "fenced_by": text(max_length=128)})

T = TypeVar("T")
# What a store call raises when the store is gone or unreachable (torch wraps some in its own).
STORE_ERRORS = (DistError, RendezvousConnectionError, OSError)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fence:
    """One agent of a launch that may not take part in it again."""

    node_id: str
    """The fenced node's identity (derive_torchrun_node_id)."""
    token: str
    """The fenced agent's claim token: a later agent on the same machine is not fenced."""
    generation: int
    """The generation it was missing from."""
    slot: int
    """Its node slot in that generation."""
    silent_s: float
    """How long its keep-alive counter had stood still when it was fenced."""
    fenced_by: str
    """The node id of the agent that fenced it."""

    def to_json(self) -> dict:
        return {"schema": FENCE_SCHEMA, "node_id": self.node_id, "token": self.token, "generation": self.generation,
                "slot": self.slot, "silent_s": round(self.silent_s, 3), "fenced_by": self.fenced_by}


def fence_key(node_id: str) -> str:
    return f"fenced/{node_id}"


def write_fence(store: Store, fence: Fence) -> Fence:
    """Record `fence` unless another agent fenced that node first; returns the record that holds."""
    held = store.compare_set(fence_key(fence.node_id), "", encode_record(fence.to_json(), FENCE_RECORD).decode())
    return parse_fence(held, f"store key {fence_key(fence.node_id)}")


def parse_fence(data: bytes, where: str) -> Fence:
    doc = parse_record(data, FENCE_RECORD, where)
    return Fence(**{k: v for k, v in doc.items() if k != "schema"})


def own_fence(store: Store, node_id: str, token: str) -> Optional[Fence]:
    """The fence naming this agent (node id and token), if another agent wrote one."""
    key = fence_key(node_id)
    if not store.check([key]):
        return None
    fence = parse_fence(store.get(key), f"store key {key}")
    return fence if fence.token == token else None


class PeerBeats:
    """The keep-alive counters of the other nodes of one generation, seen at each `poll()`: which
    of them stood still for `bound_s` since they last changed (on this host's monotonic clock)."""

    def __init__(self, store: Store, peers: Sequence[Tuple[int, str]], bound_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._bound_s, self._clock = store, bound_s, clock
        self._peers = list(peers)
        self._seen: Dict[str, Tuple[int, float]] = {}

    def poll(self) -> List[Tuple[int, str, float]]:
        """(slot, node id, seconds silent) of every peer whose counter stood still for the bound."""
        silent = []
        for slot, node_id in self._peers:
            count, now = self._store.add(beat_key(node_id), 0), self._clock()
            last = self._seen.get(node_id)
            if last is None or last[0] != count:
                self._seen[node_id] = (count, now)
            elif now - last[1] >= self._bound_s:
                silent.append((slot, node_id, now - last[1]))
        return silent


def within(call: Callable[[], T], timeout_s: float) -> Tuple[bool, Optional[T]]:
    """(True, result) when `call` returns within `timeout_s`; (False, None) when the store failed
    it or it is still blocked (a store call to a host cut off waits for the store's own, much
    longer, timeout). Any other error `call` raises is raised here."""
    outcome: List[Tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except STORE_ERRORS:
            outcome.append((False, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True, name="lm-resiliency-store-probe")
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return False, None
    answered, value = outcome[0]
    if isinstance(value, BaseException):
        raise value
    return answered, value
