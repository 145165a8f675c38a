"""GEMINI transfers over real gloo pairs: short messages are refused, one-sided failures and
killed peers end in clear errors (never SIGABRT), pins are released, waits are bounded."""

import glob
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, wire
from lm_resiliency.experimental import InMemoryCheckpointManager, RecoveryUnavailable
from lm_resiliency.gemini.replication import PeerReplicator
from lm_resiliency.gemini.workers import BackgroundError
from tests.distributed.gemini_workloads import assert_same
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _config(folder, **kw):
    base = dict(replication_jump=1, disk_flush_interval=0, disk_folder=str(folder), run_id="wire",
                replication_chunk_size=512, timeout_s=4, host_memory="heap")
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _state(rank, step):
    """A deterministic state per (rank, step): the expected value is recomputed, not returned."""
    base = torch.arange(3001, dtype=torch.float32) * step + rank
    return {"w": base, "b": base[:77].to(torch.bfloat16), "ids": torch.arange(13) * rank,
            "meta": {"step": step, "rank": rank}}


def _save(manager, rank, step):
    manager.save(_state(rank, step), step)
    manager.maybe_wait()
    manager._replication_worker.wait_idle(30)


# ----------------------------------------------------------------- item 4: byte counts


def _short_json(rank, world):
    group = dist.new_group(backend="gloo")
    if rank == 0:
        payload = wire.encode_json({"text": "x" * 100})
        dist.isend(wire.frame(payload), 1, group=group).wait()
        dist.isend(payload[:-5], 1, group=group).wait()  # five bytes fewer than announced
        return None
    try:
        wire.recv_json(0, group, timeout_s=10)
    except wire.ShortMessage as exc:
        return str(exc)
    return "accepted"


def test_json_shorter_than_announced_is_refused():
    assert run_ranks(_short_json, 2, timeout=60)[1] == \
        "rank 0 sent fewer than the 111 bytes it announced; the partial data is discarded"


def _short_replica(rank, world, folder):
    if rank == 0:
        exchange_bytes = PeerReplicator._exchange_bytes

        def three_bytes_short(self, outgoing, *rest):
            return exchange_bytes(self, outgoing[:-3], *rest)

        PeerReplicator._exchange_bytes = three_bytes_short
    manager = InMemoryCheckpointManager(_config(folder))
    manager.save(_state(rank, 1), 1)
    try:
        manager._drain()
        return "accepted", [s.step for s in manager._peer.ready_slots()]
    except BackgroundError as exc:
        return str(exc), [s.step for s in manager._peer.ready_slots()]
    finally:
        manager.close()


def test_replica_chunk_shorter_than_announced_is_refused(tmp_path):
    (zero, zero_held), (one, one_held) = run_ranks(_short_replica, 2, str(tmp_path), timeout=90)
    assert zero == "accepted" and zero_held == [1]
    assert one == ("GEMINI background replication failed: step 1, sending to rank 0 and receiving from "
                   "rank 0: rank 0 sent fewer than the 64 bytes it announced; the partial data is discarded")
    assert one_held == [], "a short replica is never published"


