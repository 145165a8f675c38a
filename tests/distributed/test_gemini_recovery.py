"""GEMINI end to end on 4 real gloo ranks: capture, replicate, flush, recover in fresh processes."""

import os

import pytest

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager, RecoveryUnavailable
from tests.distributed.gemini_workloads import assert_same, make_model, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)


def _config(folder, **kw):
    base = dict(interval=2, replication_jump=2, disk_flush_interval=2, disk_folder=str(folder),
                run_id="test-run", replication_chunk_size=1024, timeout_s=60)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _train_and_exit(rank, world, folder, steps, extra_kw):
    manager, _, _, expected = train(rank, steps, _config(folder, **extra_kw), save_every=2)
    manager.close()
    return expected


def _recover_fresh(rank, world, folder, extra_kw, delete_own_of=None):
    if delete_own_of is not None and rank == delete_own_of:
        for name in os.listdir(folder):
            rank_dir = os.path.join(folder, name, f"rank-{rank:05d}")
            for f in os.listdir(rank_dir):
                if f.startswith("own-"):
                    os.remove(os.path.join(rank_dir, f))
    make_model(seed=1234)  # a different initialization must not matter
    manager = InMemoryCheckpointManager(_config(folder, **extra_kw))
    step = manager.find_latest()
    state = manager.load()
    manager.close()
    return step, state


def _recover_in_memory(rank, world, folder):
    manager, _, _, expected = train(rank, 5, _config(folder, disk_flush_interval=0), save_every=2)
    step = manager.find_latest()
    state = manager.load()
    manager.close()
    return expected, step, state, os.listdir(manager.store.directory)


def test_fresh_processes_recover_exact_last_capture(tmp_path):
    expected = run_ranks(_train_and_exit, 4, str(tmp_path), 7, {}, timeout=120)
    recovered = run_ranks(_recover_fresh, 4, str(tmp_path), {}, timeout=120)
    for rank in range(4):
        exp_step, exp_state = expected[rank]
        step, state = recovered[rank]
        assert exp_step == 6 and step == 6
        assert_same(state, exp_state)


def test_in_memory_recovery_without_disk(tmp_path):
    for rank, (expected, step, state, files) in enumerate(run_ranks(_recover_in_memory, 4, str(tmp_path))):
        assert step == expected[0] == 4
        assert_same(state, expected[1])
        assert not any(f.endswith(".gemini") for f in files), "disk_flush_interval=0 must not write shards"


def test_deleted_own_files_recover_from_peer_replica(tmp_path):
    expected = run_ranks(_train_and_exit, 4, str(tmp_path), 6, {}, timeout=120)
    recovered = run_ranks(_recover_fresh, 4, str(tmp_path), {}, 1, timeout=120)
    for rank in range(4):
        assert recovered[rank][0] == 6
        assert_same(recovered[rank][1], expected[rank][1])


def _drop_newest_on_rank(rank, world, folder):
    if rank == 2:
        for name in os.listdir(folder):
            rank_dir = os.path.join(folder, name, "rank-00002")
            for f in os.listdir(rank_dir):
                if f.endswith("000000000006.gemini"):
                    os.remove(os.path.join(rank_dir, f))
    # rank 2's replica lives on rank 0 (jump 2): drop it there too, so step 6 is truly missing for rank 2.
    if rank == 0:
        for name in os.listdir(folder):
            rank_dir = os.path.join(folder, name, "rank-00000")
            for f in os.listdir(rank_dir):
                if f.startswith("peer-00002-") and f.endswith("000000000006.gemini"):
                    os.remove(os.path.join(rank_dir, f))
    return _recover_fresh(rank, world, folder, {})


def test_step_missing_on_one_rank_selects_older_common_step(tmp_path):
    run_ranks(_train_and_exit, 4, str(tmp_path), 6, {}, timeout=120)
    recovered = run_ranks(_drop_newest_on_rank, 4, str(tmp_path), timeout=120)
    assert [r[0] for r in recovered] == [4, 4, 4, 4]


