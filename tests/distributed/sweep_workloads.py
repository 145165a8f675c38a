"""Rank function for the full-catalog sweep tests (module-level so child ranks can import it).

Every rank trains the same TinyLM replica under DDP with enable_resiliency (SCOUT checks and
GEMINI captures every 2 steps), then a scenario prepares or corrupts this rank before the
recovery calls. What each rank saw comes back as plain JSON-ready data.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from lm_resiliency import InMemoryCkptConfig, RecoveryMode, ReplayHarnessConfig, enable_resiliency
from lm_resiliency.scout.signature import structure_signature
from tests.distributed.scout_workloads import make_model, recording_hooks, sign_flip

DONE_KEY = "test/sweep/done"


def _flip_one_weight_bit(module: torch.nn.Module) -> None:
    with torch.no_grad():
        module.weight.view(-1).view(torch.int32)[5] ^= 1 << 22  # a high mantissa bit of one weight


def _device_lost(module, args):
    raise RuntimeError("device lost")


def run(rank, world, folder, steps, scenario, fault_rank, timeout_s):
    """Train `steps` steps, apply `scenario`, call prepare_recovery; returns what this rank saw.

    scenario: "clean" (hang and uncertain, model switched to eval mode first), "sign_flip" (rank `fault_rank` negates one element of
    layers.1's output from now on), "parameter" (one bit of layers.0.lin.weight flipped on
    `fault_rank`), "raises" (layers.2 raises on `fault_rank`), "absent" (`fault_rank` never calls prepare_recovery and leaves once the others
    are done), "rank_local" (rank 0 alone decides a straggler and an inaccessible hang, then every
    rank sweeps)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    events = []
    hooks = recording_hooks(events)
    session = enable_resiliency(
        ddp, optimizer, interval=2, orchestration=hooks,
        fault_callback=lambda result: events.append(("callback", sorted({r for c in result.checks
                                                                         for r in c.faulty}))),
        checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="sweep", timeout_s=60),
        replay=ReplayHarnessConfig(hang_stall_threshold_s=120, monitor_poll_interval_s=0.5,
                                   full_sweep_timeout_s=timeout_s))
    for step in range(steps):
        tokens = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(1000 * rank + step))
        ddp(tokens).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if scenario == "sign_flip" and rank == fault_rank:
        model.layers[1].register_forward_hook(sign_flip, with_kwargs=True)
    if scenario == "parameter" and rank == fault_rank:
        _flip_one_weight_bit(model.layers[0].lin)
    if scenario == "raises" and rank == fault_rank:
        model.layers[2].register_forward_pre_hook(_device_lost)
    if scenario == "clean":
        model.eval()   # the sweep replays in the recorded (train) mode and must put eval back
    state, rng = structure_signature(list(model.state_dict().values())), torch.get_rng_state()
    decisions = []
    store = dist.distributed_c10d._get_default_store()
    if scenario == "absent" and rank == fault_rank:
        while store.add(DONE_KEY, 0) < world - 1:  # blocked elsewhere until every other rank has decided
            time.sleep(0.1)
    else:
        if scenario == "rank_local" and rank == 0:
            decisions.append(_decide(session, "straggler"))
            decisions.append(_decide(session, "hang", all_ranks_accessible=False))
        decisions.append(_decide(session, "hang"))
        if scenario in ("clean", "rank_local"):
            decisions.append(_decide(session, "uncertain"))
        store.add(DONE_KEY, 1)
    persisted = (session.manager.store.read_status() or {}).get("trust", {})   # none before a boundary
    prefix = session.scout.sweep._prefix
    while store.add(DONE_KEY, 0) < (world - 1 if scenario == "absent" else world):
        time.sleep(0.05)   # every caller has returned, so the last of each call has released it
    leftover = [c for c in range(3) if store.check([f"{prefix}/call-{c}/ready/{rank}"])]
    seen = {"decisions": decisions, "events": events,
            "untouched": structure_signature(list(model.state_dict().values())) == state
            and torch.equal(torch.get_rng_state(), rng),
            "training": sorted({m.training for m in model.modules()}),
            "latched": session.ledger.requires_verified_recovery,
            "persisted_latch": persisted.get("sdc_pending", False), "leftover_calls": leftover}
    session.close()
    return seen


def _decide(session, failure, **kwargs):
    """prepare_recovery's decision as orchestration receives it, checked against the mode it returns."""
    mode = session.prepare_recovery(failure, **kwargs)
    decision = session.last_recovery_decision
    assert mode is RecoveryMode(decision["mode"]), (mode, decision)
    return json.loads(json.dumps(decision, allow_nan=False))


def sharded(rank, world, folder):
    """An FSDP2-sharded model trained past a check step; returns its prepare_recovery("hang")."""
    from tests.distributed.session_workloads import batch, build

    model, wrapped, features = build("fsdp2", rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = enable_resiliency(wrapped, optimizer, interval=2,
                                checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="sharded", timeout_s=60))
    for step in range(2):
        wrapped(batch(step, rank, features)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    decision = _decide(session, "hang")
    session.close()
    return decision
