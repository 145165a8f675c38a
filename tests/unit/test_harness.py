import os
import signal

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, run_ranks


def _allreduce(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world):
    if rank == 1:
        raise KeyError("boom-from-rank-1")
    return rank


def _hang_on_zero(rank, world):
    if rank == 0:
        import time
        time.sleep(60)
    return rank


def _kill_self(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_results_come_back_from_every_rank():
    assert run_ranks(_allreduce, 3, timeout=60) == [3.0, 3.0, 3.0]


def test_child_exception_carries_traceback():
    with pytest.raises(RankFailure, match="rank 1 raised:(.|\n)*KeyError: 'boom-from-rank-1'"):
        run_ranks(_raise_on_one, 2, timeout=60)


def test_hang_fails_fast():
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 3"):
        run_ranks(_hang_on_zero, 2, timeout=3, init=False)


def test_killed_rank_is_reported():
    outcomes = run_ranks(_kill_self, 2, timeout=30, init=False, check=False)
    assert outcomes[0].result == 0
    assert outcomes[1].killed_by == signal.SIGKILL
