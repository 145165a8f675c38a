"""One timeline: a job that dies twice never recovers a mix of an abandoned and a new step.

Life 1: rank 1 dies at step 39 after every rank captured step 30; ranks 0, 2 and 3 capture step 40
(timeline A) and die. Life 2 recovers step 30 (rank 1 has nothing newer), trains to step 40 again
on other data (timeline B, parent (A, 30)) and dies. Life 3 must recover B's step 40 on every rank
(or an older step of the same timeline), never A's abandoned step 40 on some ranks and B's on others.
Real gloo ranks and fresh processes; shared-memory and node-local disk tiers.
"""

import os
import signal
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from tests.distributed.gemini_workloads import assert_same, full_state, make_model, snapshot
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

WORLD = 4


def _config(tmp, **kw):
    base = dict(replication_jump=1, disk_flush_interval=10, disk_folder=os.path.join(tmp, "disk"),
                shared_memory_dir=os.path.join(tmp, "shm"), run_id="timeline", replication_chunk_size=4096,
                timeout_s=20, verify_integrity=True)
    base.update(kw)
    return InMemoryCkptConfig(**base)


def _steps(manager, model, optimizer, rank, first, last, seed, stop_at=None):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    for step in range(first, last + 1):
        if step == stop_at:
            return
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        manager.maybe_wait()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            manager.save(full_state(model, optimizer, step), step)


def _save_expected(tmp, life, rank, step, model, optimizer):
    torch.save((step, snapshot(full_state(model, optimizer, step))), os.path.join(tmp, f"life{life}-{rank}.pt"))


def _die(how):
    os.kill(os.getpid(), how)
    time.sleep(60)
    raise AssertionError("should have died")


def _first_life(rank, world, tmp, kw, death):
    model = make_model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = InMemoryCheckpointManager(_config(tmp, **kw))
    _steps(manager, model, optimizer, rank, 1, 30, seed=1)
    manager._drain()  # step 30 is captured, replicated (and flushed) on every rank
    _save_expected(tmp, 1, rank, 30, model, optimizer)
    if rank == 1:
        with open(os.path.join(tmp, "rank1-dead"), "w"):
            pass
        _die(signal.SIGKILL)  # dies at step 39: never captures step 40
    while not os.path.exists(os.path.join(tmp, "rank1-dead")):
        time.sleep(0.01)
    _steps(manager, model, optimizer, rank, 31, 40, seed=1)
    manager._capture_done.wait(20)
    assert manager.latest_step == 40  # A's step 40 is complete in this rank's own slot
    _die(death)  # SIGTERM: the handler flushes A's step 40 to disk first


def _second_life(rank, world, tmp, kw, death_rank):
    model = make_model(7)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = InMemoryCheckpointManager(_config(tmp, **kw))
    step = manager.find_latest()
    state = manager.load()
    assert step == 30
    _, expected = torch.load(os.path.join(tmp, f"life1-{rank}.pt"), weights_only=False)
    assert_same(state, expected)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _steps(manager, model, optimizer, rank, 31, 40, seed=2)  # other data: B's step 40 differs from A's
    manager._drain()
    _save_expected(tmp, 2, rank, 40, model, optimizer)
    _die(signal.SIGTERM if rank == death_rank else signal.SIGKILL)


def _third_life(rank, world, tmp, kw):
    manager = InMemoryCheckpointManager(_config(tmp, **kw))
    step = manager.find_latest()
    sources = dict(manager.recovery_sources)
    state = manager.load()
    manager.close()
    return step, sources, state


def _shards(tmp, rank):
    disk = os.path.join(tmp, "disk")
    return sorted(name for ns in os.listdir(disk) for name in os.listdir(os.path.join(disk, ns, f"rank-{rank:05d}"))
                  if name.endswith(".gemini"))


