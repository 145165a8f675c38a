"""Rank functions for tests/frameworks/test_torchtitan.py: TorchTitan's real Trainer on CPU/gloo.

The resiliency runs are switched on from TorchTitan's command line only (`--module
lm_resiliency.integrations.torchtitan`); nothing in them calls lm-resiliency.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Dict

from tests.frameworks import torchtitan_cpu

STEPS = 6
KILL_AT = 6      # SIGKILL in the forward of step 6: step 5 done, GEMINI's step-4 capture complete
INTERVAL = 2


def _resilient_trainer(folder: str, dump: str, *, steps: int = STEPS, durable: bool = False,
                       detection: bool = False, tp: int = 1) -> Any:
    """The trainer TorchTitan's train.py would build from this command line."""
    torchtitan_cpu.apply()
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args([
        "--module", "lm_resiliency.integrations.torchtitan", "--config", "llama3_debugmodel",
        "--checkpoint.resiliency-interval", str(INTERVAL),
        "--checkpoint.resiliency-detection" if detection else "--checkpoint.no-resiliency-detection",
        "--checkpoint.resiliency-folder", os.path.join(folder, "gemini"),
        "--checkpoint.resiliency-run-id", "titan", "--checkpoint.resiliency-shm-dir", os.path.join(folder, "shm")])
    config = torchtitan_cpu.debug_config(os.path.join(folder, "assets"), dump, steps=steps, config=config)
    config.checkpoint.enable = durable  # TorchTitan's own (DCP) checkpoints
    config.parallelism.tensor_parallel_degree = tp
    return config.build()


def final_state(trainer: Any) -> Dict[str, Any]:
    """This rank's model shards, optimizer state, LR and counters after training."""
    import torch

    optimizer = trainer.optimizers.optimizers[0]
    model, moments = {}, {}
    for name, p in trainer.model_parts[0].named_parameters():
        model[name] = p.to_local().detach().clone()
        moments[name] = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                         for k, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)}
    return {"model": model, "optimizer": moments, "step": trainer.step, "ntokens_seen": trainer.ntokens_seen,
            "lr": [group["lr"] for group in optimizer.param_groups]}


def kill_then_resume(rank: int, world: int, folder: str, phase: str, tp: int = 1,
                     detection: bool = False) -> Any:
    """phase 'kill': train and SIGKILL this rank at step KILL_AT; 'resume': the same command again
    (GEMINI step 4, then on to STEPS); 'baseline': uninterrupted, without lm-resiliency, saving a
    TorchTitan (DCP) checkpoint at the last step. `tp`: the tensor-parallel degree (dp_shard takes
    the rest); `detection`: SCOUT on in the resilient runs (the resume then reports its last check)."""
    if phase == "baseline":
        torchtitan_cpu.apply()
        config = torchtitan_cpu.debug_config(os.path.join(folder, "assets"), os.path.join(folder, "dump"),
                                             steps=STEPS)
        config.checkpoint.enable, config.checkpoint.interval = True, STEPS
        config.parallelism.tensor_parallel_degree = tp
        trainer = config.build()
        trainer.train()
        state = final_state(trainer)
        trainer.close()
        return {"first_step": 1, "state": state}
    trainer = _resilient_trainer(folder, os.path.join(folder, "dump"), detection=detection, tp=tp)
    seen = []

    def watch(module: Any, args: Any) -> None:
        seen.append(trainer.step)
        if phase == "kill" and trainer.step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.model_parts[0].register_forward_pre_hook(watch)
    trainer.train()
    session = trainer.checkpointer.resiliency
    out = {"first_step": seen[0], "recovered_from": session.recovered_from, "state": final_state(trainer)}
    if detection:
        result = session.last_replay_result
        out.update(peers=list(session.scout.detector.group_ranks), check_step=result.step,
                   verdicts={c.check: (c.module_path, c.verdict) for c in result.checks})
    trainer.close()  # closes the session first
    return out


def durable_conflict(rank: int, world: int, folder: str, durable_dump: str) -> str:
    """GEMINI holds step 4 (the killed run); TorchTitan's checkpoint folder `durable_dump` holds a newer
    step 6. train() must refuse the durable load before training."""
    trainer = _resilient_trainer(folder, durable_dump, durable=True)
    try:
        trainer.train()
    except RuntimeError as exc:
        return str(exc)
    finally:
        trainer.close()
    raise AssertionError("train() loaded the durable checkpoint over GEMINI's state")


def one_rank_checks(rank: int, world: int, folder: str) -> Dict[str, Any]:
    """One rank, three steps, switched on from the command line: what attaching refuses, the step count
    and capture it keeps, and a durable load after training started."""
    from lm_resiliency import enable_resiliency

    trainer = _resilient_trainer(folder, os.path.join(folder, "dump"), steps=INTERVAL + 1)
    out: Dict[str, Any] = {}
    try:
        enable_resiliency(trainer, trainer.optimizers)
    except TypeError as exc:
        out["optimizer_refused"] = str(exc)
    trainer.train()
    session = trainer.checkpointer.resiliency
    out["step_count"], out["trainer_step"] = session.step_count, trainer.step
    out["latest"] = session.manager.find_latest()
    try:
        trainer.checkpointer.load()
    except RuntimeError as exc:
        out["late_load_refused"] = str(exc)
    trainer.close()
    out["hooks_removed"] = "load" not in vars(trainer.checkpointer)
    return out


