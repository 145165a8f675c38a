"""What the demo trains, how lm-resiliency is configured, and the built-in fault campaign.

Everything that must be identical in the baseline run and the faulty run lives here: the model,
the data (a function of (step, rank) only), the optimizer and the GEMINI/SCOUT configuration.

Timeline of the built-in campaign (training iterations, numbered like optimizer steps; GEMINI
captures and SCOUT checks every INTERVAL=2 steps):

  iter  9-10  rank 1: its hidden layer `layers.1` returns sign-flipped activations (SDC). SCOUT's
              hidden-layer replay at step 10 samples `layers.1`; the vote blames rank 1, the
              capture of step 10 is vetoed and the ranks stop; the restart must load the newest
              RECOVERY_VERIFIED step (8), not anything captured after the corruption began.
  iter 12-14  rank 2 computes slowly (a 0.3 s delay in `embed`): SCOUT's replay timings flag
              it at step 12 and confirm it at step 14. Training goes on.
  iter 18     rank 3 blocks (a bounded hang) before its forward; the others wait in the
              gradient all-reduce. SCOUT's out-of-band monitor names rank 3; the supervisor
              kills the generation and relaunches; the ranks resume from step 16.
  iter 23     one byte of rank 1's node-local shard of step 20 flips (GEMINI CRCs are on), and
              rank 0 is SIGKILLed. The supervisor sees the death; the relaunched ranks pick
              step 20; rank 1's own shard is rejected and its state comes from the replica that
              rank 3 holds.

An occurrence is claimed only when its fault is performed, so one armed by a generation that
then stops (at the iteration right after a restart-causing one) is injected by the next
generation when it replays that iteration.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

WORLD = 4
STEPS = 30
INTERVAL = 2           # GEMINI capture and SCOUT check cadence (enable_resiliency(interval=...))
BATCH = 16
FEATURES = 16
HIDDEN = 32
OUTPUTS = 4
LR = 1e-2
BUCKET_CAP_MB = 0.004  # about 4 KB: four DDP gradient buckets
HANG_THRESHOLD_S = 4.0
MONITOR_POLL_S = 0.25
STRAGGLER_DELAY_S = 0.3
HANG_SECONDS = 120.0   # bounded, far longer than detection + the supervisor's kill
RUN_TIMEOUT_S = 60     # gloo / GEMINI bounds inside the ranks

SDC_RANK, STRAGGLER_RANK, HANG_RANK, SHARD_RANK, KILL_RANK = 1, 2, 3, 1, 0
SDC_AT, STRAGGLER_AT, HANG_AT, SHARD_AT, KILL_AT = 9, 12, 18, 23, 23
SDC_ITERATIONS, STRAGGLER_ITERATIONS = 2, 3
SDC_LAYER = "layers.1"
CORRUPTED_STEP = 20


def build_model():
    """embed -> 3 hidden layers (a ModuleList, so SCOUT rotates its hidden check over them) -> head."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(FEATURES, HIDDEN)
            self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
            self.head = nn.Linear(HIDDEN, OUTPUTS)

        def forward(self, x):
            x = torch.tanh(self.embed(x))
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def wrap_ddp(model):
    """DistributedDataParallel with small gradient buckets, so that this small model spans
    several, as a large one does with the default 25 MB."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)


def register_traced_allreduce(ddp) -> None:
    """DDP's stock all-reduce as a Python communication hook. DDP's own C++ bucket all-reduces
    are invisible to SCOUT's hang rule, so a rank that blocks before its forward would look like
    every other stalled rank; issued from Python, each bucket's all-reduce is traced, and the
    blocked rank is the one that launched fewer (docs/scout.md, "The out-of-band monitor")."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.allreduce_hook)


def build_optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR)


