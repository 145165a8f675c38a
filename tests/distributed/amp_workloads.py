"""DDP training loops with a GradScaler and/or torch.compile for the AMP/compile gloo tests
(module level so child ranks can import them)."""

import os
import random
import signal

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from tests.distributed.session_workloads import Net, batch


def build(compile_mode, rank):
    torch.manual_seed(0)
    np.random.seed(rank)  # batch() draws from the numpy and python streams too
    random.seed(rank)
    model = Net()
    if compile_mode == "ddp_of_compiled":
        return model, DDP(torch.compile(model, backend="eager"))
    if compile_mode == "compiled_ddp":
        return model, torch.compile(DDP(model), backend="eager")
    return model, DDP(model)


def train(rank, world, folder, steps, kill_after, compile_mode, use_scaler, overflow):
    """Returns (resumed step, [(loop step, step_count)], final state). `overflow`: (loop step, rank)
    pairs whose batch holds an inf; DDP's all-reduce spreads it, so every rank's scaler skips."""
    model, wrapped = build(compile_mode, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, enabled=use_scaler)
    session = enable_resiliency(
        wrapped, optimizer, interval=2, **({"scaler": scaler} if use_scaler else {}),
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id="amp-test",
                                      replication_jump=1, timeout_s=60))
    resumed, counters = session.step_count, []
    for step in range(session.step_count, steps):
        x = batch(step, rank, 32)
        if (step, rank) in overflow:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_scaler):
            loss = wrapped(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        counters.append((step + 1, session.step_count))
        if kill_after is not None and step + 1 == kill_after:
            session.flush_for_restart()
            session.manager._drain()
            os.kill(os.getpid(), signal.SIGKILL)
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": {i: dict(s) for i, s in optimizer.state_dict()["state"].items()},
             "scaler": scaler.state_dict(), "torch_rng": torch.get_rng_state()}
    session.close()
    return resumed, counters, state
