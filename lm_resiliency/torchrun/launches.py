"""Which launch of a run an agent belongs to.

A run (`--rdzv-id`) is launched again and again: a requeued job, a relaunch after a crash, a
`store_type=file` endpoint whose file survives every launch. Rendezvous rounds (generations) start
at 0 in each launch, so nothing the agents exchange or leave on disk may be keyed by run and
generation alone. The agents agree on a launch id in the store (`lm_resiliency/<run id>/launch`):
the first agent that finds no live launch starts one with a fresh random id, every later agent joins
it while some agent of it still beats. Each agent adds 1 to the launch's keep-alive counter every
`beat_interval_s` (and, once it holds its node identity, to that node's counter); a launch, or a
node identity, whose counter did not advance for `expiry_s` on the observer's monotonic clock is
gone. Everything the agents and a recovery manager exchange for a launch lives under
`lm_resiliency/<run id>/launch/<launch id>/`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

from torch.distributed import PrefixStore, Store

from lm_resiliency.files import RecordRejected, RecordSchema, encode_record, number, parse_record, text

logger = logging.getLogger(__name__)

LAUNCH_SCHEMA = "lm-resiliency-torchrun-launch/1"
LAUNCH_KEY = "launch"
LAUNCH_BEAT = "beat"
_HEX_ID = 32
_POLL_S = 0.05

LAUNCH_RECORD = RecordSchema(what="launch record", identity=("schema", LAUNCH_SCHEMA), fields={
    "launch_id": text(max_length=_HEX_ID), "beat_interval_s": number(0.01, 3600.0),
    "expiry_s": number(0.03, 86400.0)})


class LaunchError(RecordRejected):
    """The run's launch record is malformed, or this agent may not take the identity it asked for."""


def run_store(store: Store, run_id: str) -> Store:
    """What every launch of run `run_id` shares (the launch record, retired node ids)."""
    return PrefixStore(f"lm_resiliency/{run_id}/", store)


def node_key(node_id: str) -> str:
    """The launch-store key holding the claim token of the agent that holds node identity `node_id`."""
    return f"node/{node_id}"


def beat_key(node_id: str) -> str:
    """The launch-store key of node `node_id`'s keep-alive counter."""
    return f"beat/{node_id}"


def launch_store(store: Store, run_id: str, launch_id: str) -> Store:
    """The part of the rendezvous store one launch's agents and its recovery manager share."""
    return PrefixStore(f"lm_resiliency/{run_id}/launch/{launch_id}/", store)


