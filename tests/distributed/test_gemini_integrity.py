"""verify_integrity end to end: the capture checksum travels with the bytes and is checked at every
hand-off. Real gloo ranks and fresh processes."""

import os
import signal
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.replication import PeerReplicator
from lm_resiliency.gemini.storage import ShardKey
from tests.distributed.gemini_workloads import assert_same, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _config(tmp, **kw):
    base = dict(replication_jump=1, disk_flush_interval=0, disk_folder=os.path.join(tmp, "disk"),
                shared_memory_dir=os.path.join(tmp, "shm"), run_id="integrity", replication_chunk_size=4096,
                timeout_s=20, verify_integrity=True)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _flip_newest_own_slot(manager):
    """A bit flips in host RAM after the capture (the slot is a shared-memory segment)."""
    slot = manager._own.ready_slots()[0]
    slot.buffer[slot.layout.total_bytes // 2] ^= 0x04
    return slot


def _corrupt_then_die(rank, world, tmp, how):
    manager, _, _, expected = train(rank, 4, _config(tmp), save_every=2)
    manager._drain()
    torch.save(expected, os.path.join(tmp, f"expected-{rank}.pt"))
    flushed = None
    if rank == 0:
        slot = _flip_newest_own_slot(manager)
        if how == "flush":
            flushed = manager.flush_now()  # must refuse the corrupt step 4 (writes step 2 instead)
        else:
            # What a flush without the capture checksum did: the corrupt bytes go to disk under a
            # fresh, valid file CRC.
            manager.store.write_shard(ShardKey("own", 0, slot.step), slot.layout, slot.structure,
                                      slot.payload(), extra=slot.extra)
        with open(os.path.join(tmp, "flushed"), "w") as f:
            f.write(str(flushed))
    while not os.path.exists(os.path.join(tmp, "flushed")):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _recover(rank, world, tmp):
    manager = InMemoryCheckpointManager(_config(tmp))
    step = manager.find_latest()
    sources = dict(manager.recovery_sources)
    state = manager.load()
    manager.close()
    return step, sources, state


def _check_recovered_from_peer(tmp, recovered):
    for rank, (step, sources, state) in enumerate(recovered):
        exp_step, expected = torch.load(os.path.join(tmp, f"expected-{rank}.pt"), weights_only=False)
        assert step == exp_step == 4
        assert_same(state, expected)
    # Rank 0's own copy of step 4 (shared memory, and the disk copy if any) was refused: its state
    # came from the replica rank 1 holds.
    assert recovered[0][1] == {}
    assert recovered[1][1] == {"own:1": "shared-memory", "held:0": "shared-memory"}


def test_flush_refuses_bytes_corrupted_after_capture_and_recovery_uses_the_peer_replica(tmp_path):
    tmp = str(tmp_path)
    outcomes = run_ranks(_corrupt_then_die, 2, tmp, "flush", timeout=90, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2, [o.error for o in outcomes]
    with open(os.path.join(tmp, "flushed")) as f:
        assert f.read() == "2"
    _check_recovered_from_peer(tmp, run_ranks(_recover, 2, tmp, timeout=90))


def test_corrupt_shared_slot_never_falls_back_to_a_disk_copy_of_the_same_bytes(tmp_path):
    tmp = str(tmp_path)
    outcomes = run_ranks(_corrupt_then_die, 2, tmp, "disk", timeout=90, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2, [o.error for o in outcomes]
    _check_recovered_from_peer(tmp, run_ranks(_recover, 2, tmp, timeout=90))


def _corrupted_in_transit(rank, world, tmp):
    if rank == 0:
        original = PeerReplicator._exchange_bytes

        def corrupting(self, outgoing, incoming, tails):
            if self._corrupt:
                outgoing = outgoing.clone()
                outgoing[outgoing.numel() // 3] ^= 0x01  # the wire flips a bit; the slot itself is intact
            original(self, outgoing, incoming, tails)

        PeerReplicator._corrupt = False
        PeerReplicator._exchange_bytes = corrupting
    manager, _, _, _ = train(rank, 2, _config(tmp), save_every=2)
    manager._drain()
    if rank == 0:
        PeerReplicator._corrupt = True
    manager.save({"w": torch.full((256,), float(rank))}, 4)
    error = None
    try:
        manager._drain()
    except Exception as exc:  # the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    held = [(s.owner_rank, s.step) for s in manager._peer.ready_slots()]
    manager.close()
    return error, held


def test_replica_corrupted_in_transit_is_refused_by_the_receiver(tmp_path):
    results = run_ranks(_corrupted_in_transit, 2, str(tmp_path), timeout=90)
    assert results[0] == (None, [(1, 4), (1, 2)])
    error, held = results[1]
    assert error.startswith("IntegrityError: GEMINI replication: refused rank 0's replica of step 4")
    assert "CRC-32 mismatch in chunk 0" in error
    assert held == [(0, 2)]  # never published: the previous replica stays the newest


def _bad_header_then_save(rank, world, tmp):
    from lm_resiliency.gemini import replication

    manager, _, _, _ = train(rank, 2, _config(tmp, timeout_s=300), save_every=2)
    manager._drain()
    if rank == 0:  # rank 0 announces one chunk too few: rank 1 refuses the header, posts no chunk
        original = replication.chunk_tails
        replication.chunk_tails = lambda payload, size: original(payload, size)[:-2]
    manager.save({"w": torch.full((64 * 1024,), float(rank))}, 4)
    try:
        manager._drain()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = f"{type(exc).__name__}: {exc}"
    released = os.path.join(tmp, f"released{rank}")
    if rank == 1:
        # Like a survivor whose training thread is stuck elsewhere: the group is not closed yet.
        others = [os.path.join(tmp, f"released{r}") for r in (0, 2)]
        deadline = time.monotonic() + 60
        while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
            time.sleep(0.1)
        released_before_close = all(map(os.path.exists, others))
    else:
        open(released, "w").close()
        released_before_close = None
    manager.close()
    return error, released_before_close


def test_a_failed_exchange_releases_the_ranks_chained_to_it(tmp_path):
    """Rank 1 refuses rank 0's header and never posts its chunks. Rank 2 waits for those chunks
    and rank 0 sends to rank 1: before GEMINI aborted its group on a failed exchange, both
    waited until rank 1 closed the group or timeout_s (300 s) passed, which kept survivors of a
    SIGKILLed peer alive for minutes. Now both get their error while rank 1 still holds it."""
    results = run_ranks(_bad_header_then_save, 3, str(tmp_path), timeout=120)
    errors = [error for error, _ in results]
    assert "rank 0 announced" in errors[1] and "not one final byte per 4096-byte chunk" in errors[1], errors
    assert "sending to rank 0 and receiving from rank 1" in errors[2], errors
    assert errors[0] is not None and "sending to rank 1 and receiving from rank 2" in errors[0], errors
    assert results[1][1] is True, "ranks 0 and 2 stayed blocked until rank 1 closed its group"
