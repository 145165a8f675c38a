"""PyTorchAdapter's `group`/`nccl_group` (the API guide: "To provide custom groups, pass both group
and nccl_group"): SCOUT compares replays within the caller's group instead of the groups it derives
from the topology. Real DDP over 4 gloo ranks; rank 3's faulty `head` is found within its group."""

import pytest
import torch
import torch.distributed as dist

from lm_resiliency import enable_resiliency
from lm_resiliency.scout.config import ReplayHarnessConfig
from tests.distributed.scout_workloads import FAULTS, _batch, make_model
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

GROUPS = ([0, 1, 3], [2])  # the topology alone would make one group of all four DDP replicas


def _train_with_user_groups(rank, world):
    groups = [dist.new_group(ranks, backend="gloo") for ranks in GROUPS]
    device_groups = [dist.new_group(ranks, backend="gloo") for ranks in GROUPS]
    mine = next(i for i, ranks in enumerate(GROUPS) if rank in ranks)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if rank == 3:
        model.head.register_forward_hook(FAULTS["sign_flip"], with_kwargs=True)
    results = []
    session = enable_resiliency(ddp, optimizer, interval=2, enable_checkpoint=False,
                                replay=ReplayHarnessConfig(check_interval=2),
                                group=groups[mine], nccl_group=device_groups[mine],
                                fault_callback=results.append)
    try:
        for step in range(1, 5):
            ddp(_batch(rank, step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        session.close()
    return [(c.check, c.group_ranks, c.verdict, c.faulty) for r in results for c in r.checks if c.verdict != "clean"]


def test_scout_compares_replays_within_the_callers_group():
    results = run_ranks(_train_with_user_groups, 4, timeout=240)
    for rank in (0, 1, 3):
        assert results[rank] and all(group == (0, 1, 3) and verdict == "sdc" and faulty == (3,)
                                     for _, group, verdict, faulty in results[rank]), results[rank]
    assert results[2] == []  # alone in its group: never compared with rank 3, never told of its fault


def _refused(rank, world):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    both, first, second = (dist.new_group(ranks, backend="gloo") for ranks in ([0, 1], [0], [1]))
    other = second if rank == 0 else first
    own = first if rank == 0 else second
    messages = []
    for group, nccl_group in ((other, other), (both, own)):
        with pytest.raises(ValueError) as err:
            enable_resiliency(model, optimizer, group=group, nccl_group=nccl_group, enable_checkpoint=False)
        messages.append(str(err.value))
    return messages


def test_groups_that_cannot_be_this_ranks_peers_are_refused_before_any_collective():
    for rank, (not_mine, different) in enumerate(run_ranks(_refused, 2, timeout=120)):
        assert not_mine.startswith(f"group= does not contain this rank ({rank})")
        assert different.startswith(f"group= (ranks [0, 1]) and nccl_group= (ranks [{rank}]) must hold the same ranks")
