"""What a host keeps in other ranks' directories (gemini/foreign.py), the exclusive takeover of a
shared-memory rank directory, and a failed recovery that keeps the state the next attempt needs."""

import fcntl
import os

import pytest
import torch

from lm_resiliency.gemini import shm
from lm_resiliency.gemini.foreign import claim_memory, open_disks
from lm_resiliency.gemini.manager import RecoveryUnavailable
from lm_resiliency.gemini.shm import SharedMemoryUnavailable
from lm_resiliency.gemini.slots import SlotPair
from lm_resiliency.gemini.storage import NodeLocalStore, ShardKey
from lm_resiliency.codec import Layout, encode_state
from tests.distributed.gemini_workloads import assert_same
from tests.unit.test_shm import RUN, TOPO, _manager, crash, make_arena, sample_state


def _capture(arena, name_role, state, step, owner):
    pair = SlotPair(name_role, arena.allocate, 5.0, mirror=arena)
    enc = encode_state(state)
    layout = Layout.for_tensors(enc.tensors)
    slot = pair.begin_write(layout)
    for view, tensor in zip(layout.views(slot.buffer), enc.tensors):
        view.copy_(tensor)
    pair.publish(slot, step, enc.structure, owner, {})
    return pair


def _claim(tmp_path, rank):
    return claim_memory(str(tmp_path / "shm"), RUN, TOPO, series=str(tmp_path / "disk"), rank=rank, world_size=4,
                        jump=2, verify_integrity=False, pin_memory=False, reap_other_runs_after_s=86400.0,
                        timeout_s=5.0)


def test_a_dead_ranks_slots_are_claimed_once_and_a_live_ranks_are_left_alone(tmp_path):
    # Rank 2 ran here (its own state and rank 0's replica), then moved away or died.
    dead = make_arena(tmp_path, rank=2, peer_owner=0)
    _capture(dead, "own", sample_state(2), 6, owner=2)
    _capture(dead, "peer", sample_state(0), 6, owner=0)
    crash(dead)
    live = make_arena(tmp_path, rank=3, peer_owner=1)  # rank 3 still runs here
    _capture(live, "own", sample_state(3), 6, owner=3)

    (claimed,) = _claim(tmp_path, rank=0)
    assert claimed.rank == 2
    held = {slot.owner_rank: slot for pair in claimed.pairs for slot in pair.ready_slots()}
    assert sorted(held) == [0, 2] and {s.step for s in held.values()} == {6}
    own = next(p for p in claimed.pairs if p.role == "own")
    with pytest.raises(RuntimeError, match="never written"):
        own.begin_write(Layout.for_tensors(encode_state(sample_state(9)).tensors))
    assert _claim(tmp_path, rank=1) == []  # already claimed: never mapped by a second claimer
    claimed.close(keep=True)
    live.close(keep=False)
    (again,) = _claim(tmp_path, rank=1)  # the claimer is gone: the next recovery claims it again
    assert again.rank == 2
    again.close(keep=False)
    assert _claim(tmp_path, rank=0) == []  # closed without keep: removed


def test_a_takeover_waits_for_a_concurrent_one_and_never_shares_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "_TAKEOVER_LOCK_S", 0.2, raising=False)
    first = make_arena(tmp_path, rank=0)
    crash(first)
    fd = os.open(first.directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process of this host is taking it over right now
        with pytest.raises(SharedMemoryUnavailable, match="being taken over by another process"):
            make_arena(tmp_path, rank=0)
    finally:
        os.close(fd)
    make_arena(tmp_path, rank=0).close(keep=False)


def test_other_ranks_node_local_directories_are_opened_for_reading(tmp_path):
    root = str(tmp_path / "disk")
    enc = encode_state(sample_state(5))
    layout = Layout.for_tensors(enc.tensors)
    payload = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for view, tensor in zip(layout.views(payload), enc.tensors):
        view.copy_(tensor)
    for rank in (0, 2, 7):
        NodeLocalStore(root, RUN, TOPO, rank, verify_integrity=False)
    NodeLocalStore(root, RUN, TOPO, 2, verify_integrity=False).write_shard(ShardKey("peer", 0, 6), layout,
                                                                           enc.structure, payload)
    stores = open_disks(root, RUN, TOPO, rank=0, world_size=4, verify_integrity=False, timeout_s=5.0, sharing={0})
    assert [s.rank for s in stores] == [2]  # not its own, not a rank outside the world
    # Rank 2 runs with its own directory on this disk now: it reads it itself.
    assert open_disks(root, RUN, TOPO, rank=0, world_size=4, verify_integrity=False, timeout_s=5.0,
                      sharing={0, 2}) == []
    assert stores[0].list_shards() == [ShardKey("peer", 0, 6)]
    assert torch.equal(stores[0].read_shard(ShardKey("peer", 0, 6)).payload, payload)


def test_a_failed_recovery_keeps_the_shared_memory_the_next_attempt_recovers_from(tmp_path):
    first = _manager(tmp_path)
    first.save(sample_state(2), 2)
    first.maybe_wait()
    first.close(keep_shared=True)
    second = _manager(tmp_path)
    with pytest.raises(RecoveryUnavailable) as refused:
        second.find_latest(step=4)  # a step the agents selected that this node does not hold
    second.close()  # an ordinary close after the failure: the slots stay
    third = _manager(tmp_path)
    assert third.find_latest() == 2 and third.recovery_sources == {"own:0": "shared-memory"}
    assert_same(third.load(), sample_state(2))
    third.close()
    assert "no rank holds a usable copy of rank 0 at step 4" in str(refused.value)
