"""The declarative campaign: campaign -> incidents -> faults -> targets, with JSON manifests.

Every object is a frozen dataclass validated at construction (errors name the field);
`FaultCampaign.from_json` reads a manifest and reports a bad field by its JSON path, e.g.
``$.incidents[0].faults[0].target.rank: must be a non-negative int, got -1``.
"""

from __future__ import annotations

import hashlib
import json
import math
import errno
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from lm_resiliency.files import CONFIG, atomic_write, read_file_bytes

from ._fields import (ObjectReader, build, check_id, check_non_negative_int, check_str,
                      coerce_enum, fail, freeze_json, is_int, load_document, thaw_json)
from .errors import CampaignSchemaError
from .parameters import validate_parameters
from .schedule import ClockSpec, ClockType, IncidentLifetime, IncidentTrigger, RetriggerPolicy
from .taxonomy import (DEFAULT_KINDS, MODULE_SURFACES, FailureType, FaultSurface, SafetyClass)

SCHEMA_VERSION = 1
MANIFEST_MAX_BYTES = 16 * 1024 * 1024
"""Version of the campaign manifest format written by `FaultCampaign.to_json`."""


def _optional_name(value: Any, path: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        fail(path, f"must be null or a non-empty string, got {value!r}")


@dataclass(frozen=True)
class FaultTarget:
    """Where a fault strikes: a rank (required) and, depending on the surface, a module.

    `module_path` is a dotted submodule name as in `model.get_submodule` ("" is the root
    model; a DDP/FSDP wrapper's "module." prefix is found automatically). `node`, `resource`
    and `component` are optional labels used when scoring localization and by custom executors.
    """

    rank: int
    module_path: Optional[str] = None
    surface: FaultSurface = FaultSurface.PROCESS
    node: Optional[str] = None
    resource: Optional[str] = None
    component: Optional[str] = None

    def __post_init__(self) -> None:
        check_non_negative_int(self.rank, "FaultTarget.rank")
        if self.module_path is not None:
            check_str(self.module_path, "FaultTarget.module_path")
        object.__setattr__(self, "surface", coerce_enum(FaultSurface, self.surface, "FaultTarget.surface"))
        for name in ("node", "resource", "component"):
            _optional_name(getattr(self, name), f"FaultTarget.{name}")

    def to_json(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {"rank": self.rank, "surface": self.surface.value}
        for name in ("module_path", "node", "resource", "component"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "FaultTarget":
        keys = ("rank", "module_path", "surface", "node", "resource", "component")
        r = ObjectReader(doc, path, ("rank",), keys[1:])
        return build(cls, path, **r.kwargs(*keys))


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what (`type`), where (`target`), how (`parameters`, checked per type; see
    docs/fault_injection.md). `parameters` becomes a read-only mapping."""

    fault_id: str
    type: FailureType
    target: FaultTarget
    parameters: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        check_id(self.fault_id, "FaultSpec.fault_id")
        object.__setattr__(self, "type", coerce_enum(FailureType, self.type, "FaultSpec.type"))
        if not isinstance(self.target, FaultTarget):
            fail("FaultSpec.target", f"must be a FaultTarget, got {type(self.target).__name__}")
        surface = self.target.surface
        if surface not in self.type.surfaces:
            allowed = ", ".join(repr(s.value) for s in self.type.surfaces)
            fail("FaultSpec.target.surface", f"{self.type.value} can target {allowed}, not {surface.value!r}")
        if surface in MODULE_SURFACES and self.target.module_path is None:
            fail("FaultSpec.target.module_path", f"required for the {surface.value} surface "
                                                 "(\"\" names the root model)")
        if not isinstance(self.parameters, Mapping):
            fail("FaultSpec.parameters", f"must be a mapping, got {type(self.parameters).__name__}")
        params = freeze_json(self.parameters, "FaultSpec.parameters")
        validate_parameters(self.type, surface, params, "FaultSpec.parameters")
        object.__setattr__(self, "parameters", params)
        check_str(self.description, "FaultSpec.description")

    @property
    def safety_class(self) -> SafetyClass:
        return self.type.safety_class

    def to_json(self) -> Dict[str, Any]:
        doc = {"fault_id": self.fault_id, "type": self.type.value, "target": self.target.to_json(),
               "parameters": thaw_json(self.parameters)}
        if self.description:
            doc["description"] = self.description
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "FaultSpec":
        r = ObjectReader(doc, path, ("fault_id", "type", "target"), ("parameters", "description"))
        kwargs = r.kwargs("fault_id", "type", "description")
        kwargs["target"] = FaultTarget.from_json(r.get("target"), r.at("target"))
        if "parameters" in r:
            kwargs["parameters"] = r.get("parameters")
        return build(cls, path, **kwargs)


@dataclass(frozen=True)
class FaultIncident:
    """One scheduled incident: when (`trigger`), how long (`lifetime`), what (`faults`, possibly on
    several ranks at once), and what a restarted worker does (`retrigger`).

    `expected_kinds` overrides which localization kinds count as the right kind when scoring
    (default: the kinds associated with the faults' failure types)."""

    incident_id: str
    trigger: IncidentTrigger
    faults: Tuple[FaultSpec, ...]
    lifetime: IncidentLifetime = field(default_factory=IncidentLifetime)
    retrigger: RetriggerPolicy = RetriggerPolicy.ONCE
    expected_kinds: Tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        check_id(self.incident_id, "FaultIncident.incident_id")
        if not isinstance(self.trigger, IncidentTrigger):
            fail("FaultIncident.trigger", f"must be an IncidentTrigger, got {type(self.trigger).__name__}")
        faults = tuple(self.faults) if isinstance(self.faults, list) else self.faults
        if not isinstance(faults, tuple) or not faults:
            fail("FaultIncident.faults", "must be a non-empty tuple of FaultSpec")
        seen = set()
        for i, spec in enumerate(faults):
            if not isinstance(spec, FaultSpec):
                fail(f"FaultIncident.faults[{i}]", f"must be a FaultSpec, got {type(spec).__name__}")
            if spec.fault_id in seen:
                fail(f"FaultIncident.faults[{i}].fault_id", f"duplicate fault_id {spec.fault_id!r}")
            seen.add(spec.fault_id)
        object.__setattr__(self, "faults", faults)
        if not isinstance(self.lifetime, IncidentLifetime):
            fail("FaultIncident.lifetime", f"must be an IncidentLifetime, got {type(self.lifetime).__name__}")
        object.__setattr__(self, "retrigger",
                           coerce_enum(RetriggerPolicy, self.retrigger, "FaultIncident.retrigger"))
        kinds = tuple(self.expected_kinds) if isinstance(self.expected_kinds, list) else self.expected_kinds
        if not isinstance(kinds, tuple):
            fail("FaultIncident.expected_kinds", "must be a tuple of strings")
        for i, kind in enumerate(kinds):
            check_str(kind, f"FaultIncident.expected_kinds[{i}]", empty=False)
        object.__setattr__(self, "expected_kinds", kinds)
        check_str(self.description, "FaultIncident.description")

    @property
    def target_ranks(self) -> Tuple[int, ...]:
        return tuple(sorted({f.target.rank for f in self.faults}))

    @property
    def accepted_kinds(self) -> FrozenSet[str]:
        if self.expected_kinds:
            return frozenset(self.expected_kinds)
        return frozenset().union(*(DEFAULT_KINDS[f.type] for f in self.faults))

    def to_json(self) -> Dict[str, Any]:
        doc = {"incident_id": self.incident_id, "trigger": self.trigger.to_json(),
               "lifetime": self.lifetime.to_json(), "retrigger": self.retrigger.value,
               "faults": [f.to_json() for f in self.faults]}
        if self.expected_kinds:
            doc["expected_kinds"] = list(self.expected_kinds)
        if self.description:
            doc["description"] = self.description
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "FaultIncident":
        r = ObjectReader(doc, path, ("incident_id", "trigger", "faults"),
                         ("lifetime", "retrigger", "expected_kinds", "description"))
        kwargs = r.kwargs("incident_id", "retrigger", "expected_kinds", "description")
        kwargs["trigger"] = IncidentTrigger.from_json(r.get("trigger"), r.at("trigger"))
        kwargs["faults"] = tuple(FaultSpec.from_json(item, p) for item, p in r.list("faults"))
        if "lifetime" in r:
            kwargs["lifetime"] = IncidentLifetime.from_json(r.get("lifetime"), r.at("lifetime"))
        return build(cls, path, **kwargs)


# Surfaces whose matching calls need not come once per iteration (forward calls, batches).
_PER_CALL_SURFACES = frozenset({FaultSurface.OUTPUT, FaultSurface.INPUT, FaultSurface.DATALOADER})


def _window(incident: FaultIncident) -> Optional[float]:
    """How many iterations one occurrence stays in effect, when the lifetime fixes it: None for
    `matching_calls` of forward or batch faults (a module may run several times an iteration)."""
    lifetime = incident.lifetime
    if lifetime.permanent:
        return math.inf
    if lifetime.iterations is not None:
        return lifetime.iterations
    if any(f.target.surface in _PER_CALL_SURFACES for f in incident.faults):
        return None
    return lifetime.matching_calls


def _check_no_overlap(incident: FaultIncident, path: str) -> None:
    """Refuse a trigger whose occurrences would overlap: a new occurrence replaces the previous
    one, so the first would end early, and a held or restored state would be undefined."""
    window = _window(incident)
    if window is None or window <= 1:
        return
    trigger = incident.trigger
    if trigger.at:
        ticks: Tuple[int, ...] = trigger.at
    elif trigger.range is not None:
        r = trigger.range
        ticks = (r.start,) if r.stop is not None and r.stop - r.start <= r.every else (r.start, r.start + r.every)
    else:
        ticks = (1, 2)   # a probability alone makes every tick a candidate
    close = next(((a, b) for a, b in zip(ticks, ticks[1:]) if b - a < window), None)
    if close is None:
        return
    if math.isinf(window):
        fail(path, f"a permanent incident stays in effect until the run ends, so its occurrences at ticks "
                   f"{close[0]} and {close[1]} would overlap; give it a single tick")
    fail(path, f"occurrences at ticks {close[0]} and {close[1]} would overlap: each stays in effect {window:g} "
               f"iterations (lifetime {incident.lifetime.to_json()}), and the later one would replace the earlier "
               f"while it is in effect; space the ticks at least {window:g} apart or shorten the lifetime")


@dataclass(frozen=True)
class FaultCampaign:
    """A named set of incidents, the clock their triggers read, and the seed that makes
    probability triggers and random corruption choices reproducible."""

    name: str
    incidents: Tuple[FaultIncident, ...]
    seed: int = 0
    clock: ClockSpec = field(default_factory=ClockSpec)
    description: str = ""

    def __post_init__(self) -> None:
        check_str(self.name, "FaultCampaign.name", empty=False)
        incidents = tuple(self.incidents) if isinstance(self.incidents, list) else self.incidents
        if not isinstance(incidents, tuple) or not incidents:
            fail("FaultCampaign.incidents", "must be a non-empty tuple of FaultIncident")
        incident_ids, fault_ids = set(), set()
        for i, incident in enumerate(incidents):
            if not isinstance(incident, FaultIncident):
                fail(f"FaultCampaign.incidents[{i}]",
                     f"must be a FaultIncident, got {type(incident).__name__}")
            if incident.incident_id in incident_ids:
                fail(f"FaultCampaign.incidents[{i}].incident_id",
                     f"duplicate incident_id {incident.incident_id!r}")
            incident_ids.add(incident.incident_id)
            for j, spec in enumerate(incident.faults):
                if spec.fault_id in fault_ids:
                    fail(f"FaultCampaign.incidents[{i}].faults[{j}].fault_id",
                         f"duplicate fault_id {spec.fault_id!r} (fault ids are unique in a campaign)")
                fault_ids.add(spec.fault_id)
        object.__setattr__(self, "incidents", incidents)
        if not is_int(self.seed) or self.seed < 0:
            fail("FaultCampaign.seed", f"must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.clock, ClockSpec):
            fail("FaultCampaign.clock", f"must be a ClockSpec, got {type(self.clock).__name__}")
        check_str(self.description, "FaultCampaign.description")
        if self.clock.type is ClockType.TRAINING_ITERATION:
            for i, incident in enumerate(incidents):
                _check_no_overlap(incident, f"FaultCampaign.incidents[{i}].trigger")

    @property
    def digest(self) -> str:
        """The manifest's identity: SHA-256 of its canonical JSON (sorted keys, no spaces). Two
        campaigns with the same name and different incidents, seed or clock differ here; the
        injector binds its state store and journal to it."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()

    def incident(self, incident_id: str) -> FaultIncident:
        for incident in self.incidents:
            if incident.incident_id == incident_id:
                return incident
        raise KeyError(incident_id)

    def fault(self, fault_id: str) -> FaultSpec:
        for incident in self.incidents:
            for spec in incident.faults:
                if spec.fault_id == fault_id:
                    return spec
        raise KeyError(fault_id)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> Dict[str, Any]:
        doc = {"schema_version": SCHEMA_VERSION, "name": self.name, "seed": self.seed,
               "clock": self.clock.to_json(), "incidents": [i.to_json() for i in self.incidents]}
        if self.description:
            doc["description"] = self.description
        return doc

    @classmethod
    def from_json(cls, doc: Any, path: str = "$") -> "FaultCampaign":
        """Read a manifest (JSON text or parsed object); raises CampaignSchemaError naming the
        JSON path of the first bad field."""
        doc = load_document(doc, "campaign manifest")
        r = ObjectReader(doc, path, ("schema_version", "name", "incidents"), ("seed", "clock", "description"))
        version = r.get("schema_version")
        if not is_int(version) or version != SCHEMA_VERSION:
            fail(r.at("schema_version"), f"unsupported campaign schema version {version!r} "
                                         f"(this release reads {SCHEMA_VERSION})")
        kwargs = r.kwargs("name", "seed", "description")
        kwargs["incidents"] = tuple(FaultIncident.from_json(item, p) for item, p in r.list("incidents"))
        if "clock" in r:
            kwargs["clock"] = ClockSpec.from_json(r.get("clock"), r.at("clock"))
        return build(cls, path, **kwargs)

    def to_file(self, path: str) -> None:
        """Write the manifest atomically (temp file, fsync, rename; mode 0600)."""
        atomic_write(path, (json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n").encode("utf-8"))

    @classmethod
    def from_file(cls, path: str) -> "FaultCampaign":
        """Read a manifest file: a regular file of this user or root, not writable by group or others
        (it decides what is injected), at most MANIFEST_MAX_BYTES."""
        data = read_file_bytes(path, "campaign manifest", max_bytes=MANIFEST_MAX_BYTES, trust=CONFIG)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no campaign manifest", path)
        try:
            return cls.from_json(data)
        except CampaignSchemaError as exc:
            raise CampaignSchemaError(f"{path}: {exc.path}", exc.reason) from None


__all__ = ["SCHEMA_VERSION", "FaultCampaign", "FaultIncident", "FaultSpec", "FaultTarget"]
