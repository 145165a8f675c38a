"""A one-shot NaN on one rank reaches every replica through DDP's gradient all-reduce, so SCOUT's
peers agree and replay sees nothing wrong. No capture of that state is ever made recoverable or
certified: the boundary refuses it on every rank and says so."""

import pytest
import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from lm_resiliency.experimental import NonFiniteState
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def _train(rank, world, folder, nan_at):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = enable_resiliency(
        ddp, optimizer, interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id="nan-session",
                                      replication_jump=1, timeout_s=60),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5))
    error = None
    try:
        for step in range(8):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            if step + 1 == nan_at and rank == 1:
                x[0, 0] = float("nan")  # one bad sample on one rank, once
            ddp(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    except NonFiniteState as exc:
        error = str(exc)
    nan_everywhere = bool(torch.isnan(model.embed.weight).all())
    session.manager._drain()
    own_steps = sorted(k.step for k in session.manager.store.list_shards() if k.kind == "own")
    result = {"error": error, "nan_everywhere": nan_everywhere, "verified": session.ledger.verified_steps(),
              "own_steps": own_steps, "latest": session.manager.latest_step}
    session.close()
    return result


def test_nan_spread_by_allreduce_is_never_captured_or_certified(tmp_path):
    results = run_ranks(_train, 2, str(tmp_path), 5, timeout=240)
    for result in results:
        assert result["nan_everywhere"]
        # Steps 2 and 4 were finite and certified; the boundary of step 6 saw NaN on every rank.
        assert result["verified"] == [4, 2]
        assert result["latest"] == 4 and result["own_steps"] == [2, 4]
        assert result["error"].startswith("lm-resiliency: step 6 is not captured or certified: non-finite")
        assert "ranks [0, 1]" in result["error"] and "embed.weight" in result["error"]
