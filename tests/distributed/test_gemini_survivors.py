"""Survivors of a killed peer exit promptly: a rank whose training failed stops replicating at
once (keep_shared_on_close, as the framework surfaces call it), so neither it nor its partners
wait `timeout_s` on an exchange that a stuck or dead rank will never complete.

Ring of 3 (replication_jump=1): rank r sends to r + 1 and holds the replica of r - 1."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.workers import BackgroundError
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

_TIMEOUT_S = 30  # what the old code waited; every survivor must be done far sooner
_PROMPT_S = 8


def _manager(folder, rank):
    config = InMemoryCkptConfig(replication_jump=1, disk_flush_interval=0, run_id="survivors",
                                disk_folder=os.path.join(folder, f"rank{rank}"), host_memory="heap",
                                replication_chunk_size=4096, timeout_s=_TIMEOUT_S)
    return InMemoryCheckpointManager(config, install_signal_handlers=False)


def _state(rank, step):
    return {"w": torch.arange(5000, dtype=torch.float32) * step + rank}


def _save(manager, rank, step):
    manager.save(_state(rank, step), step)
    manager.maybe_wait()


def _stuck_partner(rank, world, folder):
    """Rank 1 is SIGKILLed mid-exchange; rank 2 sits in a training collective waiting for rank 0
    and never posts its exchange of step 2; rank 0's replication worker waits for that exchange
    while its training fails on rank 1. Rank 0 must flush and leave at once; rank 2, released
    when rank 0 leaves, must fail its exchange at once, naming rank 0."""
    held = dist.new_group([0, 2], backend="gloo")
    manager = _manager(folder, rank)
    _save(manager, rank, 1)
    manager.flush_now()  # step 1 replicated everywhere
    dist.barrier()
    if rank == 1:
        _save(manager, rank, 2)  # receives rank 0's header, then dies
        time.sleep(2)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        _save(manager, rank, 2)  # its exchange waits for rank 2's header
        try:
            dist.recv(torch.zeros(1), src=1)  # the training step: rank 1 dies
        except RuntimeError:
            pass
        started = time.monotonic()
        manager.keep_shared_on_close()  # what a surface does when training fails
        flushed = manager.flush_now()
        manager.maybe_wait()  # its own stop is not an error
        manager.close()
        return {"seconds": time.monotonic() - started, "flushed": flushed}
    try:
        dist.all_reduce(torch.zeros(1), group=held)  # rank 0 never joins: released when it leaves
    except RuntimeError:
        pass
    started = time.monotonic()
    manager.save(_state(rank, 2), 2)
    try:
        manager.flush_now()
        manager.maybe_wait()
    except BackgroundError as exc:
        return {"seconds": time.monotonic() - started, "error": str(exc)}
    return {"seconds": time.monotonic() - started, "error": None}


def test_survivors_leave_promptly_when_a_partner_is_stuck_in_training(tmp_path):
    outcomes = run_ranks(_stuck_partner, 3, str(tmp_path), timeout=150, check=False)
    assert outcomes[1].killed_by == signal.SIGKILL, [o.error for o in outcomes]
    first, third = outcomes[0], outcomes[2]
    assert first.error is None and third.error is None, (first.error, third.error)
    assert first.result["flushed"] == 2
    assert first.result["seconds"] < _PROMPT_S, first.result
    assert third.result["seconds"] < _PROMPT_S, third.result
    assert "rank 0 stopped replicating after step 2 (this launch ends abnormally)" in third.result["error"]


def _abandons_before_capture(rank, world, folder):
    """Rank 0's training fails before it captures step 2, while ranks 1 and 2 are exchanging
    step 2 with it, and it stays alive a while (tearing down): both fail at once, naming rank 0."""
    manager = _manager(folder, rank)
    _save(manager, rank, 1)
    manager.flush_now()
    dist.barrier()
    started = time.monotonic()
    if rank == 0:
        time.sleep(1)  # the partners have posted their exchanges
        manager.keep_shared_on_close()
        time.sleep(_PROMPT_S + 2)
        manager.close()
        return {"seconds": time.monotonic() - started, "error": None}
    manager.save(_state(rank, 2), 2)
    try:
        manager.flush_now()
        manager.maybe_wait()
        error = None
    except BackgroundError as exc:
        error = str(exc)
    manager.close(keep_shared=True)
    return {"seconds": time.monotonic() - started, "error": error}


def test_partners_of_a_rank_whose_training_failed_fail_at_once_naming_it(tmp_path):
    results = run_ranks(_abandons_before_capture, 3, str(tmp_path), timeout=150)
    for rank in (1, 2):
        assert results[rank]["seconds"] < _PROMPT_S, (rank, results[rank])
        assert "rank 0 stopped replicating after step 1 (this launch ends abnormally)" in results[rank]["error"], rank
