"""Models, loops and child-process functions shared by the fault-injection tests.

Module-level so that forkserver children (tests.harness.run_ranks, multiprocessing) can import them.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from lm_resiliency.faults import (CampaignJournal, CorruptionOperation, FailureType, FaultCampaign,
                                  FaultIncident, FaultScope, FaultSpec, FaultSurface, FaultTarget,
                                  IncidentLifetime, IncidentTrigger, IterationRange, JsonCampaignStateStore,
                                  LocalFaultExecutor, enable_fault_injection)


class TinyNet(torch.nn.Module):
    """`layers.0` .. `layers.3`: four Linear(4, 4) with ReLU in between."""

    def __init__(self, width: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, optimizer


def batches(n: int, seed: int = 1) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g) for _ in range(n)]


def train(model, optimizer, data, forwards_per_step: int = 1) -> None:
    """A plain, unchanged training loop."""
    for x in data:
        for _ in range(forwards_per_step):
            loss = model(x).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sdc_campaign(rank: int, at: int = 3) -> FaultCampaign:
    return FaultCampaign(name="sdc", incidents=(FaultIncident(
        incident_id="sdc", trigger=IncidentTrigger(at=(at,)), lifetime=IncidentLifetime(matching_calls=1),
        faults=(FaultSpec(fault_id="flip", type=FailureType.TENSOR_CORRUPTION,
                          target=FaultTarget(rank=rank, module_path="layers.1", surface=FaultSurface.OUTPUT),
                          parameters={"operation": CorruptionOperation.SIGN_FLIP.value,
                                      "scope": FaultScope.FULL.value}),)),))


# --------------------------------------------------------------------- gloo: target rank only

def gloo_corrupt_one_rank(rank: int, world_size: int, journal_path: str) -> dict:
    import torch.distributed as dist

    model, optimizer = make_model()
    reference, ref_opt = make_model()
    data = batches(5)
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(rank=1),
                                    journal=CampaignJournal(journal_path))
    seen = {}
    model.layers[1].register_forward_hook(
        lambda m, a, out: seen.setdefault(faults.iteration, out.detach().clone()))
    ref_seen = {}
    reference.layers[1].register_forward_hook(
        lambda m, a, out: ref_seen.setdefault(len(ref_seen) + 1, out.detach().clone()))
    train(model, optimizer, data)
    train(reference, ref_opt, data)
    faults.close()
    dist.barrier()
    flags = [None] * world_size
    dist.all_gather_object(flags, {
        "rank": faults.rank, "world": faults.world_size,
        "records": [r.to_json() for r in faults.records],
        "iteration3_equal": bool(torch.equal(seen[3], ref_seen[3])),
        "iteration3_negated": bool(torch.equal(seen[3], -ref_seen[3])),
        "iteration2_equal": bool(torch.equal(seen[2], ref_seen[2])),
        "params_equal": bool(torch.equal(flat_params(model), flat_params(reference))),
    })
    return {"all": flags, "journal": len(CampaignJournal(journal_path).records())}


# --------------------------------------------------------------------- process termination

def kill_self_at_iteration(rank: int, world_size: int, journal_path: str, state_path: str) -> int:
    campaign = FaultCampaign(name="kill", incidents=(FaultIncident(
        incident_id="kill", trigger=IncidentTrigger(at=(3,)),
        faults=(FaultSpec(fault_id="sigkill", type=FailureType.PROCESS_TERMINATION,
                          target=FaultTarget(rank=0, surface=FaultSurface.PROCESS)),)),))
    model, optimizer = make_model()
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    enable_fault_injection(model, optimizer, campaign=campaign, rank=0,
                           executor=LocalFaultExecutor(allow_process_termination=True),
                           journal=CampaignJournal(journal_path),
                           state_store=JsonCampaignStateStore(state_path))
    data = batches(6)[start:]
    steps = 0
    for x in data:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return start + steps


# --------------------------------------------------------------------- CAS race

def race_claims(store_path: str, rounds: int, barrier, queue, worker: str) -> None:
    """Claim occurrence k in round k, in lockstep with the other process; report what we won."""
    store = JsonCampaignStateStore(store_path)
    won: List[int] = []
    swapped: List[int] = []
    for k in range(rounds):
        barrier.wait()
        if store.claim(f"incident@{k}/rank-0", {"worker": worker}):
            won.append(k)
        # Raw CAS: both read the same state, both try to swap it; at most one may succeed.
        barrier.wait()
        state = store.load()
        barrier.wait()
        updated = dict(state, values=dict(state.get("values", {}), last=f"{worker}:{k}"))
        if store.compare_and_swap(state, updated):
            swapped.append(k)
    queue.put((worker, won, swapped))


def child_env_step(step: Optional[int]) -> dict:
    return {} if step is None else {"LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP": str(step)}


# --------------------------------------------------------------------- claim at execution

def race_campaign(rounds: int) -> FaultCampaign:
    """One sign flip of `layers.1`'s output on rank 0 in each of iterations 1..rounds."""
    sdc = sdc_campaign(rank=0).incidents[0]
    return FaultCampaign(name="race", incidents=(FaultIncident(
        incident_id="race", trigger=IncidentTrigger(range=IterationRange(1, rounds + 1)),
        lifetime=sdc.lifetime, faults=sdc.faults),))


def race_for_occurrences(rank: int, world_size: int, state_path: str, journal_path: str, rounds: int) -> dict:
    """Both processes act as workers of fault rank 0 (an old one and its replacement): each arms
    every occurrence, then, in lockstep (a gloo barrier before each forward), both reach the
    hooked call of the same occurrence at once. Reports the iterations whose `layers.1` output
    this process really sign-flipped and the occurrences its session journaled as injected."""
    import torch.distributed as dist

    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=race_campaign(rounds), rank=0, world_size=1,
                                    state_store=JsonCampaignStateStore(state_path),
                                    journal=CampaignJournal(journal_path), generation=f"worker-{rank}")
    flipped: List[int] = []

    def check_flip(module, args, out):
        clean = module.forward(*args)  # the same call without hooks: the uncorrupted output
        if torch.equal(out, -clean) and bool(clean.ne(0).any()):
            flipped.append(faults.iteration)

    model.layers[1].register_forward_hook(check_flip)
    for x in batches(rounds):
        dist.barrier()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    faults.close()
    return {"flipped": flipped, "injected": [r.occurrence_id for r in faults.records if r.injected],
            "generation": faults.generation}


def stop_at_a_step_boundary(rank: int, world_size: int, state_path: str, journal_path: str, steps: int) -> dict:
    """Resume after $LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP, run until `steps` optimizer steps are
    done and return without closing the session (a worker preempted at a step boundary)."""
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=sdc_campaign(0, at=3), rank=0, world_size=1,
                                    state_store=JsonCampaignStateStore(state_path),
                                    journal=CampaignJournal(journal_path))
    train(model, optimizer, batches(steps)[start:])
    return {"active": list(faults.active_occurrences), "records": [r.to_json() for r in faults.records]}