def inner_run_id(run_id: str, launch_id: str) -> str:
    """The run id torch's own rendezvous runs under in one launch: its state (round, participants,
    closed) starts afresh in every launch, as it does over a new TCP store."""
    return f"{run_id}/launch/{launch_id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """One launch of a run: its id and how its agents show they are alive."""

    launch_id: str
    """32 hex digits, new for every launch."""
    beat_interval_s: float
    """How often every agent of the launch adds to its keep-alive counter."""
    expiry_s: float
    """How long a counter may stand still before its launch (or node) counts as gone."""

    def to_json(self) -> dict:
        return {"schema": LAUNCH_SCHEMA, "launch_id": self.launch_id, "beat_interval_s": self.beat_interval_s,
                "expiry_s": self.expiry_s}


def parse_launch(data: bytes, where: str) -> Launch:
    doc = parse_record(data, LAUNCH_RECORD, where, error=LaunchError)
    return Launch(launch_id=doc["launch_id"], beat_interval_s=float(doc["beat_interval_s"]),
                  expiry_s=float(doc["expiry_s"]))


def advances(store: Store, key: str, window_s: float) -> bool:
    """Whether the counter at `key` changes within `window_s` (this host's monotonic clock)."""
    first = store.add(key, 0)
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        if store.add(key, 0) != first:
            return True
    return False


def live_launch(store: Store, run_id: str, timeout_s: float) -> Launch:
    """The live launch of `run_id` (some agent of it beats), waiting up to `timeout_s` for one:
    a recovery manager's view. Raises LaunchError when none appears."""
    run = run_store(store, run_id)
    deadline = time.monotonic() + timeout_s
    while True:
        if run.check([LAUNCH_KEY]):
            launch = parse_launch(run.get(LAUNCH_KEY), f"store key lm_resiliency/{run_id}/{LAUNCH_KEY}")
            if advances(launch_store(store, run_id, launch.launch_id), LAUNCH_BEAT, launch.expiry_s):
                return launch
        if time.monotonic() >= deadline:
            raise LaunchError(f"run {run_id!r} has no live launch in the rendezvous store after {timeout_s:g}s "
                              "(no torchrun agent of it beats): have the agents started?")
        time.sleep(0.2)


class LaunchMember:
    """This agent's part in a launch: `join()` the live one or start a new one, `claim_node()`
    its node identity in it, keep-alive beats from a daemon thread until `stop()`."""

    def __init__(self, store: Store, run_id: str, node_id: str, *, beat_interval_s: float, expiry_s: float) -> None:
        self.run_id = run_id
        self.node_id = node_id
        self._raw = store
        self._run = run_store(store, run_id)
        self._wanted = Launch(launch_id=uuid.uuid4().hex, beat_interval_s=beat_interval_s,
                              expiry_s=max(expiry_s, 3 * beat_interval_s))
        self.launch: Optional[Launch] = None
        self.store: Optional[Store] = None
        self._node_claimed = False
        self._last_beat: Optional[float] = None  # monotonic time of the last beat the store took
        self._longest_silence_s = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def join(self) -> Launch:
        """The launch this agent belongs to: the run's live launch, or a new one when there is none
        (no record yet, or the recorded launch's agents stopped beating: it ended or was killed)."""
        mine = encode_record(self._wanted.to_json(), LAUNCH_RECORD).decode()
        where = f"store key lm_resiliency/{self.run_id}/{LAUNCH_KEY}"
        while True:
            held = self._run.compare_set(LAUNCH_KEY, "", mine).decode()
            if held == mine:
                launch = self._wanted
                logger.info("lm_resiliency rendezvous: node %s starts launch %s of run %r", self.node_id[:12],
                            launch.launch_id[:12], self.run_id)
                break
            launch = parse_launch(held.encode(), where)
            if advances(launch_store(self._raw, self.run_id, launch.launch_id), LAUNCH_BEAT, launch.expiry_s):
                logger.info("lm_resiliency rendezvous: node %s joins launch %s of run %r", self.node_id[:12],
                            launch.launch_id[:12], self.run_id)
                break
            logger.warning("lm_resiliency rendezvous: launch %s of run %r has no live agent (no keep-alive for "
                           "%gs): it ended; starting a new launch", launch.launch_id[:12], self.run_id,
                           launch.expiry_s)
            self._run.compare_set(LAUNCH_KEY, held, mine)  # whoever replaces it first, the loop re-reads
        self.launch = launch
        self.store = launch_store(self._raw, self.run_id, launch.launch_id)
        self._start()
        return launch

    def claim_node(self, token: str) -> None:
        """Hold this node's identity in the launch. Refused (LaunchError) while another live agent
        holds it; taken over from an agent that stopped beating (it died; this one replaces it)."""
        assert self.store is not None and self.launch is not None, "join() first"
        key, beat = node_key(self.node_id), beat_key(self.node_id)
        while True:
            held = self.store.compare_set(key, "", token).decode()
            if held == token:
                break
            if advances(self.store, beat, self.launch.expiry_s):
                raise LaunchError(
                    f"node identity {self.node_id[:12]} (from the machine id) is already registered in run "
                    f"{self.run_id!r} by another agent that is still alive: two agents share one machine id. Give "
                    "each node its own /etc/machine-id (or LM_RESILIENCY_MACHINE_ID_PATH file)")
            logger.warning("lm_resiliency rendezvous: the previous agent of node %s in launch %s stopped beating "
                           "%gs ago; this agent takes its place", self.node_id[:12], self.launch.launch_id[:12],
                           self.launch.expiry_s)
            self.store.compare_set(key, held, token)
        self._node_claimed = True
        self.beat()

    def current(self) -> bool:
        """Whether this agent's launch is still the run's launch (another launch replaces it only
        after every agent of it stopped beating: a stalled agent finds out here)."""
        assert self.launch is not None
        try:
            held = parse_launch(self._run.get(LAUNCH_KEY), "launch record")
        except LaunchError:
            return False
        return held.launch_id == self.launch.launch_id

    def beat(self) -> None:
        if self.store is None:
            return
        self.store.add(LAUNCH_BEAT, 1)
        if self._node_claimed:
            self.store.add(beat_key(self.node_id), 1)
        now = time.monotonic()
        if self._last_beat is not None:
            self._longest_silence_s = max(self._longest_silence_s, now - self._last_beat)
        self._last_beat = now

    def longest_silence_s(self) -> float:
        """The longest time this agent's keep-alive did not reach the store since it joined, the
        silence going on now included: what the other agents saw of it (fencing.py)."""
        if self._last_beat is None:
            return 0.0
        return max(self._longest_silence_s, time.monotonic() - self._last_beat)

    def stop(self) -> None:
        """Stops the keep-alive; returns once its thread has ended (a beat in flight gets 5 s to finish)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _start(self) -> None:
        self.beat()
        assert self.launch is not None
        member, interval, stop = weakref.ref(self), self.launch.beat_interval_s, self._stop
        self._thread = threading.Thread(target=_beat_until_stopped, args=(member, interval, stop), daemon=True,
                                        name=f"lm-resiliency-launch-{self.launch.launch_id[:8]}")
        self._thread.start()


def _beat_until_stopped(member: "weakref.ref[LaunchMember]", interval_s: float, stop: threading.Event) -> None:
    """Beats while the member exists and is not stopped (a handler dropped without shutdown() stops too)."""
    failing = False
    while not stop.wait(interval_s):
        owner = member()
        if owner is None:
            return
        try:
            owner.beat()
            failing = False
        except Exception as exc:  # noqa: BLE001 - store clients raise several types; retried next beat
            if not failing:
                logger.warning("lm_resiliency rendezvous: keep-alive of launch %s failed, retrying: %s",
                               owner.launch.launch_id[:12] if owner.launch else "?", exc)
            failing = True
        del owner
