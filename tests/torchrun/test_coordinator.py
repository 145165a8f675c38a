"""TorchrunRecoveryCoordinator on real torch stores (FileStore, TCPStore): the initial placement
the agents commit, immutable successors, the lease agents check on their own monotonic clock,
and a latched failure when the store stops answering."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest
from torch.distributed import FileStore, Store, TCPStore

from lm_resiliency.integrations.torchrun import (TorchrunInitialPlacement, TorchrunRecoveryCoordinator,
                                                 TorchrunRecoveryRequest, TorchrunSuccessorPlacement)
from lm_resiliency.torchrun.context import topology_digest
from lm_resiliency.torchrun.coordinator import TorchrunCoordinatorError, check_lease, commit_placement, successor_for
from lm_resiliency.torchrun.launches import LaunchMember
from tests.torchrun.test_backend import _restore_environment  # noqa: F401 - the autouse fixture

_AGENTS: list = []  # the launches' members of the running test: beating until it ends


@pytest.fixture(autouse=True)
def _stop_agents():
    """Every launch a test started stops beating when the test ends (no keep-alive thread outlives it)."""
    yield
    while _AGENTS:
        _AGENTS.pop().stop()


def _launch(store: Store, run_id: str) -> Store:
    """A live launch of `run_id` (an agent that beats), as the agents start one; its part of the store."""
    member = LaunchMember(store, run_id, "n0", beat_interval_s=0.1, expiry_s=1.0)
    member.join()
    _AGENTS.append(member)
    assert member.store is not None
    return member.store


def _committed(tmp_path, run_id: str, nodes=("n0", "n1")):
    store = FileStore(str(tmp_path / "rdzv"))
    commit_placement(_launch(store, run_id), run_id, 0, tuple(nodes))
    return store


def _agents(tmp_path, run_id: str) -> Store:
    """What the agents of the live launch read (their own store client)."""
    from lm_resiliency.torchrun.launches import launch_store

    member = next(m for m in reversed(_AGENTS) if m.run_id == run_id)
    return launch_store(FileStore(str(tmp_path / "rdzv")), run_id, member.launch.launch_id)


def test_initial_placement_is_the_first_generation_the_agents_committed(tmp_path):
    run_id = uuid.uuid4().hex
    _committed(tmp_path, run_id)
    commit_placement(_agents(tmp_path, run_id), run_id, 1, ("n0", "n2"))  # later rounds do not replace it
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), run_id) as coordinator:
        assert coordinator.initial_placement() == TorchrunInitialPlacement(
            run_id, 0, 2, ("n0", "n1"), topology_digest(run_id, 2))
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), "other-run") as coordinator:
        with pytest.raises(TorchrunCoordinatorError, match="run 'other-run' has no live launch .* after 0.5s"):
            coordinator.initial_placement(timeout_s=0.5)


def test_a_successor_is_published_once_and_agents_read_it(tmp_path):
    run_id = uuid.uuid4().hex
    store = _committed(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(store, run_id, renew_interval_s=0.2) as coordinator:
        request = TorchrunRecoveryRequest(generation=1, checkpoint_step=4, deadline_s=30, retire_slots=(1,),
                                          reason="node 1 failed its health check")
        placement = coordinator.publish_successor(request)
        assert isinstance(placement, TorchrunSuccessorPlacement)
        assert (placement.kind, placement.retire_slots, placement.checkpoint_step, placement.trust, placement.nodes) \
            == ("replacement", (1,), 4, "recovery_verified", 2)
        with pytest.raises(TorchrunCoordinatorError, match="already published; successors are immutable"):
            coordinator.publish_successor(request)
        agents = _agents(tmp_path, run_id)
        assert successor_for(agents, run_id, 1, timeout_s=5) == placement
        assert 25 < check_lease(agents, placement) <= 30
        same_node = coordinator.publish_successor(TorchrunRecoveryRequest(generation=2, checkpoint_step=6,
                                                                          deadline_s=30, trust="latest"))
        assert (same_node.kind, same_node.retire_slots) == ("same-node", ())
        with pytest.raises(TorchrunCoordinatorError, match="no successor for generation 3 was published within"):
            successor_for(agents, run_id, 3, timeout_s=0.5)


def test_a_coordinator_manages_the_live_launch_never_an_earlier_one(tmp_path):
    """The endpoint file keeps every launch's keys: a manager started after a relaunch must read
    the new launch's placement, not the one a dead launch committed for the same rounds."""
    run_id = uuid.uuid4().hex
    _committed(tmp_path, run_id, ("n0", "n1"))
    _AGENTS.pop().stop()  # the first launch's agents are gone
    time.sleep(1.2)
    relaunch = _launch(FileStore(str(tmp_path / "rdzv")), run_id)
    commit_placement(relaunch, run_id, 0, ("n0",))
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), run_id) as coordinator:
        assert coordinator.initial_placement().node_ids == ("n0",)
        assert coordinator.launch_id == _AGENTS[-1].launch.launch_id


