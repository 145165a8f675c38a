"""The recovery handoff as a manager sees it (module level so child ranks can import it).

A plain DDP loop with lm-resiliency attached by one call, SCOUT and GEMINI on (interval 2, every
check replaying the first layer). Orchestration hooks forward every payload the library hands them
with ``json.dumps`` — what a manager that relays them to a control plane does — into one JSON-lines
file per rank. With `fault_from_step`, rank 1's first layer computes wrong outputs from that step
on (a faulty device); after `stop_after` steps every rank calls ``prepare_recovery("sdc")``, writes
the mode it returned, flushes and is SIGKILLed, as the launcher would end a job that hit SDC.
"""

import json
import os
import signal

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, OrchestrationHooks, ReplayHarnessConfig, enable_resiliency
from tests.distributed.session_workloads import batch, build, final_state


def _corrupt(module, args, output):
    out = output.clone()
    flat = out.view(-1)
    flat[int(flat.abs().argmax())] *= -1
    return out


def train(rank, world, folder, steps, recovery_mode=None, fault_from_step=None, stop_after=None):
    """Returns (resumed step, final state) when it runs to `steps`."""
    model, wrapped, features = build("ddp_forward", rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    counter = {"samples": 0}
    os.makedirs(folder, exist_ok=True)
    control_plane = open(os.path.join(folder, f"control-plane-{rank}.jsonl"), "a")

    def relay(kind):
        def send(payload):
            control_plane.write(json.dumps({kind: payload}, allow_nan=False) + "\n")
            control_plane.flush()
        return send

    session = enable_resiliency(
        wrapped, optimizer, scheduler=scheduler, interval=2,
        checkpoint=InMemoryCkptConfig(run_id="handoff", disk_folder=os.path.join(folder, "gemini"),
                                      disk_flush_interval=2, replication_jump=1, timeout_s=60,
                                      shared_memory_dir=os.path.join(folder, "shm")),
        replay=ReplayHarnessConfig(rotate_layers=False),
        extra_state_fn=lambda: {"counter": dict(counter)},
        load_extra_state_fn=lambda extra: counter.update(extra["counter"]),
        orchestration=OrchestrationHooks(report_fault=relay("fault"), report_recovery=relay("recovery")),
        recovery_mode=recovery_mode,
    )
    resumed = session.step_count
    for step in range(session.step_count, steps):
        if fault_from_step is not None and step + 1 == fault_from_step and rank == 1:
            model.layers[0].register_forward_hook(_corrupt)
        wrapped(batch(step, rank, features)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter["samples"] += 8
        if stop_after is not None and step + 1 == stop_after:
            mode = session.prepare_recovery("sdc")
            with open(os.path.join(folder, f"mode-{rank}.json"), "w") as f:
                json.dump(mode, f)   # a RecoveryMode is a str enum: its JSON is its value
            session.flush_for_restart()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    result = final_state(model, optimizer, scheduler, counter)
    session.close()
    control_plane.close()
    return resumed, result
