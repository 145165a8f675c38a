"""Training loops for the enable_resiliency tests (module level so child ranks can import them).

The loops are the plain PyTorch loop a user writes; lm-resiliency attaches with one call.
Data depends on the step only, dropout and numpy/python RNG make RNG restore matter, and an
LR scheduler plus caller-owned counter cover deferred and extra state.
"""

import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency import InMemoryCkptConfig, enable_resiliency


class Net(nn.Module):
    """Parameters are registered in the order backward produces their gradients (head first).
    DDP's reducer re-orders its gradient buckets into backward order after its first iteration;
    with this registration order that re-ordering is a no-op, so a restarted DDP (whose first
    iteration uses registration order) sums gradients in the same order as an uninterrupted
    one and the comparison can be bitwise. See docs/api.md, "DDP and bitwise resume"."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 8, bias=False)
        self.body = nn.Linear(32, 64, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.body(x))))


class Stack(nn.Module):
    """A small layered model for FSDP2/HSDP: each layer is sharded separately and the root keeps
    a parameter of its own (`out`), which the root's FSDP unit unshards in its pre-forward hook."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.out(x)


def batch(step, rank, features):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(8, features, generator=g)
    # The global numpy and python RNG streams feed the data too: their restore is checked.
    return x + float(np.random.rand()) * 1e-3 + random.random() * 1e-3


def build(kind, rank):
    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = Net()
        return model, DDP(model), 32
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Stack()
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (world,)) if kind == "fsdp2"
            else init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model, 16


def local(t):
    return t.to_local().detach().clone() if hasattr(t, "to_local") else t.detach().clone()


def final_state(model, optimizer, scheduler, counter):
    opt = optimizer.state_dict()
    return {
        "model": {k: local(v) for k, v in model.state_dict().items()},
        "optimizer": {i: {k: local(v) for k, v in s.items()} for i, s in opt["state"].items()},
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "counter": dict(counter),
    }


def train(rank, world, kind, folder, steps, kill_after=None, fallback_log=None):
    """Train with lm-resiliency attached. Returns (resumed step, final state)."""
    model, wrapped, features = build(kind, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    counter = {"samples": 0}

    def load_fallback():
        if fallback_log is not None:
            with open(f"{fallback_log}.{rank}", "a") as f:
                f.write("called\n")

    session = enable_resiliency(
        wrapped, optimizer, scheduler=scheduler, interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id=f"{kind}-test",
                                      replication_jump=1, timeout_s=60),
        extra_state_fn=lambda: {"counter": dict(counter)},
        load_extra_state_fn=lambda extra: counter.update(extra["counter"]),
        load_fallback=load_fallback,
    )
    resumed = session.step_count
    for step in range(session.step_count, steps):
        loss = wrapped(batch(step, rank, features)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter["samples"] += 8
        if kill_after is not None and step + 1 == kill_after:
            session.flush_for_restart()  # the capture of the previous interval is on disk
            session.manager._drain()
            os.kill(os.getpid(), signal.SIGKILL)
    result = final_state(model, optimizer, scheduler, counter)
    session.close()
    return resumed, result
