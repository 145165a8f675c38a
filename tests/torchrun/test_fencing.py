"""Fencing (lm_resiliency/torchrun/fencing.py) over torch's real FileStore and real rendezvous
handlers: a node whose keep-alive stood still for the fence bound is fenced by the agents that
still reach the store, and an agent cut off for the bound, or fenced, leaves the run without
closing it. tests/lab/test_lab_partition.py cuts a real link."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from torch.distributed import FileStore

from lm_resiliency.integrations.torchrun import create_rendezvous_handler
from lm_resiliency.torchrun.backend import RendezvousRefused
from lm_resiliency.torchrun.fencing import Fence, PeerBeats, own_fence, within, write_fence
from lm_resiliency.torchrun.launches import launch_store
from tests.torchrun.test_backend import _params, _restore_environment, _use_machine  # noqa: F401 - autouse

FAST = {"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}  # fence bound 4 s


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_whose_counter_stands_still_for_the_bound_is_silent(tmp_path):
    store, clock = FileStore(str(tmp_path / "store")), _Clock()
    beats = PeerBeats(store, [(0, "a"), (2, "c")], 4.0, clock)
    assert beats.poll() == []
    for _ in range(4):
        clock.now += 1.5
        store.add("beat/a", 1)  # a keeps beating, c never does
        silent = beats.poll()
    assert silent == [(2, "c", 6.0)]
    store.add("beat/c", 1)  # c beats again: silent no more, and its silence counts from now
    clock.now += 3.9
    store.add("beat/a", 1)
    assert beats.poll() == []


def test_the_first_fence_holds_and_names_one_agent_only(tmp_path):
    store = FileStore(str(tmp_path / "store"))
    first = Fence(node_id="n1", token="t1", generation=3, slot=1, silent_s=4.2, fenced_by="n0")
    assert write_fence(store, first) == first
    assert write_fence(store, Fence(node_id="n1", token="t1", generation=3, slot=1, silent_s=9.0,
                                    fenced_by="n2")) == first
    assert own_fence(store, "n1", "t1") == first
    assert own_fence(store, "n1", "a-later-agent") is None  # a new agent on that machine is not fenced
    assert own_fence(store, "n0", "t0") is None


def test_within_tells_a_blocked_or_failed_store_call_from_an_answer():
    assert within(lambda: 7, 1.0) == (True, 7)
    release = threading.Event()
    started = time.monotonic()
    assert within(lambda: release.wait(30), 0.3) == (False, None)
    assert time.monotonic() - started < 5
    release.set()

    def store_gone() -> None:
        raise ConnectionResetError("Connection reset by peer")

    assert within(store_gone, 1.0) == (False, None)

    def bug() -> None:
        raise KeyError("not a store error")

    with pytest.raises(KeyError, match="not a store error"):
        within(bug, 1.0)


def handlers_of(tmp_path, run_id: str, machines: str, max_nodes: int) -> list:
    """One agent per machine name of a run of at least 2 nodes (fence bound 4 s)."""
    handlers = []
    for name in machines:
        _use_machine(tmp_path, name)
        handlers.append(create_rendezvous_handler(_params(tmp_path, run_id=run_id, min_nodes=2, max_nodes=max_nodes,
                                                          context=f"ctx-{name}", **FAST)))
    return handlers


def start_joining(handlers: list) -> tuple:
    """Each handler's next_rendezvous() in a thread of its own: (threads, {index: RendezvousInfo})."""
    infos: dict = {}

    def join(index: int) -> None:
        infos[index] = handlers[index].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    return threads, infos


def _two_active(tmp_path, run_id: str):
    """Two agents of a 2-node run (machines a and b) after their first generation formed."""
    handlers = handlers_of(tmp_path, run_id, "ab", 2)
    threads, infos = start_joining(handlers)
    for thread in threads:
        thread.join(120)
    assert len(infos) == 2, "the 2-node generation did not form"
    return handlers


def test_the_agents_fence_a_silent_peer_and_the_fenced_agent_leaves_without_closing_the_run(tmp_path):
    run_id = uuid.uuid4().hex
    active, silent = _two_active(tmp_path, run_id)
    try:
        assert active.num_nodes_waiting() == 0
        silent._member.stop()  # its keep-alive stops reaching the store, as when its host is cut off
        deadline = time.monotonic() + 30
        while active.num_nodes_waiting() == 0:  # > 0: torch's agent stops the workers and rejoins
            assert time.monotonic() < deadline, "the silent peer was never fenced"
            time.sleep(0.2)
        store = launch_store(FileStore(str(tmp_path / "rdzv")), run_id, active.launch_id)
        fence = own_fence(store, silent.node_id, silent._token)
        assert fence is not None and fence.fenced_by == active.node_id and fence.silent_s >= 4.0
        assert fence.generation == 0 and fence.slot in (0, 1)
        assert silent.num_nodes_waiting() == 1  # its own silence: it stops its workers without the store
        with pytest.raises(RendezvousRefused, match=r"leaves run '\w+': node \w+ FENCED it in generation 0 after "
                           r"[\d.]+s without its keep-alive \(lost or cut off from the store\)\. It stopped its "
                           r"workers and may not rejoin launch"):
            silent.next_rendezvous()
        assert silent.shutdown() and not active.is_closed()  # leaving does not end the run for the others
    finally:
        for handler in (silent, active):
            handler.shutdown()


def test_an_agent_that_finds_its_own_fence_record_leaves(tmp_path):
    run_id = uuid.uuid4().hex
    first, second = _two_active(tmp_path, run_id)
    try:
        store = launch_store(FileStore(str(tmp_path / "rdzv")), run_id, first.launch_id)
        write_fence(store, Fence(node_id=second.node_id, token=second._token, generation=0, slot=1, silent_s=5.0,
                                 fenced_by=first.node_id))
        deadline = time.monotonic() + 10
        while second.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline, "the fenced agent did not stop its workers"
            time.sleep(0.2)
        with pytest.raises(RendezvousRefused, match="FENCED it in generation 0 after 5.0s without its keep-alive"):
            second.next_rendezvous()
    finally:
        for handler in (second, first):
            handler.shutdown()
