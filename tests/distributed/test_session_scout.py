"""enable_resiliency with SCOUT on 4 real gloo ranks: SDC localization, capture veto, verified recovery."""

import pytest
import torch
from torch import nn

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from tests.distributed.scout_workloads import recording_hooks
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _sign_flip(module, args, output):
    return -output


def _train(rank, world, folder, steps, detection=True, corrupt_from=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Tower()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    events = []
    hooks = recording_hooks(events)
    session = enable_resiliency(
        ddp, optimizer, interval=2, enable_detection=detection, orchestration=hooks,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id="scout-session",
                                      replication_jump=2, timeout_s=60),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5),
    )
    resumed = session.step_count
    for step in range(session.step_count, steps):
        if corrupt_from is not None and step + 1 == corrupt_from and rank == 1:
            model.layers[0].register_forward_hook(_sign_flip)  # a faulty device from here on
        loss = ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    session.flush_for_restart()
    session.manager._drain()
    own_steps = sorted(k.step for k in session.manager.store.list_shards() if k.kind == "own")
    verified = session.ledger.verified_steps() if session.ledger else None
    session.close()
    return {"resumed": resumed, "own_steps": own_steps, "verified": verified, "events": events}


def test_sdc_is_localized_vetoes_capture_and_restart_loads_verified_step(tmp_path):
    folder = str(tmp_path)
    first = run_ranks(_train, 4, folder, 8, True, 5, timeout=200)
    for rank, result in enumerate(first):
        # Steps 2 and 4 passed their checks and were certified; 6 and 8 were vetoed (SDC on rank 1).
        assert result["own_steps"] == [2, 4] and result["verified"] == [4, 2]
        kinds = [kind for kind, _ in result["events"]]
        assert kinds[:2] == ["recovery", "fault"], kinds
        decision, fault = result["events"][0][1], result["events"][1][1]
        assert decision["mode"] == "recovery_verified" and decision["step"] == 4
        assert fault["kind"] == "sdc" and fault["ranks"] == [1] and fault["step"] == 6
    # A run without SCOUT on the same storage writes a newer, uncertified capture (step 6)...
    second = run_ranks(_train, 4, folder, 6, False, timeout=200)
    assert [r["resumed"] for r in second] == [4] * 4 and second[0]["own_steps"] == [4, 6]
    # ...which the persisted SDC decision keeps out of the next SCOUT-enabled start.
    third = run_ranks(_train, 4, folder, 4, timeout=200)
    assert [r["resumed"] for r in third] == [4] * 4


def test_healthy_run_certifies_every_capture(tmp_path):
    results = run_ranks(_train, 4, str(tmp_path), 6, timeout=200)
    for result in results:
        assert result["own_steps"] == [4, 6] and result["verified"] == [6, 4, 2]
        assert result["events"] == []