@pytest.mark.parametrize("change, message", [
    ({"generation": 0}, "generation must be a positive rendezvous round"),
    ({"retire_slots": (2,)}, "retire_slots must be sorted distinct node slots below 2"),
    ({"retire_slots": (1, 0)}, "retire_slots must be sorted"),
    ({"checkpoint_step": -1}, "checkpoint_step must be a non-negative integer"),
    ({"checkpoint_source": "none"}, "'none' only with step 0"),
    ({"trust": "newest"}, "trust must be"),
    ({"deadline_s": 0}, "deadline_s must be a positive number"),
])
def test_invalid_requests_are_refused_before_anything_is_published(tmp_path, change, message):
    run_id = uuid.uuid4().hex
    store = _committed(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(store, run_id) as coordinator:
        values = dict(generation=1, checkpoint_step=4, deadline_s=30.0)
        values.update(change)
        with pytest.raises(TorchrunCoordinatorError, match=message):
            coordinator.publish_successor(TorchrunRecoveryRequest(**values))
        assert not _agents(tmp_path, run_id).check([f"successor/{values['generation']}"])


def test_agents_refuse_a_successor_whose_lease_ran_out_or_stopped(tmp_path):
    run_id = uuid.uuid4().hex
    store = _committed(tmp_path, run_id)
    agents = _agents(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(store, run_id, renew_interval_s=0.2) as coordinator:
        placement = coordinator.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=4,
                                                                          deadline_s=1.0))
        assert 0 < check_lease(agents, placement) <= 1.0
        time.sleep(1.5)  # the deadline passed: the coordinator wrote remaining 0 and stopped renewing
        with pytest.raises(TorchrunCoordinatorError, match="expired or no longer renewed"):
            check_lease(agents, placement)
        alive = coordinator.publish_successor(TorchrunRecoveryRequest(generation=2, checkpoint_step=4,
                                                                      deadline_s=60.0))
        assert check_lease(agents, alive) > 50
    # close() stopped the renewals: the remaining time the store still shows does not count.
    with pytest.raises(TorchrunCoordinatorError, match="expired or no longer renewed"):
        check_lease(agents, alive)