def _exact_step(rank, world, folder, step, allowed=None):
    manager = InMemoryCheckpointManager(_config(folder))
    try:
        return manager.find_latest(step=step[rank] if isinstance(step, list) else step,
                                   allowed_steps=allowed[rank] if allowed is not None else None)
    except RecoveryUnavailable as exc:
        return f"unavailable: {exc}"
    finally:
        manager.close()


def test_exact_step_is_loaded_or_fails_closed(tmp_path):
    run_ranks(_train_and_exit, 4, str(tmp_path), 6, {}, timeout=120)
    assert run_ranks(_exact_step, 4, str(tmp_path), 4) == [4, 4, 4, 4]
    assert all(r.startswith("unavailable: GEMINI step 2 ") for r in run_ranks(_exact_step, 4, str(tmp_path), 2))
    # Both steps are loadable, but a job must never resume two of them: every rank refuses alike.
    mixed = run_ranks(_exact_step, 4, str(tmp_path), [4, 4, 6, 4])
    assert mixed == ["unavailable: GEMINI recovery: the ranks asked for different steps (rank 0: step 4; rank 1: "
                     "step 4; rank 2: step 6; rank 3: step 4); every rank must request the same step, so nothing "
                     "is loaded"] * 4
    allowed = run_ranks(_exact_step, 4, str(tmp_path), None, [[4, 6], [6, 4], [6, 4], [4]])
    assert all("rank 0: step newest among [4, 6]; rank 1: step newest among [4, 6]" in r
               and "rank 3: step newest among [4]" in r for r in allowed), allowed


def _corrupt_and_recover(rank, world, folder, victims):
    """Flip one payload byte in the named (kind, owner) shards of step 6, then recover."""
    for name in os.listdir(folder):
        rank_dir = os.path.join(folder, name, f"rank-{rank:05d}")
        for f in sorted(os.listdir(rank_dir)):
            own = f == "own-000000000006.gemini" and ("own", rank) in victims
            peer = f.startswith("peer-") and f.endswith("-000000000006.gemini") and \
                ("peer", int(f.split("-")[1])) in victims
            if own or peer:
                path = os.path.join(rank_dir, f)
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0x01  # inside the payload: it dominates the file
                open(path, "wb").write(bytes(data))
    return _recover_fresh(rank, world, folder, {"verify_integrity": True})


def test_flipped_byte_generation_is_never_loaded(tmp_path):
    expected = run_ranks(_train_and_exit, 4, str(tmp_path), 6, {"verify_integrity": True}, timeout=120)
    # rank 1's own copy of step 6 is corrupt: its intact replica (held by rank 3) is used instead.
    recovered = run_ranks(_corrupt_and_recover, 4, str(tmp_path), {("own", 1)}, timeout=120)
    assert [r[0] for r in recovered] == [6, 6, 6, 6]
    assert_same(recovered[1][1], expected[1][1])


def test_corrupt_copy_and_replica_fall_back_to_older_step(tmp_path):
    run_ranks(_train_and_exit, 4, str(tmp_path), 6, {"verify_integrity": True}, timeout=120)
    recovered = run_ranks(_corrupt_and_recover, 4, str(tmp_path), {("own", 1), ("peer", 1)}, timeout=120)
    assert [r[0] for r in recovered] == [4, 4, 4, 4]


def _sigterm_after_capture(rank, world, folder):
    import signal

    manager, _, _, expected = train(rank, 4, _config(folder, disk_flush_interval=0), save_every=2)
    with open(os.path.join(folder, f"expected-{rank}.pt"), "wb") as f:
        import torch
        torch.save(expected, f)
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM should have ended the process")


def test_sigterm_flushes_and_next_start_recovers(tmp_path):
    import signal

    import torch

    outcomes = run_ranks(_sigterm_after_capture, 4, str(tmp_path), timeout=120, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGTERM] * 4, [o.error for o in outcomes]
    recovered = run_ranks(_recover_fresh, 4, str(tmp_path), {}, timeout=120)
    for rank in range(4):
        expected = torch.load(os.path.join(tmp_path, f"expected-{rank}.pt"), weights_only=False)
        assert recovered[rank][0] == expected[0] == 4
        assert_same(recovered[rank][1], expected[1])
