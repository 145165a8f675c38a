"""MoE scenarios for tests/distributed/test_moe_replay.py on the small expert-parallel MoE of
benchmarks/_moe_model.py (tokens dispatched with all_to_all_single, EP x expert-DP), at its
default sizes."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._moe_model import MoESizes, TinyMoE, average_expert_gradients, build
from lm_resiliency import (
    BalancedAndPermutationPolicy,
    CallbackDurableCheckpointAdapter,
    CorruptionOperation,
    DurableCheckpointConfig,
    FaultMagnitude,
    FaultScope,
    GroupedExpertMaterializer,
    InMemoryCkptConfig,
    ReplayHarnessConfig,
    ReplayWorkload,
    enable_resiliency,
)
from lm_resiliency.faults.corruption import corrupt_tensor

WIDTH, VOCAB = MoESizes().width, MoESizes().vocab


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1000 * rank + step))


def train(rank: int, world: int, ep: int, steps: int, config: Dict[str, Any], *,
          catalog: Optional[list] = None, hierarchical: bool = False,
          fault: Optional[Callable[[int, TinyMoE], None]] = None, session_options: Optional[dict] = None,
          trust: Optional[list] = None, fault_at: int = 1, at_end: Optional[Callable[[Any], None]] = None) -> list:
    """Train `steps` steps under enable_resiliency; returns every unhealthy ReplayResult seen on
    this rank as plain data: [(step, [(check, path, verdict, faulty, group_ranks)], [stragglers])]."""
    ddp, model, optimizer, mesh, edp_group = build(rank, world, ep, hierarchical)
    seen: list = []
    replay = dict(config)
    if catalog is not None:
        replay["workload"] = ReplayWorkload.from_moe_catalog(
            catalog, replay_modules=[model.moe.experts], materializer=GroupedExpertMaterializer(), device_mesh=mesh)
    session = enable_resiliency(ddp, optimizer, replay=ReplayHarnessConfig(**replay),
                                fault_callback=seen.append, **(session_options or {"enable_checkpoint": False}))
    for step in range(session.step_count, steps):
        if fault is not None and step + 1 == fault_at:  # from optimizer step `fault_at` on
            fault(rank, model)
        ddp(batch(rank, step)).pow(2).mean().backward()
        average_expert_gradients(model, edp_group)
        optimizer.step()
        optimizer.zero_grad()
        if trust is not None:
            doc = session.ledger.trust()
            trust.append((session.step_count, doc["candidate_step"], doc["recovery_verified_step"],
                          doc["sdc_pending"]))
    if at_end is not None:
        at_end(session)
    session.close()
    return [(r.step, [(c.check, c.module_path, c.verdict, list(c.faulty), list(c.group_ranks))
                      for c in r.checks if c.verdict != "clean"],
             [(s.kind, list(s.ranks), s.confirmed, s.evidence.get("measure")) for s in r.stragglers])
            for r in seen]


# -- faults (fault kit corruption, applied from the first step on one rank) ---------------------

def _corrupt_expert_output(fault_rank: int) -> Callable[[int, TinyMoE], None]:
    def install(rank: int, model: TinyMoE) -> None:
        if rank != fault_rank:
            return

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if output.numel() == 0:
                return output
            corrupted, _ = corrupt_tensor(output, fault_id="expert-sdc", operation=CorruptionOperation.BIT_FLIP,
                                          scope=FaultScope.ELEMENT, index=0, magnitude=FaultMagnitude.MODERATE)
            return corrupted
        model.moe.experts.register_forward_hook(hook)
    return install


def _wrap_all_to_all(fault_rank: int, change: Callable[[torch.Tensor], None], delay_s: float = 0.0
                     ) -> Callable[[int, TinyMoE], None]:
    """From now on this rank's all_to_all_single delivers `change`d output (or starts late)."""
    def install(rank: int, model: TinyMoE) -> None:
        if rank != fault_rank:
            return
        original = dist.all_to_all_single

        def faulty(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if delay_s:
                time.sleep(delay_s)
            work = original(output, input, *args, **kwargs)
            if output.dim() == 2 and output.shape[1] > WIDTH:  # replay or dispatch payloads, not counts
                change(output)
            return work
        dist.all_to_all_single = faulty
    return install


def _reorder(output: torch.Tensor) -> None:
    output.copy_(output.flip(0))


def _drop_first_row(output: torch.Tensor) -> None:
    if output.shape[0]:
        output[0].zero_()


# -- scenarios (run_ranks entry points) -------------------------------------------------------

CATALOG = [2, 3]
CONFIG = {"check_interval": 2, "all_to_all_policy": None}


def clean(rank: int, world: int, ep: int) -> list:
    return train(rank, world, ep, 6, dict(CONFIG, all_to_all_policy=BalancedAndPermutationPolicy(65536)),
                 catalog=CATALOG)


def expert_fault(rank: int, world: int, ep: int, fault_rank: int) -> list:
    return train(rank, world, ep, 4, CONFIG, catalog=CATALOG, fault=_corrupt_expert_output(fault_rank))


def all_to_all_fault(rank: int, world: int, kind: str, fault_rank: int) -> list:
    change = {"reorder": _reorder, "drop": _drop_first_row}[kind]
    return train(rank, world, 2, 4, dict(CONFIG, all_to_all_policy=BalancedAndPermutationPolicy(4096)), catalog=CATALOG,
                 fault=_wrap_all_to_all(fault_rank, change))


def all_to_all_delay(rank: int, world: int, fault_rank: int) -> list:
    config = dict(CONFIG, all_to_all_policy=BalancedAndPermutationPolicy(4096), straggler_confirmation_rounds=2)
    return train(rank, world, 2, 4, config, hierarchical=True, catalog=CATALOG,
                 fault=_wrap_all_to_all(fault_rank, lambda out: None, delay_s=0.15))


def certification(rank: int, world: int, folder: str, fault_from: Optional[int], steps: int = 8,
                  durable: bool = False) -> Any:
    """`steps` steps, K=2 recipes, GEMINI capture and SCOUT check every 2 steps; returns the
    ledger's (step, candidate, recovery-verified, sdc pending) after each step. `fault_from`:
    rank 1's expert output is corrupted from that step on. `durable`: with a
    CallbackDurableCheckpointAdapter, also returns the framework callbacks this rank saw."""
    trust: list = []
    calls: list = []
    options: Dict[str, Any] = {
        "interval": 2, "checkpoint": InMemoryCkptConfig(run_id="moe-cert", disk_folder=f"{folder}/{rank}",
                                                        timeout_s=60)}
    if durable:
        def save(step: int) -> str:
            calls.append(["save", step])
            return f"job-ckpt-{step}"
        adapter = CallbackDurableCheckpointAdapter(
            save_candidate_fn=save, load_checkpoint_fn=lambda i, s: calls.append(["load", i, s]),
            commit_candidate_fn=lambda i, s: calls.append(["commit", i]),
            quarantine_candidate_fn=lambda i, s, r: calls.append(["quarantine", i]))
        options["durable_checkpoint"] = DurableCheckpointConfig(f"{folder}/manifests", "moe-env", adapter)
    train(rank, world, 2, steps, CONFIG, catalog=CATALOG, fault=_corrupt_expert_output(1) if fault_from else None,
          session_options=options, trust=trust, fault_at=fault_from or 1)
    return (trust, calls) if durable else trust


def certification_durable(rank: int, world: int, folder: str) -> Any:
    return certification(rank, world, folder, 9, steps=10, durable=True)


def recovery_sweep(rank: int, world: int, fault_rank: Optional[int]) -> tuple:
    """Train 4 steps (checks at 2 and 4), then prepare_recovery("hang") on every rank: the mode
    chosen and the workload entries the sweep voted on (check, label, verdict, faulty)."""
    decisions: list = []

    def prepare(session: Any) -> None:
        session.prepare_recovery("hang", all_ranks_accessible=True)
        decision = session.last_recovery_decision
        result = session.last_replay_result if "SDC" in decision.reason else None
        decisions.append((decision.mode, decision.reason, result))
    train(rank, world, 2, 4, CONFIG, catalog=CATALOG, at_end=prepare,
          fault=_corrupt_expert_output(fault_rank) if fault_rank is not None else None, fault_at=4)
    mode, reason, result = decisions[0]
    voted = [] if result is None else [(c.check, c.module_path, c.verdict, list(c.faulty))
                                       for c in result.checks if c.check == "expert"]
    return mode, reason, voted