class _FailingStore(Store):
    """A real FileStore whose set() starts failing when `failing` is set (a store outage)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.inner = FileStore(path)
        self.failing = threading.Event()
        self.failures = 0

    def set(self, key, value):
        if self.failing.is_set():
            self.failures += 1
            raise RuntimeError("store unavailable")
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)


def _wait_latched(coordinator: TorchrunRecoveryCoordinator, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            coordinator.check_health()
        except TorchrunCoordinatorError:
            return
        assert time.monotonic() < deadline, f"no renewal failure latched within {timeout_s}s"
        time.sleep(0.1)


def test_transient_renewal_failures_are_retried_and_persistent_ones_latch(tmp_path):
    run_id = uuid.uuid4().hex
    _committed(tmp_path, run_id)
    store = _FailingStore(str(tmp_path / "rdzv"))
    agents = _agents(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(store, run_id, renew_interval_s=0.1, failure_tolerance_s=1.0) as coordinator:
        placement = coordinator.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=2,
                                                                          deadline_s=60))
        store.failing.set()
        time.sleep(0.5)  # shorter than the tolerance: retried, not latched
        store.failing.clear()
        coordinator.check_health()
        assert store.failures >= 2 and check_lease(agents, placement) > 50
        store.failing.set()
        _wait_latched(coordinator, 10)
        with pytest.raises(TorchrunCoordinatorError, match="refused renewals for more than 1s .*store unavailable"):
            coordinator.check_health()
        with pytest.raises(TorchrunCoordinatorError, match="refused renewals"):  # and every later operation
            coordinator.publish_successor(TorchrunRecoveryRequest(generation=2, checkpoint_step=2, deadline_s=60))
        store.failing.clear()
        with pytest.raises(TorchrunCoordinatorError, match="expired or no longer renewed"):
            check_lease(agents, placement)


def test_a_tcp_store_outage_latches_too(tmp_path):
    run_id = uuid.uuid4().hex
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    agent = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    commit_placement(_launch(agent, run_id), run_id, 0, ("n0",))
    coordinator = TorchrunRecoveryCoordinator.from_endpoint(f"127.0.0.1:{server.port}", run_id, store_type="tcp",
                                                            timeout_s=1.0, renew_interval_s=0.1,
                                                            failure_tolerance_s=1.0)
    with coordinator:
        assert coordinator.initial_placement().nodes == 1
        coordinator.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=2, deadline_s=60))
        _AGENTS.pop().stop()
        del server  # the agents' store host is gone
        _wait_latched(coordinator, 20)
        with pytest.raises(TorchrunCoordinatorError, match="refused renewals"):
            coordinator.check_health()


def test_close_run_closes_the_rendezvous_the_agents_use(tmp_path):
    # A closed rendezvous is what makes torch's parked standbys exit (test_backend's parking test).
    handler = _managed_agent(tmp_path, uuid.uuid4().hex)
    try:
        assert not handler.is_closed()
        with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), handler.run_id) as coordinator:
            placement = coordinator.initial_placement()
            assert (placement.generation, placement.nodes, placement.node_ids) == (0, 1, (handler.node_id,))
            coordinator.close_run()
        time.sleep(1.5)  # torch's state holder serves a cached state for up to 1 s
        assert handler.is_closed()
    finally:
        handler.shutdown()


def test_every_agent_of_a_run_must_agree_on_manager_mode(tmp_path, monkeypatch):
    from lm_resiliency.integrations.torchrun import create_rendezvous_handler
    from lm_resiliency.torchrun.backend import RendezvousRefused
    from tests.torchrun.test_backend import _params
    from tests.torchrun.launcher import machine_id_file

    run_id = uuid.uuid4().hex
    monkeypatch.setenv("LM_RESILIENCY_MACHINE_ID_PATH", machine_id_file(str(tmp_path), "a"))
    first = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, lm_resiliency_manager="1"))
    monkeypatch.setenv("LM_RESILIENCY_MACHINE_ID_PATH", machine_id_file(str(tmp_path), "b"))
    with pytest.raises(RendezvousRefused, match="lm_resiliency_manager=0 differs from run"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b"))
    with pytest.raises(RendezvousRefused, match="lm_resiliency_manager='yes': expected 0 or 1"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2, context="ctx-b",
                                          lm_resiliency_manager="yes"))
    first.shutdown()


def _managed_agent(tmp_path, run_id: str):
    from lm_resiliency.integrations.torchrun import create_rendezvous_handler
    from tests.torchrun.test_backend import _params, _use_machine

    _use_machine(tmp_path, "a")
    handler = create_rendezvous_handler(_params(tmp_path, run_id=run_id, lm_resiliency_manager="1"))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    return handler


def test_a_managed_agent_takes_the_successors_step_and_retires_when_its_slot_is_named(tmp_path):
    from lm_resiliency.torchrun import context as ctx
    from lm_resiliency.torchrun.retirement import NodeRetired

    run_id = uuid.uuid4().hex
    handler = _managed_agent(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), run_id, renew_interval_s=0.2) as manager:
        manager.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=0, checkpoint_source="none",
                                                          trust="latest", deadline_s=60, reason="restart fresh"))
        handler.next_rendezvous()
        written = ctx.read_context(str(tmp_path / "ctx-a" / "context.json"))[0]
        assert (written.generation, written.checkpoint_step, written.checkpoint_source, written.trust,
                written.reason) == (1, 0, "none", "latest", "selected by the recovery manager: restart fresh")
        manager.publish_successor(TorchrunRecoveryRequest(generation=2, checkpoint_step=0, checkpoint_source="none",
                                                          deadline_s=60, retire_slots=(0,)))
        with pytest.raises(NodeRetired) as retired:
            handler.next_rendezvous()
        assert retired.value.code == 0
        assert handler.shutdown() and not handler.is_closed()  # leaving does not close the run


def test_a_managed_agent_refuses_a_generation_whose_lease_expired(tmp_path):
    from lm_resiliency.torchrun.backend import RendezvousRefused

    run_id = uuid.uuid4().hex
    handler = _managed_agent(tmp_path, run_id)
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), run_id, renew_interval_s=0.2) as manager:
        manager.publish_successor(TorchrunRecoveryRequest(generation=1, checkpoint_step=0, checkpoint_source="none",
                                                          deadline_s=0.5))
        time.sleep(1.5)
        with pytest.raises(RendezvousRefused, match="generation 1: the lease of successor generation 1 is expired"):
            handler.next_rendezvous()
    from lm_resiliency.torchrun import context as ctx

    assert ctx.read_context(str(tmp_path / "ctx-a" / "context.json"))[0].generation == 0  # no worker may start
    handler.shutdown()


def test_agents_refuse_malformed_coordinator_records(tmp_path):
    run_id = uuid.uuid4().hex
    _committed(tmp_path, run_id)
    agents = _agents(tmp_path, run_id)
    agents.set("successor/1", "not json")
    with pytest.raises(TorchrunCoordinatorError, match="successor/1: not a successor placement: not valid JSON"):
        successor_for(agents, run_id, 1, timeout_s=1)
    with TorchrunRecoveryCoordinator(FileStore(str(tmp_path / "rdzv")), run_id, renew_interval_s=0.2) as manager:
        placement = manager.publish_successor(TorchrunRecoveryRequest(generation=2, checkpoint_step=4, deadline_s=60))
        manager.close()
        agents.set("lease/2", '{"sequence": 9}')
        with pytest.raises(TorchrunCoordinatorError, match=r"lease/2: missing keys \['remaining_s'\] in a lease"):
            check_lease(agents, placement)