def _recover_from_holder(rank, world, folder, tamper):
    """Rank 1 forgets its own slots, so its state must come from rank 0's replica; rank 0
    applies `TAMPER[tamper]` to what it sends."""
    manager = InMemoryCheckpointManager(_config(folder))
    _save(manager, rank, 1)
    if rank == 1:
        manager._own.discard()
    else:
        TAMPER[tamper](manager)
    try:
        step = manager.find_latest()
        return step, manager.load()
    except (RecoveryUnavailable, TimeoutError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        manager.close()


def _send_short_payload(manager):
    parts = manager._source_parts

    def short(name):
        layout, structure, payload, extra = parts(name)
        return (layout, structure, payload[:-3] if name.startswith("held:") else payload, extra)

    manager._source_parts = short


def test_recovery_payload_shorter_than_agreed_is_refused(tmp_path):
    outcomes = run_ranks(_recover_from_holder, 2, str(tmp_path), "short_payload", timeout=90)
    kind, message = outcomes[1]
    assert kind == "ShortMessage" and message.startswith("rank 0 announced ") and \
        message.endswith(" bytes where %d were agreed" % (int(message.split()[3]) + 3))


# ------------------------------------------------------- item 15: recovery header checks


def _header_rewriter(change):
    def tamper(manager):
        send_json = wire.send_json

        def rewrite(value, *args, **kwargs):
            if isinstance(value, dict) and "layout" in value:
                value = change(dict(value))
            return send_json(value, *args, **kwargs)

        wire.send_json = rewrite
    return tamper


def _without_structure(header):
    del header["structure"]
    return header


def _huge_layout(header):
    header["layout"] = {"total_bytes": 35 * 10 ** 12, "tensors": []}
    return header


TAMPER = {"short_payload": _send_short_payload, "no_structure": _header_rewriter(_without_structure),
          "huge_layout": _header_rewriter(_huge_layout)}


@pytest.mark.parametrize("tamper, why", [
    ("no_structure", "missing ['structure']"),
    ("huge_layout", "its layout holds 35000000000000 bytes, rank 0 reported "),
])
def test_recovery_header_is_checked_before_allocating(tmp_path, tamper, why):
    outcomes = run_ranks(_recover_from_holder, 2, str(tmp_path), tamper, timeout=90)
    kind, message = outcomes[1]
    assert kind == "RecoveryUnavailable"
    assert message.startswith(f"GEMINI recovery: rank 1 refuses the replica header from rank 0: {why}")
    assert message.endswith("; nothing is loaded")


# ------------------------------------------- item 8: one-sided failure between header and payload


def _fail_after_header_then_continue(rank, world, folder):
    manager = InMemoryCheckpointManager(_config(folder, timeout_s=3))
    errors = []
    if rank == 1:
        begin_write = manager._peer.begin_write
        calls = []

        def fail_second(layout):
            calls.append(layout)
            if len(calls) == 2:
                raise RuntimeError("injected: no slot for the replica")
            return begin_write(layout)

        manager._peer.begin_write = fail_second
    for step in (1, 2, 3, 4):
        try:
            manager.save(_state(rank, step), step)
            manager.maybe_wait()
            manager._replication_worker.wait_idle(30)
            manager.maybe_wait()
        except BackgroundError as exc:
            errors.append((step, str(exc)))
    manager.close()
    return errors


def test_one_sided_failure_after_header_raises_and_never_aborts(tmp_path):
    # Before: rank 1's next exchange met rank 0's stale payload chunk (gloo EnforceNotMet, SIGABRT).
    outcomes = run_ranks(_fail_after_header_then_continue, 2, str(tmp_path), timeout=120, check=False)
    assert [o.exitcode for o in outcomes] == [0, 0], [o.error for o in outcomes]
    zero, one = outcomes[0].result, outcomes[1].result
    assert one[0] == (2, "GEMINI background replication failed: injected: no slot for the replica")
    # Rank 0 waited for a payload that never came; both ranks' later exchanges fail loudly.
    assert zero and zero[0][0] == 2 and "did not complete within 3" in zero[0][1]
    assert all("GEMINI background replication failed" in message for _, message in zero + one)


# ----------------------------------------------------- kill a rank inside an exchange, then recover


def _kill_in_exchange(rank, world, folder, phase):
    config = _config(folder, host_memory="shared", shared_memory_dir=os.path.join(folder, "shm"),
                     timeout_s=10)
    if rank == 1:
        if phase == "after_header":
            exchange_bytes = PeerReplicator._exchange_bytes

            def die_before_payload(self, *args):
                if self._exchanges == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return exchange_bytes(self, *args)

            PeerReplicator._exchange_bytes = die_before_payload
        else:
            post = PeerReplicator._post
            posted = []

            def die_mid_payload(self, outgoing, incoming):
                works = post(self, outgoing, incoming)
                if self._exchanges == 3 and incoming is not None and incoming[1] is not None:
                    posted.append(works)
                    if len(posted) == 3:
                        time.sleep(0.2)  # let the peer start on these chunks
                        os.kill(os.getpid(), signal.SIGKILL)
                return works

            PeerReplicator._post = die_mid_payload
    manager = InMemoryCheckpointManager(config)
    errors = []
    for step in (1, 2, 3):
        try:
            _save(manager, rank, step)
            manager.maybe_wait()
        except BackgroundError as exc:
            errors.append((step, str(exc)))
    manager.close(keep_shared=True)  # what a dying worker leaves for its restart
    return errors


def _recover_after_kill(rank, world, folder):
    config = _config(folder, host_memory="shared", shared_memory_dir=os.path.join(folder, "shm"),
                     timeout_s=10)
    if rank == 1:  # its node lost its own slots too: rank 1's state can only come from its replica
        for sidecar in glob.glob(os.path.join(folder, "shm", "*", "rank-00001.*", "own_*.json")):
            os.remove(sidecar)
    manager = InMemoryCheckpointManager(config)
    step = manager.find_latest()
    state = manager.load()
    sources = dict(manager.recovery_sources)
    manager.close()
    return step, state, sources


@pytest.mark.parametrize("phase", ["after_header", "mid_payload"])
def test_rank_killed_inside_an_exchange(tmp_path, phase):
    outcomes = run_ranks(_kill_in_exchange, 3, str(tmp_path), phase, timeout=120, check=False)
    assert outcomes[1].killed_by == signal.SIGKILL
    for survivor in (0, 2):  # the victim's sender and receiver: a clear error, no SIGABRT
        assert outcomes[survivor].exitcode == 0, outcomes[survivor].error
        errors = outcomes[survivor].result
        assert [step for step, _ in errors] == [3]
        assert errors[0][1].startswith(
            f"GEMINI background replication failed: step 3, sending to rank {(survivor + 1) % 3} and "
            f"receiving from rank {(survivor - 1) % 3}: distributed operation did not complete within 10")
    # Step 3's replica of rank 1 never completed on rank 2: the newest complete step is 2.
    recovered = run_ranks(_recover_after_kill, 3, str(tmp_path), timeout=120)
    for rank, (step, state, sources) in enumerate(recovered):
        assert step == 2
        assert_same(state, _state(rank, 2))
    assert recovered[1][2] == {}  # received from rank 2, not read locally
    assert recovered[2][2] == {"own:2": "shared-memory", "held:1": "shared-memory"}


# --------------------------------------------------------------- item 7: pins on a retry


def _retry_then_train(rank, world, folder):
    config = _config(folder, disk_flush_interval=1, verify_integrity=True, timeout_s=5)
    manager = InMemoryCheckpointManager(config)
    for step in (1, 2, 3):
        _save(manager, rank, step)
    manager._drain()
    if rank == 1:  # no memory copy of rank 1's step 3 anywhere, and its own shard is corrupt
        manager._own.discard()
        path = os.path.join(manager.store.directory, "own-000000000003.gemini")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(path, "wb").write(bytes(data))
    else:
        manager._peer.discard()
    dist.barrier()
    step = manager.find_latest()  # rejects rank 1's own shard, retries with rank 0's copy of it
    state = manager.load()
    durations = []
    for next_step in (4, 5):
        started = time.monotonic()
        _save(manager, rank, next_step)
        manager._drain()
        durations.append(time.monotonic() - started)
    readers = [slot.readers for slot in manager._own._slots]
    manager.close()
    return step, state, durations, readers


def test_retry_in_find_latest_leaves_no_slot_pinned(tmp_path):
    # Before: the first attempt's pin on rank 0's step-3 slot stayed; capture 5 waited 5 s and failed.
    for rank, (step, state, durations, readers) in enumerate(
            run_ranks(_retry_then_train, 2, str(tmp_path), timeout=120)):
        assert step == 3
        assert_same(state, _state(rank, 3))
        assert max(durations) < 4.0, durations
        assert readers == [0, 0]


# ------------------------------------------------------------ item 14: pairing agreement


def _uneven_nodes(rank, world, folder):
    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "1"  # resolves jump 2 on ranks 0, 1; 1 on rank 2
    try:
        InMemoryCheckpointManager(_config(folder, replication_jump=-1)).close()
    except ValueError as exc:
        return str(exc)
    return "constructed"


def test_ranks_resolving_different_jumps_fail_at_construction(tmp_path):
    for message in run_ranks(_uneven_nodes, 3, str(tmp_path), timeout=60):
        assert message.startswith(
            "InMemoryCkptConfig.replication_jump / replication_chunk_size: ranks resolved different values "
            "(rank 0: jump 2, chunk 512, rank 1: jump 2, chunk 512, rank 2: jump 1, chunk 512;")


def _one_rank_invalid_jump(rank, world, folder):
    started = time.monotonic()
    try:
        InMemoryCheckpointManager(_config(folder, replication_jump=5 if rank == 0 else 1, timeout_s=30)).close()
    except ValueError as exc:
        return str(exc), time.monotonic() - started
    return "constructed", time.monotonic() - started


def test_a_rank_with_an_invalid_jump_does_not_leave_the_others_waiting(tmp_path):
    (zero, zero_s), (one, one_s) = run_ranks(_one_rank_invalid_jump, 2, str(tmp_path), timeout=60)
    assert zero.startswith("InMemoryCkptConfig.replication_jump: 5 is not a valid rank distance for world size 2")
    assert one.startswith("InMemoryCkptConfig.replication_jump / replication_chunk_size: ranks resolved "
                          "different values (rank 0: jump 0, chunk 0, rank 1: jump 1, chunk 512;")
    assert max(zero_s, one_s) < 15, "nobody waits for the 30 s timeout"


# ----------------------------------------------------- item 17: group creation is bounded


def _probe_alone(rank, world):
    from lm_resiliency.scout.probes import CollectiveProbe

    if rank == 1:
        time.sleep(5)  # a peer that never reaches the group creation in time
        return None
    started = time.monotonic()
    try:
        CollectiveProbe([[0, 1]], timeout_s=2)
    except TimeoutError as exc:
        return str(exc), time.monotonic() - started
    return "created", time.monotonic() - started


def test_group_creation_without_the_peer_fails_in_bounded_time():
    message, elapsed = run_ranks(_probe_alone, 2, timeout=60)[0]
    assert message.startswith("creating SCOUT's collective probe group (a gloo group of ranks [0, 1]) "
                              "did not complete within 2.0s")
    assert elapsed < 6



def _scout_setup(rank, world, rank1_reaches):
    """Rank 0 constructs SCOUT; rank 1 stops short of `rank1_reaches` ("hosts": it never
    starts; "groups": it gathers host names but never creates the replay group)."""
    from lm_resiliency import ReplayHarnessConfig
    from lm_resiliency.scout.harness import ScoutHarness

    def stall(*args, **kwargs):
        time.sleep(6)
        raise RuntimeError("rank 1 gave up")

    if rank == 1:
        if rank1_reaches == "hosts":
            return time.sleep(6)
        wire.new_group = stall
    model = torch.nn.Linear(4, 2)
    config = ReplayHarnessConfig(hang_stall_threshold_s=1.0, full_sweep_timeout_s=1.0)
    started = time.monotonic()
    try:
        ScoutHarness(model, torch.optim.SGD(model.parameters(), lr=0.1), config, on_oob_report=print)
    except (TimeoutError, RuntimeError) as exc:
        return str(exc), time.monotonic() - started
    return "created", time.monotonic() - started


@pytest.mark.parametrize("rank1_reaches, waited_for", [
    ("hosts", "SCOUT setup: gathering every rank's host name did not complete within 2.0s"),
    ("groups", "creating SCOUT's replay peer group (a gloo group of ranks [0, 1]) did not complete within 2.0s"),
])
def test_scout_setup_without_a_peer_fails_in_bounded_time(rank1_reaches, waited_for):
    # Before: rank 0 waited in SCOUT's setup for the default group's / gloo's timeout (30 minutes).
    message, elapsed = run_ranks(_scout_setup, 2, rank1_reaches, timeout=60)[0]
    assert message.startswith(waited_for)
    assert elapsed < 6
