"""GEMINI host slots in node-owned shared memory survive SIGKILL: real gloo ranks, fresh processes."""

import os
import signal
import threading
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini import device
from lm_resiliency.codec import encode_state
from tests.distributed.gemini_workloads import assert_same, full_state, make_model, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _config(tmp, **kw):
    base = dict(interval=2, replication_jump=2, disk_flush_interval=0, disk_folder=os.path.join(tmp, "disk"),
                shared_memory_dir=os.path.join(tmp, "shm"), run_id="shm-run", replication_chunk_size=4096,
                timeout_s=30)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _expected_path(tmp, rank):
    return os.path.join(tmp, f"expected-{rank}.pt")


def _train_then_sigkill(rank, world, tmp, steps, config_kw):
    manager, _, _, expected = train(rank, steps, _config(tmp, **config_kw), save_every=2)
    manager._drain()  # the last capture is complete and its replica is held by the peer
    torch.save(expected, _expected_path(tmp, rank))
    os.kill(os.getpid(), signal.SIGKILL)


def _recover_and_continue(rank, world, tmp, config_kw, drop_own_of=None):
    if rank == drop_own_of:
        # This rank's own slots are gone: its state must come from the replica its peer's
        # predecessor left in shared memory.
        shm = os.path.join(tmp, "shm")
        for ns in os.listdir(shm):
            for rank_dir in os.listdir(os.path.join(shm, ns)):
                if rank_dir.startswith(f"rank-{rank:05d}."):
                    for name in ("own_a.json", "own_b.json"):
                        path = os.path.join(shm, ns, rank_dir, name)
                        if os.path.exists(path):
                            os.remove(path)
    make_model(seed=999)  # a different initialization must not matter
    manager = InMemoryCheckpointManager(_config(tmp, **config_kw))
    step = manager.find_latest()
    sources = dict(manager.recovery_sources)
    job = dict(manager.job_recovery_sources)
    state = manager.load()
    # Training goes on in the adopted slots: capture, replicate, recover the new step in memory.
    next_state = {"w": torch.full((64,), float(rank)), "step": 100}
    manager.save(next_state, 100)
    manager._drain()
    assert manager.find_latest() == 100
    assert_same(manager.load(), next_state)
    report = manager.host_memory()
    manager.close()
    return step, sources, state, report, job


def _no_checkpoint_files(tmp):
    """Files under the disk folder other than the attachment records (cleanup's liveness check)."""
    return [f for _, _, files in os.walk(os.path.join(tmp, "disk")) for f in files if not f.startswith(".attached-")]


def _shm_entries(tmp):
    root = os.path.join(tmp, "shm")
    return [os.path.join(d, f) for d, dirs, files in os.walk(root) for f in files + dirs]


