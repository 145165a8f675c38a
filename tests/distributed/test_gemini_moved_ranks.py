"""Ranks that move between hosts recover their state from wherever it is: real gloo ranks, each
"host" its own shared-memory directory and node-local disk (the lab tests do the same with real
hosts and torchrun).

Generation 1: ranks 0, 1 on host A, ranks 2, 3 on host B (replication_jump 2: A holds B's replicas
and B holds A's). Every process is SIGKILLed, and host A is gone. Generation 2 runs ranks 0, 1 on
host B and ranks 2, 3 on a fresh host C: ranks 0, 1 find their state in what B keeps for its
former ranks 2, 3 (the replicas they held), and ranks 2, 3 get theirs from B over the wire. The
same from node-local disks after both hosts lost their memory, and a recovery that fails closed
naming the ranks of which no copy is left.
"""

import os
import shutil
import signal

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.manager import RecoveryUnavailable
from tests.distributed.gemini_workloads import assert_same, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(180)


def _config(tmp, host, **kw):
    base = dict(interval=2, replication_jump=2, disk_flush_interval=0, disk_folder=os.path.join(tmp, host, "disk"),
                shared_memory_dir=os.path.join(tmp, host, "shm"), run_id="moved-run", replication_chunk_size=4096,
                timeout_s=30, verify_integrity=True)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _train_then_sigkill(rank, world, tmp, hosts, config_kw=None):
    manager, _, _, expected = train(rank, 6, _config(tmp, hosts[rank], **(config_kw or {})), save_every=2, seed=rank)
    manager._drain()  # the last capture is complete, its replica held by the peer (and flushed)
    torch.save(expected, os.path.join(tmp, f"expected-{rank}.pt"))
    os.kill(os.getpid(), signal.SIGKILL)


def _recover(rank, world, tmp, hosts, step=None, config_kw=None):
    manager = InMemoryCheckpointManager(_config(tmp, hosts[rank], **(config_kw or {})))
    try:
        found = manager.find_latest(step=step)
    except RecoveryUnavailable as exc:
        manager.close()
        return str(exc)
    claimed = sorted(f.rank for f in getattr(manager, "_foreign", []))  # other ranks' directories it claimed
    job = dict(manager.job_recovery_sources)
    state = manager.load()
    # Training goes on with the new pairing: capture, replicate, recover the new step in memory.
    manager.save({"w": torch.full((64,), float(rank)), "step": 100}, 100)
    manager._drain()
    assert manager.find_latest() == 100
    assert_same(manager.load(), {"w": torch.full((64,), float(rank)), "step": 100})
    manager.close()
    return found, claimed, job, state


def _expected(tmp, rank):
    return torch.load(os.path.join(tmp, f"expected-{rank}.pt"), weights_only=False)


def test_ranks_moved_to_another_host_recover_from_what_it_keeps_for_its_former_ranks(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_sigkill, 4, tmp, ["A", "A", "B", "B"], timeout=90, check=False)
    outcomes = run_ranks(_recover, 4, tmp, ["B", "B", "C", "C"], timeout=120)
    for rank, (found, claimed, job, state) in enumerate(outcomes):
        step, expected = _expected(tmp, rank)
        assert found == step == 6
        assert_same(state, expected)  # exactly its own state, not the one of the rank that left it
        providers = {owner: holder for owner, (holder, _) in job.items()}
        assert set(providers.values()) <= {0, 1}, job  # host B's processes provide every rank
        assert {medium for _, medium in job.values()} == {"shared-memory"}, job
    claims = [claimed for _, claimed, _, _ in outcomes]
    assert sorted(claims[0] + claims[1]) == [2, 3] and claims[2] == claims[3] == []  # each directory once


def test_without_any_copy_of_a_rank_recovery_fails_closed_naming_it(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_sigkill, 4, tmp, ["A", "A", "B", "B"], timeout=90, check=False)
    # Host A and the directories B kept for rank 3 are gone: rank 1's replica was there.
    for ns in os.listdir(os.path.join(tmp, "B", "shm")):
        for name in os.listdir(os.path.join(tmp, "B", "shm", ns)):
            if name.startswith("rank-00003."):
                for item in os.listdir(os.path.join(tmp, "B", "shm", ns, name)):
                    os.remove(os.path.join(tmp, "B", "shm", ns, name, item))
    errors = run_ranks(_recover, 4, tmp, ["B", "B", "C", "C"], 6, timeout=120)
    assert all("no rank holds a usable copy of ranks 1, 3 at step 6" in e for e in errors), errors


def test_ranks_moved_after_a_power_loss_recover_from_other_ranks_directories_on_their_disk(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_sigkill, 4, tmp, ["A", "A", "B", "B"], {"disk_flush_interval": 2}, timeout=90, check=False)
    for host in ("A", "B"):  # both hosts lose their memory; their disks stay
        shutil.rmtree(os.path.join(tmp, host, "shm"))
    # The hosts swap: ranks 0, 1 run on B, which holds their replicas in rank 2's and 3's
    # directories; ranks 2, 3 run on A, which holds theirs in rank 0's and 1's.
    outcomes = run_ranks(_recover, 4, tmp, ["B", "B", "A", "A"], None, {"disk_flush_interval": 2}, timeout=120)
    for rank, (found, claimed, job, state) in enumerate(outcomes):
        step, expected = _expected(tmp, rank)
        assert found == step == 6 and claimed == []
        assert_same(state, expected)
        assert job == {owner: (owner, "disk") for owner in range(4)}, job  # every rank from its own host's disk


def _recover_rank3_in_heap(rank, world, tmp):
    return _recover(rank, world, tmp, ["A"] * 4, None, {"host_memory": "heap"} if rank == 3 else None)


def test_on_one_host_a_dead_ranks_directory_is_claimed_by_exactly_one_process(tmp_path):
    tmp = str(tmp_path)
    run_ranks(_train_then_sigkill, 4, tmp, ["A"] * 4, timeout=90, check=False)
    # Rank 3 runs with heap slots now: its shared-memory directory has no owner, and ranks 0, 1, 2
    # (one /dev/shm) all look at it at once.
    outcomes = run_ranks(_recover_rank3_in_heap, 4, tmp, timeout=120)
    claims = [claimed for _, claimed, _, _ in outcomes]
    assert sorted(claims, key=len) == [[], [], [], [3]], claims
    for rank, (found, _, _, state) in enumerate(outcomes):
        step, expected = _expected(tmp, rank)
        assert found == step == 6
        assert_same(state, expected)
    job = outcomes[0][2]  # rank 3's state comes from another process of the host, in memory
    assert [job[r][0] for r in range(3)] == [0, 1, 2] and job[3][0] != 3 and job[3][1] != "disk", job
