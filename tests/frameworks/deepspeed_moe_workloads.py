"""DeepSpeed MoE training loops for tests/frameworks/test_deepspeed_moe.py (forked from the DeepSpeed
zygote of deepspeed_workloads.py): a `deepspeed.moe.layer.MoE` (top-1, `num_experts` over `ep_size`
expert-parallel ranks) between two dense layers, trained with DeepSpeed's ZeRO optimizer over the
MoE parameter groups DeepSpeed's `split_params_into_different_moe_groups_for_optimizer` builds."""

from __future__ import annotations

import os
import random
import signal
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from lm_resiliency import (
    CorruptionOperation,
    FaultMagnitude,
    FaultScope,
    InMemoryCkptConfig,
    ReplayHarnessConfig,
    ReplayWorkload,
    enable_resiliency,
)
from lm_resiliency.faults.corruption import corrupt_tensor
from tests.frameworks.deepspeed_workloads import final_state, init_ranks

FEATURES, WIDTH, EXPERTS, MICRO_BATCH = 8, 8, 4, 4


class MoENet(nn.Module):
    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        expert = nn.Sequential(nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, WIDTH))
        self.moe = MoE(hidden_size=WIDTH, expert=expert, num_experts=EXPERTS, ep_size=ep_size, k=1, min_capacity=4)
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        m, l_aux, _ = self.moe(h)
        return self.out(h + m).pow(2).mean() + 0.01 * l_aux


def build_engine(rank: int, ep_size: int, stage: int):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(0)
    np.random.seed(rank)  # forked ranks would otherwise inherit whatever the zygote's streams hold
    random.seed(rank)
    model = MoENet(ep_size)
    with torch.no_grad():  # experts differ per rank; deepspeed.initialize makes them equal over expert DP
        gen = torch.Generator().manual_seed(7 + rank)
        for p in model.moe.deepspeed_moe.experts.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10_000}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=0.02), config=config)
    return engine


def train_step(engine, step: int, rank: int) -> None:
    x = torch.randn(MICRO_BATCH, FEATURES, generator=torch.Generator().manual_seed(1000 * rank + step))
    engine.backward(engine(x))
    engine.step()


def topology(rank: int, world: int, ep_size: int) -> Dict[str, Any]:
    """The DeepSpeed adapter's topology descriptor of an MoE engine, and DeepSpeed's own groups."""
    import torch.distributed as dist

    from lm_resiliency.callbacks.deepspeed import build_adapter

    init_ranks(rank)
    engine = build_engine(rank, ep_size, 1)
    descriptor = build_adapter(engine).topology().descriptor
    name = f"ep_size_{ep_size}"
    return {"descriptor": {k: descriptor.get(k) for k in ("ep", "expert_peer_groups", "expert_groups",
                                                          "expert_modules", "dp_world_size")},
            "own_edp": dist.get_process_group_ranks(engine.expert_data_parallel_group[name]),
            "own_ep": dist.get_process_group_ranks(engine.expert_parallel_group[name])}


def _corrupt_experts(engine) -> None:
    """From now on this rank's expert stage returns a bit-flipped first element (fault kit)."""
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        corrupted, _ = corrupt_tensor(output, fault_id="ds-expert-sdc", operation=CorruptionOperation.BIT_FLIP,
                                      scope=FaultScope.ELEMENT, index=0, magnitude=FaultMagnitude.MODERATE)
        return corrupted
    engine.module.moe.deepspeed_moe.experts.register_forward_hook(hook)


def expert_replay(rank: int, world: int, ep_size: int, stage: int, fault_rank: Optional[int],
                  steps: int = 4) -> List[tuple]:
    """`steps` steps with SCOUT's expert replay every 2 steps (the expert peers from the adapter's
    topology: no device mesh given) and dense replay of the rest; `fault_rank`'s experts are
    corrupted from the first step. Returns the non-clean checks: [(step, check, label, verdict,
    faulty, group ranks)], and the replay peer groups (dense, expert)."""
    init_ranks(rank)
    engine = build_engine(rank, ep_size, stage)
    experts = engine.module.moe.deepspeed_moe.experts
    # DeepSpeed's capacity-based dispatch runs every local expert on exactly `capacity` rows: one
    # regime. The expert stage's input is (ep_size, local experts, capacity, width); the recipe keeps
    # its ep_size leading rows, so the replay is the captured invocation itself.
    workload = ReplayWorkload.from_shapes([ep_size], replay_modules=[experts], peer_role="expert")
    seen: list = []
    session = enable_resiliency(engine, enable_checkpoint=False, fault_callback=seen.append,
                                replay=ReplayHarnessConfig(check_interval=2, workload=workload, all_to_all_policy=None))
    if rank == fault_rank:
        _corrupt_experts(engine)
    for step in range(steps):
        train_step(engine, step, rank)
    scout = session.scout
    peers = (list(scout.detector.group_ranks), list(scout.workload_detector.group_ranks),
             [p for p, _ in scout.detector.catalog.hidden] + [p for p, _ in scout.detector.catalog.remaining])
    session.close()
    return [(r.step, c.check, c.module_path, c.verdict, list(c.faulty), list(c.group_ranks))
            for r in seen for c in r.checks if c.verdict != "clean"], peers


def gemini(rank: int, world: int, ep_size: int, stage: int, folder: Optional[str], steps: int,
           kill_after: Optional[int] = None) -> tuple:
    """`steps` steps (folder None: plain DeepSpeed), GEMINI every 2 steps; `kill_after`: SIGKILL
    after that step once the previous capture is on disk. Returns (resumed step, final state)."""
    init_ranks(rank)
    engine = build_engine(rank, ep_size, stage)
    session, start = None, 0
    if folder is not None:
        session = enable_resiliency(
            engine, interval=2, enable_detection=False,
            checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id="ds-moe",
                                          replication_jump=1, timeout_s=60))
        start = session.step_count
    for step in range(start, steps):
        train_step(engine, step, rank)
        if session is not None and kill_after is not None and step + 1 == kill_after:
            session.flush_for_restart()
            session.manager._drain()
            os.kill(os.getpid(), signal.SIGKILL)
    state = final_state(engine, stage, {})
    if session is not None:
        session.close()
    return start, state