def _run(tmp, kw, first_death, second_death_rank):
    outcomes = run_ranks(_first_life, WORLD, tmp, kw, first_death, timeout=120, check=False)
    assert [o.killed_by for o in outcomes] == [first_death, signal.SIGKILL, first_death, first_death], \
        [o.error for o in outcomes]
    outcomes = run_ranks(_second_life, WORLD, tmp, kw, second_death_rank, timeout=120, check=False)
    assert all(o.killed_by in (signal.SIGKILL, signal.SIGTERM) for o in outcomes), [o.error for o in outcomes]
    return run_ranks(_third_life, WORLD, tmp, kw, timeout=120)


def test_shared_memory_two_deaths_recover_the_new_timeline(tmp_path):
    tmp = str(tmp_path)
    kw = {"disk_flush_interval": 0}
    recovered = _run(tmp, kw, signal.SIGKILL, None)
    for rank, (step, sources, state) in enumerate(recovered):
        exp_step, expected = torch.load(os.path.join(tmp, f"life2-{rank}.pt"), weights_only=False)
        assert step == exp_step == 40
        assert sources == {f"own:{rank}": "shared-memory"}
        assert_same(state, expected)


def test_disk_two_deaths_never_mix_an_abandoned_shard(tmp_path):
    # Heap slots: only node-local disk survives. Life 1's SIGTERM flush leaves A's step 40 on ranks
    # 0, 2, 3; in life 2 only rank 1 gets B's step 40 to disk (its SIGTERM flush). Every rank has
    # an own shard of step 40, but not of one timeline.
    tmp = str(tmp_path)
    kw = {"host_memory": "heap"}
    outcomes = run_ranks(_first_life, WORLD, tmp, kw, signal.SIGTERM, timeout=120, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGTERM], \
        [o.error for o in outcomes]
    assert "own-000000000040.gemini" in _shards(tmp, 0)
    outcomes = run_ranks(_second_life, WORLD, tmp, {**kw, "disk_flush_interval": 0}, 1, timeout=120, check=False)
    assert all(o.killed_by in (signal.SIGKILL, signal.SIGTERM) for o in outcomes), [o.error for o in outcomes]
    assert "own-000000000040.gemini" in _shards(tmp, 1)
    # Recovering (A, 30) dropped A's abandoned step-40 shards on every rank.
    assert [n for n in _shards(tmp, 0) if "40" in n] == []

    recovered = run_ranks(_third_life, WORLD, tmp, kw, timeout=120)
    for rank, (step, sources, state) in enumerate(recovered):
        exp_step, expected = torch.load(os.path.join(tmp, f"life1-{rank}.pt"), weights_only=False)
        assert step == exp_step == 30  # B's step 40 is only on rank 1 (and its replica of rank 0)
        assert sources == {f"own:{rank}": "disk"}
        assert_same(state, expected)


def _recover_then_sigterm(rank, world, tmp, kw):
    manager = InMemoryCheckpointManager(_config(tmp, **kw))
    assert manager.find_latest() == 30
    manager.load()
    with open(os.path.join(tmp, f"recovered-{rank}"), "w"):
        pass
    _die(signal.SIGTERM)  # before any new capture: the flush may only write timeline state


def test_sigterm_flush_never_writes_an_abandoned_slot(tmp_path):
    tmp = str(tmp_path)
    kw = {"disk_flush_interval": 0}
    outcomes = run_ranks(_first_life, WORLD, tmp, kw, signal.SIGKILL, timeout=120, check=False)
    assert all(o.killed_by == signal.SIGKILL for o in outcomes), [o.error for o in outcomes]
    assert _shards(tmp, 0) == []
    outcomes = run_ranks(_recover_then_sigterm, WORLD, tmp, kw, timeout=120, check=False)
    assert all(o.killed_by == signal.SIGTERM for o in outcomes), [o.error for o in outcomes]
    # Rank 0 still held A's abandoned step 40 in shared memory; its flush wrote the recovered step.
    assert _shards(tmp, 0) == ["own-000000000030.gemini", "peer-00003-000000000030.gemini"]
