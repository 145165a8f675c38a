"""Rank functions for test_fault_binding.py: the fault kit bound to Megatron Core model chunks, a
DeepSpeed engine alone and a TorchTitan Trainer alone, each framework's own loop unchanged.

Every campaign has one incident: a fault on one module's output at a few ticks. A recording executor notes, at the
matching call, the kit's iteration and the framework's own step, so the test sees which of the
framework's steps the kit's clock counted.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple



def _campaign(module_path: str, ticks: Tuple[int, ...] = (3,)) -> Any:
    from lm_resiliency.faults import (FailureType, FaultCampaign, FaultIncident, FaultSpec, FaultSurface,
                                      FaultTarget, IncidentTrigger)

    return FaultCampaign(name="binding", incidents=(FaultIncident(
        incident_id="slow", trigger=IncidentTrigger(at=ticks),
        faults=(FaultSpec(fault_id="slow", type=FailureType.DELAY,
                          target=FaultTarget(rank=0, module_path=module_path, surface=FaultSurface.OUTPUT),
                          parameters={"seconds": 0.0}),)),))


def _recorder(framework_step: Any) -> Tuple[Any, List[Tuple[int, Any]]]:
    from lm_resiliency.faults import CallbackFaultExecutor

    calls: List[Tuple[int, Any]] = []
    return CallbackFaultExecutor(lambda request: calls.append((request.iteration, framework_step()))), calls


def megatron_clock(rank: int, world: int) -> Dict[str, Any]:
    """Megatron Core chunks and its distributed optimizer with a constant grad scaler; the update of
    loop iteration 2 is poisoned (non-finite gradients), so Megatron skips it."""
    from lm_resiliency.faults import enable_fault_injection
    from tests.frameworks.megatron_workloads import setup, train_step

    chunks, optimizer, _ = setup(1, True, scheduler=False, loss_scale=1.0)
    loop = {"index": 0}
    executor, calls = _recorder(lambda: loop["index"])
    faults = enable_fault_injection(chunks, optimizer, campaign=_campaign("decoder.layers.0", ticks=(3, 4)),
                                    executor=executor)
    applied, iterations = [], []
    for index in range(5):
        loop["index"] = index
        applied.append(train_step(chunks, optimizer, None, index, poison=index == 2))
        iterations.append(faults.iteration)
    faults.close()
    return {"applied": applied, "iterations": iterations, "calls": calls, "framework": faults.binding.framework}


def deepspeed_clock(rank: int, world: int, stage: int) -> Dict[str, Any]:
    """A DeepSpeed engine alone, gradient accumulation 2: engine.step() runs after every micro-batch
    and global_steps moves every second one."""
    from lm_resiliency.faults import enable_fault_injection
    from tests.frameworks.deepspeed_workloads import build_engine, init_ranks, train_step

    init_ranks(rank)
    engine = build_engine(stage, rank)
    executor, calls = _recorder(lambda: engine.global_steps)
    faults = enable_fault_injection(engine, campaign=_campaign("layers.0"), executor=executor)
    trace = []
    for step in range(4):
        train_step(engine, step, rank)
        trace.append((faults.iteration, engine.global_steps))
    wrapped = "step" in vars(engine)
    faults.close()
    return {"trace": trace, "calls": calls if rank == 0 else [], "wrapped": wrapped,
            "unwrapped": "step" not in vars(engine), "framework": faults.binding.framework}


def torchtitan_clock(rank: int, world: int, folder: str, phase: str) -> Dict[str, Any]:
    """TorchTitan's real Trainer. Phase "save": 10 steps, a DCP checkpoint of step 10. Phase
    "resume": the same command to step 13 with the kit bound to the trainer alone; train() loads
    step 10 (trainer.step moves to 10), and the kit's clock follows it."""
    from lm_resiliency.faults import enable_fault_injection
    from tests.frameworks import torchtitan_cpu

    torchtitan_cpu.apply()
    config = torchtitan_cpu.debug_config(os.path.join(folder, "assets"), os.path.join(folder, "dump"),
                                         steps=10 if phase == "save" else 13)
    config.checkpoint.enable, config.checkpoint.interval = True, 10
    trainer = config.build()
    if phase == "save":
        trainer.train()
        trainer.close()
        return {"steps": 10}
    executor, calls = _recorder(lambda: trainer.step)
    faults = enable_fault_injection(trainer, campaign=_campaign("layers.0", ticks=(3, 12)), executor=executor)
    seen: List[Tuple[int, int]] = []
    trainer.model_parts[0].register_forward_pre_hook(lambda m, a: seen.append((trainer.step, faults.iteration)))
    trainer.train()
    out = {"calls": calls if rank == 0 else [], "seen": seen, "steps": trainer.step,
           "framework": faults.binding.framework, "final_iteration": faults.iteration,
           "records": [(r.occurrence_id, r.iteration, r.status.value) for r in faults.records]}
    faults.close()
    trainer.close()
    return out
