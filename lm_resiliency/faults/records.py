"""Ground truth: one `FaultInjectionRecord` per executed (or refused) matching call, and one
for each armed occurrence released unexecuted."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Mapping, Optional

from ._fields import (ObjectReader, build, check_id, check_non_negative_int, check_str, coerce_enum,
                      fail, freeze_json, is_int, is_number, load_document, thaw_json)
from .taxonomy import FailureType, FaultSurface


class InjectionStatus(str, Enum):
    """What happened when an armed fault met a matching call.

    INJECTED: the effect was applied and verified (e.g. the number of changed elements > 0, the
    shard bytes differ, the sleep lasted). NO_EFFECT: it ran but changed nothing (a sign flip of
    zeros). ALREADY_CLAIMED: the occurrence was claimed earlier (by this rank's predecessor or
    a concurrent replacement) and was not injected again. EXPIRED: its lifetime ended before any
    matching call. UNSUPPORTED: the executor cannot do it here (`detail` says why). FAILED: the
    executor raised unexpectedly (`detail` has the error). ARMED: it was armed but the session
    closed (or the clock was reset) before any matching call; it was never claimed, so the worker
    that next reaches its tick arms it again. DEACTIVATED: the occurrence ended and the executor
    undid its effect (a held or bounded state fault restored, held memory released); `evidence`
    says what was undone."""

    INJECTED = "injected"
    NO_EFFECT = "no_effect"
    ALREADY_CLAIMED = "already_claimed"
    EXPIRED = "expired"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"
    ARMED = "armed"
    DEACTIVATED = "deactivated"


@dataclass(frozen=True)
class FaultInjectionRecord:
    """One line of the campaign journal: what was injected where and when, independently of
    what SCOUT or GEMINI later observed.

    `tick` is the clock tick of the occurrence (its id is ``f"{incident_id}@{tick}"``);
    `iteration` is the training iteration that was running when the fault met its matching
    call (equal to `tick` on the default clock); `call_index` counts matching calls (1-based).
    `resource` and `component` are the fault target's labels (the truth `evaluate` compares
    localized resources and components with); `campaign_digest` is the identity of the
    manifest that produced the record (`FaultCampaign.digest`)."""

    occurrence_id: str
    incident_id: str
    fault_id: str
    failure_type: FailureType
    rank: int
    status: InjectionStatus
    tick: int
    iteration: int
    wall_time: float
    surface: FaultSurface
    module_path: Optional[str] = None
    call_index: int = 0
    world_size: int = 1
    generation: str = "0"
    host: str = ""
    pid: int = 0
    evidence: Mapping[str, Any] = field(default_factory=dict)
    detail: str = ""
    resource: Optional[str] = None
    component: Optional[str] = None
    campaign_digest: str = ""

    def __post_init__(self) -> None:
        check_str(self.occurrence_id, "FaultInjectionRecord.occurrence_id", empty=False)
        check_id(self.incident_id, "FaultInjectionRecord.incident_id")
        check_id(self.fault_id, "FaultInjectionRecord.fault_id")
        object.__setattr__(self, "failure_type", coerce_enum(FailureType, self.failure_type,
                                                             "FaultInjectionRecord.failure_type"))
        object.__setattr__(self, "status", coerce_enum(InjectionStatus, self.status,
                                                       "FaultInjectionRecord.status"))
        object.__setattr__(self, "surface", coerce_enum(FaultSurface, self.surface,
                                                        "FaultInjectionRecord.surface"))
        for name in ("rank", "tick", "iteration", "call_index", "pid"):
            check_non_negative_int(getattr(self, name), f"FaultInjectionRecord.{name}")
        if not is_int(self.world_size) or self.world_size < 1:
            fail("FaultInjectionRecord.world_size", f"must be a positive int, got {self.world_size!r}")
        if not is_number(self.wall_time):
            fail("FaultInjectionRecord.wall_time", f"must be a finite number, got {self.wall_time!r}")
        object.__setattr__(self, "wall_time", float(self.wall_time))
        for name in ("module_path", "resource", "component"):
            if getattr(self, name) is not None:
                check_str(getattr(self, name), f"FaultInjectionRecord.{name}")
        for name in ("generation", "host", "detail", "campaign_digest"):
            check_str(getattr(self, name), f"FaultInjectionRecord.{name}")
        object.__setattr__(self, "evidence", freeze_json(self.evidence, "FaultInjectionRecord.evidence"))

    @property
    def injected(self) -> bool:
        return self.status is InjectionStatus.INJECTED

    def to_json(self) -> Dict[str, Any]:
        return {
            "occurrence_id": self.occurrence_id, "incident_id": self.incident_id,
            "fault_id": self.fault_id, "failure_type": self.failure_type.value, "rank": self.rank,
            "status": self.status.value, "tick": self.tick, "iteration": self.iteration,
            "wall_time": self.wall_time, "surface": self.surface.value,
            "module_path": self.module_path, "call_index": self.call_index,
            "world_size": self.world_size, "generation": self.generation, "host": self.host,
            "pid": self.pid, "evidence": thaw_json(self.evidence), "detail": self.detail,
            "resource": self.resource, "component": self.component, "campaign_digest": self.campaign_digest,
        }

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "FaultInjectionRecord":
        doc = load_document(doc, "injection record")
        required = ("occurrence_id", "incident_id", "fault_id", "failure_type", "rank", "status",
                    "tick", "iteration", "wall_time", "surface")
        optional = ("module_path", "call_index", "world_size", "generation", "host", "pid",
                    "evidence", "detail", "resource", "component", "campaign_digest")
        r = ObjectReader(doc, path, required, optional)
        kwargs = {k: r.get(k) for k in required + optional if k in r}
        return build(cls, path, **kwargs)


__all__ = ["FaultInjectionRecord", "InjectionStatus"]
