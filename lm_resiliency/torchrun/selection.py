"""The checkpoint step a worker generation loads, chosen identically by every agent of a round
from what each node published (`NodeReport`): the newest step every node's workers captured, or,
after a fault SCOUT localized, the newest RECOVERY_VERIFIED step every node holds (GEMINI guide:
detected SDC selects the persisted RECOVERY_VERIFIED step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordSchema, integer, nested, nullable, parse_record
from lm_resiliency.torchrun.context import ID, STEPS, TRUST_LATEST, TRUST_VERIFIED, ContextError
from lm_resiliency.torchrun.retirement import FAULT_RECORD, NodeFault

REPORT_SCHEMA = "lm-resiliency-torchrun-node-report/1"
NODE_REPORT = RecordSchema(what="node report", identity=("schema", REPORT_SCHEMA), fields={
    "node_id": ID, "generation": integer(0), "slot": integer(0), "latest": integer(-1), "verified": integer(-1),
    "refused": STEPS, "fault": nullable(nested(FAULT_RECORD))})


class SelectionRefused(ResiliencyError, RuntimeError):
    """No step satisfies the round's trust requirement: the generation must not start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeReport:
    """One node's input to a round: its workers' newest captured and verified steps (-1: none
    recorded; a fresh standby has neither), the steps generations could not load, and the fault its
    workers recorded, if any."""

    latest: int
    verified: int
    fault: Optional[NodeFault] = None
    refused: Tuple[int, ...] = ()
    node_id: str = ""

    def to_json(self, generation: int, slot: int) -> dict:
        return {"schema": REPORT_SCHEMA, "node_id": self.node_id, "generation": generation, "slot": slot,
                "latest": self.latest, "verified": self.verified, "refused": list(self.refused),
                "fault": None if self.fault is None else self.fault.to_json()}

    @classmethod
    def parse(cls, data: bytes, where: str, generation: int, slot: int) -> "NodeReport":
        """Another agent's report for round `generation`, slot `slot` (ContextError otherwise)."""
        doc = parse_record(data, NODE_REPORT, where, error=ContextError)
        if (doc["generation"], doc["slot"]) != (generation, slot):
            raise ContextError(f"{where}: a report for generation {doc['generation']} slot {doc['slot']}, not for "
                               f"generation {generation} slot {slot}")
        fault = None if doc["fault"] is None else NodeFault.from_json(doc["fault"], f"{where}: fault")
        return cls(latest=doc["latest"], verified=doc["verified"], fault=fault, refused=tuple(doc["refused"]),
                   node_id=doc["node_id"])


@dataclass(frozen=True, kw_only=True, slots=True)
class Selection:
    step: int
    source: str  # "none" (fresh) or "gemini"
    trust: str
    reason: str
    retired_slots: tuple
    refused: Tuple[int, ...] = ()
    """Steps some generation could not load since the last capture (never selected)."""


def select_step(reports: Sequence[NodeReport]) -> Selection:
    """Deterministic on every agent given the same reports (in slot order)."""
    refused = tuple(sorted({step for r in reports for step in r.refused}))
    # A node whose record still names a step some generation could not load (its workers ended
    # before they rewrote it) offers nothing known to be loadable.
    recorded = [r for r in reports if r.latest >= 0 and r.latest not in refused]
    faults = [r.fault for r in reports if r.fault is not None]
    if not faults:
        if not recorded:
            why = "no node recorded a capture" + (f" it can load (steps {list(refused)} could not be loaded)"
                                                   if refused else "")
            return Selection(step=0, source="none", trust=TRUST_LATEST, reason=f"{why}: fresh start",
                             retired_slots=(), refused=refused)
        step = min(r.latest for r in recorded)
        return Selection(step=step, source="gemini", trust=TRUST_LATEST,
                         reason=f"step {step}: the newest capture every node holds", retired_slots=(), refused=refused)
    fault = faults[0]
    slots = tuple(sorted({slot for f in faults for slot in f.slots}))
    candidates: List[int] = [-1 if step in refused else step
                             for step in [r.verified for r in recorded] + [f.verified_step for f in faults]]
    found = (f"SCOUT found {fault.kind} at step {fault.step} on global ranks {list(fault.ranks) or '(none named)'} "
             f"in generation {fault.generation}, node slots {list(slots)} retired")
    if min(candidates) < 0:
        raise SelectionRefused(f"{found}; recovery must load a RECOVERY_VERIFIED step and a node holds none "
                               f"(verified steps by node: {[r.verified for r in recorded]}). Not starting a "
                               "generation from unverified state: restart the run from a trusted checkpoint")
    step = min(candidates)
    return Selection(step=step, source="gemini", trust=TRUST_VERIFIED,
                     reason=f"{found}: step {step}, the newest RECOVERY_VERIFIED step every node holds",
                     retired_slots=slots, refused=refused)