def batch(step: int, rank: int) -> Tuple["object", "object"]:
    """The batch of `rank` at optimizer step `step`: a fixed teacher's regression targets.
    Depends on (step, rank) only, so a replayed step sees exactly the same data."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    teacher = torch.Generator().manual_seed(12345)
    w = torch.randn(FEATURES, OUTPUTS, generator=teacher) / FEATURES ** 0.5
    y = torch.sin(x @ w) + 0.5 * x[:, :OUTPUTS]
    return x, y


def checkpoint_config(disk_folder: str, run_id: str):
    """GEMINI: capture every INTERVAL steps, replicate to rank+2, flush every capture to the
    node-local folder, CRC every shard. Host slots in process memory ("heap"): a relaunched
    worker recovers from the peer replica or node-local disk, where the corrupted shard lives."""
    from lm_resiliency import InMemoryCkptConfig

    options = dict(interval=INTERVAL, replication_jump=2, disk_flush_interval=INTERVAL,
                   disk_folder=disk_folder, run_id=run_id, verify_integrity=True,
                   timeout_s=float(RUN_TIMEOUT_S) / 3)
    if "host_memory" in getattr(InMemoryCkptConfig, "__dataclass_fields__", {}):
        options["host_memory"] = "heap"
    return InMemoryCkptConfig(**options)


def replay_config():
    """SCOUT: checks every INTERVAL steps (set by enable_resiliency), small hang threshold, and a
    straggler margin well above scheduler noise on an oversubscribed 2-core machine."""
    from lm_resiliency import ReplayHarnessConfig

    return ReplayHarnessConfig(hang_stall_threshold_s=HANG_THRESHOLD_S, monitor_poll_interval_s=MONITOR_POLL_S,
                               straggler_min_margin_s=0.1, straggler_min_ratio=2.0,
                               straggler_confirmation_rounds=2)


def build_campaign():
    """The built-in campaign (also written to <out>/campaign.json as a manifest)."""
    from lm_resiliency.faults import (CorruptionOperation, FailureType, FaultCampaign, FaultIncident,
                                      FaultScope, FaultSpec, FaultSurface, FaultTarget, IncidentLifetime,
                                      IncidentTrigger)

    def incident(incident_id, at, spec, lifetime=None, description=""):
        return FaultIncident(incident_id=incident_id, trigger=IncidentTrigger(at=(at,)), faults=(spec,),
                             lifetime=lifetime or IncidentLifetime(), description=description)

    return FaultCampaign(
        name="make-demo",
        seed=2024,
        description="hidden SDC, compute straggler, corrupted node-local shard, killed rank, hang",
        incidents=(
            incident("hidden-sdc", SDC_AT, FaultSpec(
                fault_id="hidden-sign-flip", type=FailureType.TENSOR_CORRUPTION,
                target=FaultTarget(rank=SDC_RANK, module_path=SDC_LAYER, surface=FaultSurface.OUTPUT),
                parameters={"operation": CorruptionOperation.SIGN_FLIP.value, "scope": FaultScope.FULL.value}),
                IncidentLifetime(iterations=SDC_ITERATIONS),
                f"rank {SDC_RANK}'s {SDC_LAYER} returns sign-flipped activations for {SDC_ITERATIONS} iterations"),
            incident("slow-rank", STRAGGLER_AT, FaultSpec(
                fault_id="slow-embed", type=FailureType.DELAY,
                target=FaultTarget(rank=STRAGGLER_RANK, module_path="embed", surface=FaultSurface.OUTPUT),
                parameters={"seconds": STRAGGLER_DELAY_S}),
                IncidentLifetime(iterations=STRAGGLER_ITERATIONS),
                f"rank {STRAGGLER_RANK} computes its first layer {STRAGGLER_DELAY_S}s slower for "
                f"{STRAGGLER_ITERATIONS} iterations"),
            incident("hung-rank", HANG_AT, FaultSpec(
                fault_id="block", type=FailureType.HANG,
                target=FaultTarget(rank=HANG_RANK, surface=FaultSurface.PROCESS),
                parameters={"seconds": HANG_SECONDS}),
                description=f"rank {HANG_RANK} blocks before its forward (bounded at {HANG_SECONDS:.0f}s)"),
            incident("bad-shard", SHARD_AT, FaultSpec(
                fault_id="flip-shard-byte", type=FailureType.CHECKPOINT_CORRUPTION,
                target=FaultTarget(rank=SHARD_RANK, surface=FaultSurface.CHECKPOINT),
                parameters={"kind": "own", "step": CORRUPTED_STEP}),
                description=f"one byte of rank {SHARD_RANK}'s node-local GEMINI shard of step {CORRUPTED_STEP} flips"),
            incident("killed-rank", KILL_AT, FaultSpec(
                fault_id="sigkill", type=FailureType.PROCESS_TERMINATION,
                target=FaultTarget(rank=KILL_RANK, surface=FaultSurface.PROCESS),
                parameters={"signal": "SIGKILL"}),
                description=f"rank {KILL_RANK} is SIGKILLed at the start of the iteration"),
        ),
    )


def executor(disk_folder: Optional[str]):
    """The kit's LocalFaultExecutor, allowed to kill a rank and to corrupt GEMINI shards."""
    from lm_resiliency.faults import LocalFaultExecutor

    return LocalFaultExecutor(allow_process_termination=True, checkpoint_folder=disk_folder)


def paths(root: str, label: str) -> dict:
    """Where a run (`label`: "baseline" or "managed") keeps its working files."""
    base = os.path.join(root, "work", label)
    return {
        "base": base,
        "gemini": os.path.join(base, "gemini"),
        "events": os.path.join(base, "events"),
        "final": os.path.join(base, "final"),
        "logs": os.path.join(base, "logs"),
        "rendezvous": os.path.join(base, "rendezvous"),
        "journal": os.path.join(base, "campaign", "journal.jsonl"),
        "state": os.path.join(base, "campaign", "state.json"),
        "sandbox": os.path.join(base, "campaign", "sandbox"),
    }
