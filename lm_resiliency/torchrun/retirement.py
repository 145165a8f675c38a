"""SCOUT-named node retirement under the built-in torchrun policy.

Workers: when SCOUT localizes SDC (or a hang) and the trust ledger requires RECOVERY_VERIFIED
recovery, every worker writes `fault-<local rank>.json` into its node's restart-context
directory (the faulty global ranks, their node slots, the newest RECOVERY_VERIFIED step) and
ends its generation with `TorchrunFaultDetected`. Agents: at the next rendezvous round the agent
whose slot was named retires (`NodeRetired`); the others publish the fault with their steps, so
every agent, the admitted standby included, selects the verified step."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from lm_resiliency._values import is_int
from lm_resiliency.files import atomic_write
from lm_resiliency.torchrun.context import TRUST_VERIFIED, ContextError, RestartContext, encode_json, read_json

FAULT_SCHEMA = "lm-resiliency-torchrun-fault/1"
FAULT_KINDS = ("sdc", "hang")


class TorchrunFaultDetected(RuntimeError):
    """Raised in every worker when SCOUT's verdict ends the generation: the agents retire the named
    node slot(s) and restart from the newest RECOVERY_VERIFIED step."""


class NodeRetired(SystemExit):
    """The agent's own node was named faulty: it left the rendezvous and exits (status 0: the
    retirement is the recovery working, and a supervisor must not restart it into the run)."""

    def __init__(self) -> None:
        super().__init__(0)


@dataclass(frozen=True)
class NodeFault:
    """A fault SCOUT localized in `generation`: global `ranks`, their node `slots` (rank //
    LOCAL_WORLD_SIZE), the step it was found at, and the newest RECOVERY_VERIFIED step (-1: none)."""

    run_id: str
    generation: int
    kind: str
    ranks: Tuple[int, ...]
    slots: Tuple[int, ...]
    step: int
    verified_step: int

    def to_json(self) -> dict:
        return {"schema": FAULT_SCHEMA, "run_id": self.run_id, "generation": self.generation, "kind": self.kind,
                "ranks": list(self.ranks), "slots": list(self.slots), "step": self.step,
                "verified_step": self.verified_step}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "NodeFault":
        names = ("run_id", "generation", "kind", "ranks", "slots", "step", "verified_step")
        if not isinstance(data, dict) or data.get("schema") != FAULT_SCHEMA or set(data) != {"schema", *names}:
            raise ContextError(f"{where}: not a fault record ({FAULT_SCHEMA})")
        if not isinstance(data["run_id"], str) or data["kind"] not in FAULT_KINDS:
            raise ContextError(f"{where}: run_id must be a string and kind one of {FAULT_KINDS}")
        for name in ("generation", "step"):
            if not is_int(data[name]) or data[name] < 0:
                raise ContextError(f"{where}: {name} must be a non-negative integer")
        if not is_int(data["verified_step"]) or data["verified_step"] < -1:
            raise ContextError(f"{where}: verified_step must be -1 (none) or a non-negative step")
        for name in ("ranks", "slots"):
            values = data[name]
            if not isinstance(values, list) or not all(is_int(v) and v >= 0 for v in values) \
                    or values != sorted(set(values)):
                raise ContextError(f"{where}: {name} must be a sorted list of distinct non-negative integers")
        return cls(data["run_id"], data["generation"], data["kind"], tuple(data["ranks"]), tuple(data["slots"]),
                   data["step"], data["verified_step"])


def fault_for(run_id: str, generation: int, kind: str, ranks: List[int], local_world_size: int, step: int,
              verified_step: Optional[int]) -> NodeFault:
    """The record for faulty global `ranks`: a rank's node slot is rank // LOCAL_WORLD_SIZE."""
    ranks = sorted(set(ranks))
    return NodeFault(run_id, generation, kind, tuple(ranks), tuple(sorted({r // local_world_size for r in ranks})),
                     step, -1 if verified_step is None else verified_step)


def fault_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"fault-{local_rank}.json")


def write_fault(directory: str, local_rank: int, fault: NodeFault) -> None:
    atomic_write(fault_path(directory, local_rank), encode_json(fault.to_json()))


def read_fault(directory: str, run_id: str, generation: int) -> Optional[NodeFault]:
    """The fault this node's workers recorded in `generation` of `run_id` (None: none). Records
    of other runs or generations are ignored; corrupt or disagreeing ones fail closed."""
    found: List[NodeFault] = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("fault-") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        fault = NodeFault.from_json(read_json(path), path)
        if fault.run_id == run_id and fault.generation == generation:
            found.append(fault)
    if not found:
        return None
    if any((f.kind, f.slots, f.verified_step) != (found[0].kind, found[0].slots, found[0].verified_step)
           for f in found):
        raise ContextError(f"{directory}: this node's workers recorded different faults for generation "
                           f"{generation}: {[f.to_json() for f in found]}; the verdict should be collective")
    return found[0]


class FaultWatch:
    """A worker's side: collects the ranks SCOUT's replay votes blame, and once the trust ledger
    latches RECOVERY_VERIFIED-only recovery (the capture boundary after the verdict, agreed on
    every rank), records the fault for the agent and ends the generation on every rank alike."""

    def __init__(self, run_id: str, generation: int, directory: str, local_rank: int, local_world_size: int) -> None:
        self.run_id = run_id
        self.generation = generation
        self.directory = directory
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.ranks: List[int] = []
        self.step: Optional[int] = None

    def on_replay_result(self, result: Any) -> None:
        """The session's `fault_callback`: a replay result that is not healthy (same on every rank)."""
        if not result.sdc:
            return  # stragglers and inconclusive votes alone do not latch verified-only recovery
        self.ranks.extend(rank for check in result.checks if check.verdict == "sdc" for rank in check.faulty)
        self.step = result.step if self.step is None else self.step

    def after_step(self, session: Any) -> None:
        """After each optimizer step: end the generation once recovery must be RECOVERY_VERIFIED."""
        ledger = session.ledger
        if self.step is None or (ledger is not None and not ledger.requires_verified_recovery):
            return
        verified = ledger.recovery_verified_step if ledger is not None else None
        fault = fault_for(self.run_id, self.generation, "sdc", self.ranks, self.local_world_size, self.step,
                          verified)
        write_fault(self.directory, self.local_rank, fault)
        session.keep_state_for_relaunch()  # the verified capture may live only in this node's memory
        raise TorchrunFaultDetected(
            f"lm-resiliency torchrun worker: SCOUT detected SDC at step {fault.step} on global ranks "
            f"{list(fault.ranks) or 'not localized to a rank'} (node slots {list(fault.slots)}); ending generation "
            f"{self.generation} so the agents retire the named node(s) and restart from the newest "
            f"RECOVERY_VERIFIED step ({'none' if verified is None else verified})")


def require_verified_step(session: Any, context: RestartContext) -> None:
    """Before a generation that must resume from RECOVERY_VERIFIED state loads anything: its step
    must be one the trust ledger certified (the ledger agrees job-wide, so every rank decides alike)."""
    if context.trust != TRUST_VERIFIED:
        return
    from lm_resiliency.gemini.manager import RecoveryUnavailable

    verified = session.ledger.verified_steps() if session.ledger is not None else []
    if context.checkpoint_step not in verified:
        raise RecoveryUnavailable(
            f"lm-resiliency torchrun worker: generation {context.generation} must resume from RECOVERY_VERIFIED "
            f"step {context.checkpoint_step} ({context.reason}), but this run's trust ledger certifies "
            f"{verified or 'no step'}{'' if session.ledger is not None else ' (SCOUT is off)'}; loading nothing")
