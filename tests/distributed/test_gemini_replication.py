"""Replication safety: in-flight source buffers are never reused; run identity is agreed."""

import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.identity import IdentityMismatch
from lm_resiliency.gemini.replication import PeerReplicator
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _rapid_saves_with_slow_replication(rank, world, folder):
    post = PeerReplicator._post

    def post_slowly(self, outgoing, incoming):
        time.sleep(0.01)  # a slow network: later captures arrive while this send is in flight
        return post(self, outgoing, incoming)

    PeerReplicator._post = post_slowly
    config = InMemoryCkptConfig(replication_jump=1, disk_flush_interval=0, disk_folder=folder,
                                run_id="slow", replication_chunk_size=4096, timeout_s=60)
    manager = InMemoryCheckpointManager(config)
    received = []
    publish = manager._peer.publish

    def check_then_publish(slot, step, structure, owner, extra=None):
        payload = slot.layout.views(slot.buffer)[0]
        received.append((step, sorted(set(payload.tolist()))))
        publish(slot, step, structure, owner, extra)

    manager._peer.publish = check_then_publish
    live = torch.zeros(64 * 1024)
    for step in range(1, 6):
        live.fill_(float(step * 10 + rank))
        manager.save({"w": live}, step)
        manager.maybe_wait()
    manager._drain()
    manager.close()
    return received


def test_in_flight_source_is_never_overwritten(tmp_path):
    results = run_ranks(_rapid_saves_with_slow_replication, 2, str(tmp_path), timeout=120)
    for rank, received in enumerate(results):
        peer = 1 - rank
        # Every received replica is uniform and holds exactly the peer's value for that step.
        assert received == [(step, [float(step * 10 + peer)]) for step in range(1, 6)]


def _mismatched_run_ids(rank, world, folder):
    config = InMemoryCkptConfig(run_id=f"run-{rank}", disk_folder=folder, replication_jump=1, timeout_s=30)
    try:
        InMemoryCheckpointManager(config)
    except IdentityMismatch as exc:
        return str(exc)
    return "constructed"


def test_ranks_disagreeing_on_run_id_fail_closed(tmp_path):
    for message in run_ranks(_mismatched_run_ids, 2, str(tmp_path), timeout=60):
        assert "ranks disagree on the GEMINI run id" in message


def _agreed_fresh_id(rank, world, folder):
    manager = InMemoryCheckpointManager(InMemoryCkptConfig(disk_folder=folder, replication_jump=1))
    run_id, topology = manager.run_id, manager.topology
    manager.close()
    return run_id, topology


def test_fresh_run_id_and_topology_are_agreed(tmp_path, monkeypatch):
    monkeypatch.delenv("LM_RESILIENCY_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first = run_ranks(_agreed_fresh_id, 3, str(tmp_path), timeout=60)
    second = run_ranks(_agreed_fresh_id, 3, str(tmp_path), timeout=60)
    assert len(set(first)) == 1 and len(set(second)) == 1
    assert first[0][0] != second[0][0], "a new job must not inherit an unrelated job's files"
    assert first[0][1] == second[0][1], "same layout, same topology fingerprint"


def _env_run_id(rank, world, folder):
    return _agreed_fresh_id(rank, world, folder)[0]


def test_launcher_run_id_is_used(tmp_path):
    assert run_ranks(_env_run_id, 2, str(tmp_path), env={"TORCHELASTIC_RUN_ID": "elastic-7"}) == ["elastic-7"] * 2


def _bad_jump(rank, world, folder):
    try:
        InMemoryCheckpointManager(InMemoryCkptConfig(disk_folder=folder, replication_jump=4))
    except ValueError as exc:
        return str(exc)
    return "constructed"


def test_invalid_jump_is_rejected_with_field_name(tmp_path):
    for message in run_ranks(_bad_jump, 2, str(tmp_path), timeout=60):
        assert message.startswith("InMemoryCkptConfig.replication_jump: 4 is not a valid rank distance")
