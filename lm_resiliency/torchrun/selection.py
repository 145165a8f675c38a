"""The checkpoint step a worker generation loads, chosen identically by every agent of a round
from what each node published (`NodeReport`): the newest step every node's workers captured, or,
after a fault SCOUT localized, the newest RECOVERY_VERIFIED step every node holds (GEMINI guide:
detected SDC selects the persisted RECOVERY_VERIFIED step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from lm_resiliency.torchrun.context import TRUST_LATEST, TRUST_VERIFIED
from lm_resiliency.torchrun.retirement import NodeFault


class SelectionRefused(RuntimeError):
    """No step satisfies the round's trust requirement: the generation must not start."""


@dataclass(frozen=True)
class NodeReport:
    """One node's input to a round: its workers' newest captured and verified steps (-1: none
    recorded; a fresh standby has neither) and the fault its workers recorded, if any."""

    latest: int
    verified: int
    fault: Optional[NodeFault]


@dataclass(frozen=True)
class Selection:
    step: int
    source: str  # "none" (fresh) or "gemini"
    trust: str
    reason: str
    retired_slots: tuple


def select_step(reports: Sequence[NodeReport]) -> Selection:
    """Deterministic on every agent given the same reports (in slot order)."""
    recorded = [r for r in reports if r.latest >= 0]
    faults = [r.fault for r in reports if r.fault is not None]
    if not faults:
        if not recorded:
            return Selection(0, "none", TRUST_LATEST, "no node recorded a capture: fresh start", ())
        step = min(r.latest for r in recorded)
        return Selection(step, "gemini", TRUST_LATEST, f"step {step}: the newest capture every node holds", ())
    fault = faults[0]
    slots = tuple(sorted({slot for f in faults for slot in f.slots}))
    candidates: List[int] = [r.verified for r in recorded] + [f.verified_step for f in faults]
    found = (f"SCOUT found {fault.kind} at step {fault.step} on global ranks {list(fault.ranks) or '(none named)'} "
             f"in generation {fault.generation}, node slots {list(slots)} retired")
    if min(candidates) < 0:
        raise SelectionRefused(f"{found}; recovery must load a RECOVERY_VERIFIED step and a node holds none "
                               f"(verified steps by node: {[r.verified for r in recorded]}). Not starting a "
                               "generation from unverified state: restart the run from a trusted checkpoint")
    step = min(candidates)
    return Selection(step, "gemini", TRUST_VERIFIED,
                     f"{found}: step {step}, the newest RECOVERY_VERIFIED step every node holds", slots)