def mesh_peers(rank: int, world: int, layouts: list) -> list:
    """For each `ParallelDims` degrees dict in `layouts` (dp_shard takes the rest): SCOUT's peer
    groups for a real `ParallelDims` whose meshes are built over gloo, next to the ranks TorchTitan's
    own meshes put in this rank's data-parallel ("batch") and TP groups; or the UnknownLayoutError
    message where SCOUT refuses the layout."""
    torchtitan_cpu.apply()
    from torchtitan.distributed.parallel_dims import ParallelDims

    from lm_resiliency.adapters.torchtitan import peer_layout
    from lm_resiliency.scout.peers import UnknownLayoutError, group_of, peer_groups_from_topology

    out = []
    for degrees in layouts:
        given = {"dp_replicate": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
        dims = ParallelDims(dp_shard=-1, world_size=world, spmd_backend="partial_dtensor", **given)
        dims.build_mesh()
        try:
            groups = peer_groups_from_topology({"peer_layout": peer_layout(dims)}, world)
        except UnknownLayoutError as exc:
            out.append(str(exc))
            continue

        def ranks(name: str) -> list:
            mesh = dims.get_optional_mesh(name)
            return sorted(mesh.mesh.flatten().tolist()) if mesh is not None else [rank]

        out.append({"groups": groups, "mine": group_of(rank, groups), "batch": ranks("batch"), "tp": ranks("tp")})
    return out


def scout_finds_corruption(rank: int, world: int, folder: str, faulty_rank: int) -> Dict[str, Any]:
    """SCOUT on (command line), INTERVAL steps; the fault kit sign-flips `faulty_rank`'s token
    embedding output from the first iteration on (every forward, the replay's included). Returns
    this rank's replay peers and the reports of the check at step INTERVAL."""
    from lm_resiliency.faults import (CorruptionOperation, FailureType, FaultCampaign, FaultIncident, FaultScope,
                                      FaultSpec, FaultSurface, FaultTarget, IncidentLifetime, IncidentTrigger,
                                      enable_fault_injection)
    from lm_resiliency.scout.reports import replay_fault_reports

    trainer = _resilient_trainer(folder, os.path.join(folder, "dump"), steps=INTERVAL, detection=True)
    spec = FaultSpec(fault_id="embedding-sign-flip", type=FailureType.TENSOR_CORRUPTION,
                     target=FaultTarget(rank=faulty_rank, module_path="tok_embeddings", surface=FaultSurface.OUTPUT),
                     parameters={"operation": CorruptionOperation.SIGN_FLIP.value, "scope": FaultScope.FULL.value})
    campaign = FaultCampaign(name="titan-sdc", incidents=(FaultIncident(
        incident_id="sdc", trigger=IncidentTrigger(at=(1,)), faults=(spec,),
        lifetime=IncidentLifetime(permanent=True)),))
    faults = enable_fault_injection(trainer.model_parts[0], trainer.optimizers.optimizers[0], campaign=campaign)
    trainer.train()
    session = trainer.checkpointer.resiliency
    result = session.last_replay_result
    out = {"peers": list(session.scout.detector.group_ranks), "step": result.step,
           "reports": [(r.kind, r.resource, list(r.ranks)) for r in replay_fault_reports(result)],
           "verdicts": {c.check: c.verdict for c in result.checks}}
    faults.close()
    trainer.close()
    return out



def captured_data_positions(rank: int, world: int, folder: str, steps: int, interval: int) -> Dict[str, Any]:
    """`enable_resiliency(trainer, interval=interval)` on one rank, `steps` steps: the data position
    GEMINI was handed at each capture, next to the one TorchTitan's own checkpoint would save at that
    step boundary (its `dataloader.state_dict()`, pickled at once as DCP does)."""
    import copy
    import pickle

    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    torchtitan_cpu.apply()
    config = torchtitan_cpu.debug_config(os.path.join(folder, "assets"), os.path.join(folder, "dump"), steps=steps)
    trainer = config.build()
    titan: Dict[int, Any] = {}
    # lr_schedulers.step() follows optimizers.step() and fetches nothing: the post-hook sees the boundary.
    trainer.optimizers.optimizers[0].register_step_post_hook(
        lambda *unused: titan.__setitem__(trainer.step, trainer.dataloader.state_dict()))
    session = enable_resiliency(trainer, interval=interval, enable_detection=False, checkpoint=InMemoryCkptConfig(
        run_id="titan-data", disk_folder=os.path.join(folder, "gemini"), shared_memory_dir=os.path.join(folder, "shm")))
    gemini: Dict[int, Any] = {}
    framework_state = session.adapter.framework_state

    def recorded() -> Dict[str, Any]:
        state = framework_state()
        gemini[state["trainer"]["step"]] = copy.deepcopy(state["dataloader"])
        return state

    session.adapter.framework_state = recorded
    trainer.train()
    trainer.close()
    own = {step: pickle.loads(state[next(key for key in state if key != "world_size")])
           for step, state in titan.items()}
    return {"gemini": gemini, "titan": {step: own[step] for step in gemini}}