def test_every_rank_sigkilled_resumes_from_shared_memory_without_disk(tmp_path):
    tmp = str(tmp_path)
    outcomes = run_ranks(_train_then_sigkill, 4, tmp, 6, {}, timeout=60, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 4, [o.error for o in outcomes]
    assert _no_checkpoint_files(tmp) == []

    recovered = run_ranks(_recover_and_continue, 4, tmp, {}, timeout=60)
    for rank, (step, sources, state, report, _) in enumerate(recovered):
        exp_step, exp_state = torch.load(_expected_path(tmp, rank), weights_only=False)
        assert step == exp_step == 6
        assert sources == {f"own:{rank}": "shared-memory"}
        assert_same(state, exp_state)
        assert report.mode == "shared" and 0 < len(report.slot_bytes) <= 4 and report.total_bytes > 0
    assert _no_checkpoint_files(tmp) == []  # no disk write, no disk read
    assert _shm_entries(tmp) == [], "a clean close() of the last generation leaves no segment"


def test_lost_own_slots_recover_from_peer_memory_before_own_disk(tmp_path):
    tmp = str(tmp_path)
    kw = {"verify_integrity": True, "disk_flush_interval": 2}
    outcomes = run_ranks(_train_then_sigkill, 4, tmp, 4, kw, timeout=60, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 4, [o.error for o in outcomes]
    assert any(f == "own-000000000004.gemini" for f in _no_checkpoint_files(tmp))  # disk has step 4 too

    recovered = run_ranks(_recover_and_continue, 4, tmp, kw, 1, timeout=60)
    for rank, (step, sources, state, _, _) in enumerate(recovered):
        exp_step, exp_state = torch.load(_expected_path(tmp, rank), weights_only=False)
        assert step == exp_step == 4
        assert_same(state, exp_state)
    # Rank 1 lost its own slots but still has its own shard on disk; the order is own memory,
    # peer memory, own disk: with jump 2, rank 3 sends rank 1's replica from the shared slots
    # its predecessor left.
    assert recovered[3][1] == {"own:3": "shared-memory", "held:1": "shared-memory"}
    assert recovered[1][1] == {}
    assert [recovered[r][1] for r in (0, 2)] == [{"own:0": "shared-memory"}, {"own:2": "shared-memory"}]
    # Every rank sees the whole job's sources (what rank 0's "resumed ... from" line reports).
    job = {r: (r, "shared-memory") for r in (0, 2, 3)}
    job[1] = (3, "shared-memory")
    assert all(result[4] == job for result in recovered)


def _killed_while_writing(rank, world, tmp):
    config = _config(tmp, replication_jump=1)
    manager, model, optimizer, expected = train(rank, 4, config, save_every=2)
    manager._drain()
    torch.save(expected, _expected_path(tmp, rank))
    state = full_state(model, optimizer, 6)
    if rank == 1:
        copied = []
        pairs_total = len(encode_state(state).tensors)

        def slow_finish(self):
            for dst, src in self._cpu_pairs:
                dst.copy_(src)
                copied.append(1)
                time.sleep(0.05)

        def kill_when_half_written():
            while len(copied) < pairs_total // 2:
                time.sleep(0.001)
            with open(os.path.join(tmp, "half-written"), "w") as f:
                f.write(str(len(copied)))
            os.kill(os.getpid(), signal.SIGKILL)

        device.PendingCopy.finish = slow_finish
        threading.Thread(target=kill_when_half_written, daemon=True).start()
        torch.save(state, os.path.join(tmp, "step6-rank1.pt"))
        manager.save(state, 6)
        time.sleep(30)
        raise AssertionError("rank 1 should have been killed while writing its slot")
    manager.save(state, 6)
    manager.maybe_wait()  # rank 0's step 6 is READY in its own slot; its replication cannot finish
    os.kill(os.getpid(), signal.SIGKILL)


def _recover(rank, world, tmp, config_kw):
    manager = InMemoryCheckpointManager(_config(tmp, **config_kw))
    step = manager.find_latest()
    sources = dict(manager.recovery_sources)
    state = manager.load()
    manager.close()
    return step, sources, state


def test_rank_killed_mid_write_uses_previous_slot(tmp_path):
    tmp = str(tmp_path)
    outcomes = run_ranks(_killed_while_writing, 2, tmp, timeout=60, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2, [o.error for o in outcomes]
    assert os.path.exists(os.path.join(tmp, "half-written"))

    # Rank 1's directory: the slot it was writing has a segment but no READY sidecar, and its
    # payload really is half new (step 6) and half old.
    shm = os.path.join(tmp, "shm")
    (ns,) = os.listdir(shm)
    (rank1,) = [d for d in os.listdir(os.path.join(shm, ns)) if d.startswith("rank-00001.")]
    files = set(os.listdir(os.path.join(shm, ns, rank1)))
    own_sidecars = sorted(f for f in files if f.startswith("own_") and f.endswith(".json"))
    assert len(own_sidecars) == 1 and {"own_a.seg", "own_b.seg"} <= files
    writing = ({"own_a", "own_b"} - {own_sidecars[0][:-5]}).pop()
    with open(os.path.join(shm, ns, rank1, f"{writing}.seg"), "rb") as f:
        segment = f.read()
    tensors = encode_state(torch.load(os.path.join(tmp, "step6-rank1.pt"), weights_only=False)).tensors
    first = tensors[0].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert segment[: len(first)] == first, "the first half of the step-6 payload was written"
    step6 = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    assert step6 not in segment

    recovered = run_ranks(_recover, 2, tmp, {"replication_jump": 1}, timeout=60)
    for rank, (step, sources, state) in enumerate(recovered):
        exp_step, exp_state = torch.load(_expected_path(tmp, rank), weights_only=False)
        assert step == exp_step == 4  # rank 0 has step 6, but rank 1 does not: the common step
        assert sources == {f"own:{rank}": "shared-memory"}
        assert_same(state, exp_state)


def _train_and_close(rank, world, tmp, config_kw):
    manager, _, _, _ = train(rank, 4, _config(tmp, **config_kw), save_every=2)
    manager.close()
    return sorted(os.listdir(os.path.join(tmp, "shm")))


def test_another_run_leaves_a_crashed_runs_slots_for_its_relaunch(tmp_path):
    tmp = str(tmp_path)
    crashed = {"run_id": "crashed", "replication_jump": 1, "disk_flush_interval": 2}
    outcomes = run_ranks(_train_then_sigkill, 2, tmp, 4, crashed, timeout=60, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2
    (crashed_ns,) = os.listdir(os.path.join(tmp, "shm"))
    crashed_dirs = sorted(os.listdir(os.path.join(tmp, "shm", crashed_ns)))
    assert len(crashed_dirs) == 2  # one directory per rank
    crashed_files = sorted(_no_checkpoint_files(tmp))
    assert "own-000000000004.gemini" in crashed_files

    # An unrelated job on the node (another run id, default 24 h bound) leaves them alone...
    seen = run_ranks(_train_and_close, 2, tmp, {"run_id": "next", "replication_jump": 1}, timeout=60)
    assert all(crashed_ns in names for names in seen)
    assert sorted(os.listdir(os.path.join(tmp, "shm", crashed_ns))) == crashed_dirs
    assert sorted(f for f in _no_checkpoint_files(tmp) if f in crashed_files) == crashed_files  # its files too
    # ...so the crashed job's relaunch still recovers from shared memory, and its clean end
    # leaves no shared memory behind.
    recovered = run_ranks(_recover, 2, tmp, crashed, timeout=60)
    for rank, (step, sources, state) in enumerate(recovered):
        exp_step, exp_state = torch.load(_expected_path(tmp, rank), weights_only=False)
        assert step == exp_step == 4 and sources == {f"own:{rank}": "shared-memory"}
        assert_same(state, exp_state)
    assert _shm_entries(tmp) == []


def test_dead_runs_slots_older_than_the_bound_are_reaped(tmp_path):
    tmp = str(tmp_path)
    outcomes = run_ranks(_train_then_sigkill, 2, tmp, 4, {"run_id": "crashed", "replication_jump": 1},
                         timeout=60, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2
    (crashed_ns,) = os.listdir(os.path.join(tmp, "shm"))
    seen = run_ranks(_train_and_close, 2, tmp, {"run_id": "next", "replication_jump": 1,
                                                "reap_other_runs_after_s": 0}, timeout=60)
    assert all(crashed_ns not in names for names in seen)  # reaped when the new run started
    assert _shm_entries(tmp) == []
