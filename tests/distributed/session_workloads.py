"""Training loops for the enable_resiliency tests (module level so child ranks can import them).

The loops are the plain PyTorch loop a user writes; lm-resiliency attaches with one call (and
is not even imported by `train(..., options={"plain": True})`, the same loop without it).
Data depends on the step only, dropout and numpy/python RNG make RNG restore matter, and an
LR scheduler plus caller-owned counter cover deferred and extra state.
"""

import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):
    """Two bias-free layers, head registered first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 8, bias=False)
        self.body = nn.Linear(32, 64, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.body(x))))


class ForwardNet(nn.Module):
    """The ordinary layout: a ModuleList of layers, then a head, registered in forward order. With a
    small `bucket_cap_mb` DDP spreads it over several gradient buckets; `unused` takes no part in
    the loss (for find_unused_parameters=True)."""

    def __init__(self, unused=False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 8)
        self.unused = nn.Linear(32, 32) if unused else None

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


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


def build(kind, rank, ddp_options=None):
    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)
    if kind in ("ddp", "ddp_forward"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        options = dict(ddp_options or {})
        model = Net() if kind == "ddp" else ForwardNet(unused=options.get("find_unused_parameters", False))
        return model, DDP(model, **options), 32
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


def train(rank, world, kind, folder, steps, kill_after=None, fallback_log=None, options=None):
    """Train with lm-resiliency attached. Returns (resumed step, final state, SCOUT's part: whether
its DDP gradient trace is installed and the step of its last replay check; None when plain).

    `options` (all optional): "ddp" (DistributedDataParallel keyword arguments), "accumulate"
    (micro-batches per step, all but the last under `no_sync()`), "set_to_none" (False:
    `zero_grad(set_to_none=False)`), "stop" at `kill_after`: "kill_all" (default: flush, then every
    rank SIGKILLed), "kill_one" (rank 1 SIGKILLed, the others end without closing), "graceful"
    (`flush_for_restart()`, `close()`, exit); "shm_only" (no disk: slots in shared memory under
    `folder`), "replication_jump", "plain" (the same loop without lm-resiliency, never imported),
    "restore_layout" (False: DDP's bucket layout is recorded but not restored on resume,
    adapters/pytorch.py)."""
    options = dict(options or {})
    model, wrapped, features = build(kind, rank, options.get("ddp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    counter = {"samples": 0}
    accumulate = options.get("accumulate", 1)
    stop = options.get("stop", "kill_all")
    if options.get("plain"):
        _loop(wrapped, optimizer, scheduler, counter, features, rank, 0, steps, accumulate, options)
        assert "lm_resiliency" not in sys.modules
        return 0, final_state(model, optimizer, scheduler, counter), None
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    if not options.get("restore_layout", True):
        import lm_resiliency.adapters.pytorch as pytorch_adapter

        pytorch_adapter.restore_bucket_layout = lambda ddp, layout: False
    storage = (dict(disk_flush_interval=0, disk_folder=os.path.join(folder, "disk")) if options.get("shm_only")
               else dict(disk_folder=folder, disk_flush_interval=2))
    if options:
        storage["shared_memory_dir"] = os.path.join(folder, "shm")  # what a kill leaves stays in the test

    def load_fallback():
        if fallback_log is not None:
            with open(f"{fallback_log}.{rank}", "a") as f:
                f.write("called\n")

    session = enable_resiliency(
        wrapped, optimizer, scheduler=scheduler, interval=2,
        checkpoint=InMemoryCkptConfig(run_id=f"{kind}-test", replication_jump=options.get("replication_jump", 1),
                                      timeout_s=60, **storage),
        extra_state_fn=lambda: {"counter": dict(counter)},
        load_extra_state_fn=lambda extra: counter.update(extra["counter"]),
        load_fallback=load_fallback,
    )
    resumed = session.step_count
    if _loop(wrapped, optimizer, scheduler, counter, features, rank, session.step_count, steps, accumulate, options,
             lambda step: step + 1 == kill_after and _stop(session, stop, rank, options)):
        return None
    result = final_state(model, optimizer, scheduler, counter)
    scout = None if session.scout is None else {
        "trace": session.scout._ddp_trace is not None,
        "checked": session.last_replay_result.step if session.last_replay_result is not None else None}
    session.close()
    return resumed, result, scout


def _loop(wrapped, optimizer, scheduler, counter, features, rank, start, steps, accumulate, options,
          after_step=lambda step: False):
    """Steps `start`..`steps - 1`; True when `after_step(step)` ended training early."""
    for step in range(start, steps):
        for micro in range(accumulate):
            x = batch(step * accumulate + micro, rank, features)
            if micro + 1 < accumulate:
                with wrapped.no_sync():
                    wrapped(x).pow(2).mean().backward()
            else:
                wrapped(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=options.get("set_to_none", True))
        counter["samples"] += 8
        if after_step(step):
            return True
    return False


def _stop(session, stop, rank, options):
    """Stop as `options["stop"]` says (see `train`); True when this rank returns without a result."""
    if stop == "graceful":
        session.flush_for_restart()
        session.close()
        return True
    if stop == "kill_one":
        session.manager._drain()  # the last capture is replicated before the kill
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return True
    if not options.get("shm_only"):
        session.flush_for_restart()  # the capture of the previous interval is on disk
    session.manager._drain()
    os.kill(os.getpid(), signal.SIGKILL)
    return True
