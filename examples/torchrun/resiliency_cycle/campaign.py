"""The cycle campaign file (`campaign.json` in the campaign directory) and its translation into
the fault kit's manifest, which the training workers load.

    {"schema": "lm-resiliency-cycle/1", "name": "...", "steps": 96, "description": "...",
     "incidents": [{"id": "...", "type": "<FailureType>", "surface": "<FaultSurface>",
                    "slot": 1, "step": 8, "expected": "same-node" | "replacement",
                    "parameters": {...}, "module_path": "0", "iterations": 2,
                    "description": "..."}]}

`slot` is the node slot of the target (one worker per node, so also its global rank); `step` is
the training iteration the fault strikes in (iteration k ends with the k-th optimizer step). A
"replacement" incident consumes one parked standby.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lm_resiliency.faults import (FailureType, FaultCampaign, FaultIncident, FaultSpec, FaultSurface, FaultTarget,
                                  IncidentLifetime, IncidentTrigger)

SCHEMA = "lm-resiliency-cycle/1"
OUTCOMES = ("same-node", "replacement")
INTERVAL = 2  # the worker policy's capture cadence: incidents strike at even iterations (see `check`)
_FIELDS = {"id", "type", "surface", "slot", "step", "expected", "parameters", "module_path", "iterations",
           "description"}


class CycleCampaignError(ValueError):
    """campaign.json is not a valid cycle campaign (the message names the field)."""


@dataclass(frozen=True)
class CycleIncident:
    id: str
    type: FailureType
    surface: FaultSurface
    slot: int
    step: int
    expected: str
    parameters: Dict[str, Any] = field(default_factory=dict)
    module_path: Optional[str] = None
    iterations: Optional[int] = None
    description: str = ""

    @property
    def node_loss(self) -> bool:
        """Performed as a whole-node loss: the orchestrator kills the target's agent. A tensor
        corruption SCOUT localizes is left to the rendezvous (which may retire the named node)."""
        return self.expected == "replacement" and self.type is not FailureType.TENSOR_CORRUPTION


@dataclass(frozen=True)
class CycleCampaign:
    name: str
    steps: int
    incidents: Tuple[CycleIncident, ...]
    description: str = ""

    def replacements(self) -> int:
        return sum(1 for i in self.incidents if i.expected == "replacement")

    def fault_campaign(self) -> FaultCampaign:
        """The fault kit's campaign: one incident, one fault, triggered at `step` on rank `slot`."""
        incidents = []
        for i in self.incidents:
            lifetime = IncidentLifetime(iterations=i.iterations) if i.iterations else IncidentLifetime()
            spec = FaultSpec(fault_id=f"{i.id}-fault", type=i.type,
                             target=FaultTarget(rank=i.slot, surface=i.surface, module_path=i.module_path),
                             parameters=dict(i.parameters, x_node_loss=i.node_loss))
            incidents.append(FaultIncident(incident_id=i.id, trigger=IncidentTrigger(at=(i.step,)), faults=(spec,),
                                           lifetime=lifetime, description=i.description))
        return FaultCampaign(name=self.name, incidents=tuple(incidents), seed=2026, description=self.description)


def _need(doc: Dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in doc or not isinstance(doc[key], kind) or isinstance(doc[key], bool):
        raise CycleCampaignError(f"{where}.{key}: required, a {kind.__name__}")
    return doc[key]


def parse(doc: Any, active: int, standbys: int) -> CycleCampaign:
    """Validate a campaign for `active` training nodes and `standbys` parked ones."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CycleCampaignError(f"$.schema: expected {SCHEMA!r}")
    unknown = set(doc) - {"schema", "name", "steps", "description", "incidents"}
    if unknown:
        raise CycleCampaignError(f"$: unknown fields {sorted(unknown)}")
    steps = _need(doc, "steps", int, "$")
    incidents: List[CycleIncident] = []
    for n, item in enumerate(_need(doc, "incidents", list, "$")):
        where = f"$.incidents[{n}]"
        if not isinstance(item, dict) or set(item) - _FIELDS:
            raise CycleCampaignError(f"{where}: an object with fields {sorted(_FIELDS)}")
        try:
            incident = CycleIncident(
                id=_need(item, "id", str, where), type=FailureType(_need(item, "type", str, where)),
                surface=FaultSurface(_need(item, "surface", str, where)), slot=_need(item, "slot", int, where),
                step=_need(item, "step", int, where), expected=_need(item, "expected", str, where),
                parameters=dict(item.get("parameters", {})), module_path=item.get("module_path"),
                iterations=item.get("iterations"), description=str(item.get("description", "")))
        except ValueError as exc:
            raise CycleCampaignError(f"{where}: {exc}") from None
        check(incident, where, active, steps, incidents[-1] if incidents else None)
        incidents.append(incident)
    campaign = CycleCampaign(_need(doc, "name", str, "$"), steps, tuple(incidents), str(doc.get("description", "")))
    if not incidents:
        raise CycleCampaignError("$.incidents: at least one incident")
    if campaign.replacements() > standbys:
        raise CycleCampaignError(f"$.incidents: {campaign.replacements()} replacement incidents but only {standbys} "
                                 "standby nodes (--nodes minus --active)")
    try:
        campaign.fault_campaign()
    except ValueError as exc:
        raise CycleCampaignError(f"$.incidents: {exc}") from None
    return campaign


def check(incident: CycleIncident, where: str, active: int, steps: int, previous: Optional[CycleIncident]) -> None:
    """An incident strikes an even iteration >= 4 (a capture exists; the iteration before it
    captured nothing, so no capture can hold the fault's effect), after the previous incident."""
    if incident.surface not in incident.type.surfaces:
        raise CycleCampaignError(f"{where}.surface: {incident.type.value} strikes "
                                 f"{[s.value for s in incident.type.surfaces]}, not {incident.surface.value}")
    if not 0 <= incident.slot < active:
        raise CycleCampaignError(f"{where}.slot: must be a training slot 0..{active - 1}, got {incident.slot}")
    if incident.step < 2 * INTERVAL or incident.step % INTERVAL or incident.step >= steps:
        raise CycleCampaignError(f"{where}.step: must be a multiple of {INTERVAL}, >= {2 * INTERVAL} and < steps "
                                 f"({steps}), got {incident.step}")
    if previous is not None and incident.step <= previous.step:
        raise CycleCampaignError(f"{where}.step: incidents must be in increasing step order")
    if incident.expected not in OUTCOMES:
        raise CycleCampaignError(f"{where}.expected: one of {OUTCOMES}, got {incident.expected!r}")


def load(path: str, active: int, standbys: int) -> CycleCampaign:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise CycleCampaignError(f"{path}: cannot be read ({exc.strerror}); copy a campaign from "
                                 "examples/torchrun/resiliency_cycle/campaigns/ there") from None
    except ValueError as exc:
        raise CycleCampaignError(f"{path}: not JSON: {exc}") from None
    return parse(doc, active, standbys)
