"""Campaign model: construction checks, JSON round trips, and manifest errors with JSON paths."""

import copy
import json

import pytest

from lm_resiliency.faults import (SCHEMA_VERSION, CampaignReport, CampaignSchemaError, ClockOrigin,
                                  ClockSpec, ClockType, CorruptionOperation, FailureType, FaultCampaign,
                                  FaultIncident, FaultInjectionRecord, FaultMagnitude, FaultScope,
                                  FaultSpec, FaultSurface, FaultTarget, IncidentLifetime, IncidentTrigger,
                                  InjectionStatus, IterationRange, LocalizationResult, RetriggerPolicy,
                                  SafetyClass, evaluate)

# One valid spec per failure type (surface, parameters).
VALID = {
    FailureType.TENSOR_CORRUPTION: (FaultSurface.OUTPUT, {"operation": "bit_flip", "scope": "element",
                                                          "index": 3, "bit": 30}),
    FailureType.STALE_STATE: (FaultSurface.PARAMETER, {"parameter": "weight"}),
    FailureType.DROP: (FaultSurface.DATALOADER, {}),
    FailureType.DUPLICATE: (FaultSurface.DATALOADER, {}),
    FailureType.REORDER: (FaultSurface.DATALOADER, {}),
    FailureType.DELAY: (FaultSurface.OUTPUT, {"seconds": 0.25}),
    FailureType.HANG: (FaultSurface.PROCESS, {"seconds": 5}),
    FailureType.TIMEOUT: (FaultSurface.PROCESS, {"seconds": 0.0, "message": "late"}),
    FailureType.EXCEPTION: (FaultSurface.PROCESS, {"message": "boom"}),
    FailureType.RESOURCE_EXHAUSTION: (FaultSurface.STORAGE, {"resource": "disk", "bytes": 1024}),
    FailureType.PROCESS_TERMINATION: (FaultSurface.PROCESS, {"signal": "SIGKILL"}),
    FailureType.RESOURCE_UNAVAILABLE: (FaultSurface.DEVICE, {"resource": "gpu0"}),
    FailureType.CHECKPOINT_CORRUPTION: (FaultSurface.CHECKPOINT, {"disk_folder": "/tmp/x", "offset": 7}),
    FailureType.CHECKPOINT_TRUNCATION: (FaultSurface.CHECKPOINT, {"disk_folder": "/tmp/x", "keep_fraction": 0.25}),
    FailureType.CHECKPOINT_MISSING: (FaultSurface.CHECKPOINT, {"disk_folder": "/tmp/x", "step": 10}),
    FailureType.IO_ERROR: (FaultSurface.STORAGE, {"errno": 28}),
    FailureType.PAYLOAD_CORRUPTION: (FaultSurface.COLLECTIVE, {"operation": "scale", "factor": 3.0}),
    FailureType.COLLECTIVE_DESYNC: (FaultSurface.COLLECTIVE, {}),
    FailureType.MESSAGE_DROP: (FaultSurface.NETWORK, {"peer": 2}),
    FailureType.NETWORK_PARTITION: (FaultSurface.NETWORK, {"peers": [0, 1]}),
    FailureType.CONFIG_DRIFT: (FaultSurface.CONFIG, {"key": "lr", "value": 0.5, "param_group": 0}),
}


def spec_for(failure_type, fault_id="f"):
    surface, params = VALID[failure_type]
    module_path = "layers.1" if surface in (FaultSurface.OUTPUT, FaultSurface.INPUT) else None
    return FaultSpec(fault_id=fault_id, type=failure_type,
                     target=FaultTarget(rank=1, module_path=module_path, surface=surface), parameters=params)


def guide_campaign():
    # Verbatim from the API guide ("Evaluate Fault Localization").
    return FaultCampaign(
        name="output-sdc",
        incidents=(
            FaultIncident(
                incident_id="hidden-sdc",
                trigger=IncidentTrigger(at=(20,)),
                lifetime=IncidentLifetime(matching_calls=1),
                faults=(
                    FaultSpec(
                        fault_id="hidden-sign-flip",
                        type=FailureType.TENSOR_CORRUPTION,
                        target=FaultTarget(
                            rank=0,
                            module_path="layers.2",
                            surface=FaultSurface.OUTPUT,
                        ),
                        parameters={
                            "operation": CorruptionOperation.SIGN_FLIP.value,
                            "scope": FaultScope.FULL.value,
                        },
                    ),
                ),
            ),
        ),
    )


def full_campaign():
    incidents = tuple(
        FaultIncident(incident_id=f"i-{t.value}", trigger=IncidentTrigger(at=(i + 1,)),
                      faults=(spec_for(t, f"f-{i}"),))
        for i, t in enumerate(FailureType))
    incidents += (
        FaultIncident(incident_id="ranged", trigger=IncidentTrigger(range=IterationRange(10, 50, every=5),
                                                                      probability=0.5),
                      lifetime=IncidentLifetime(iterations=3), retrigger=RetriggerPolicy.EVERY_GENERATION,
                      expected_kinds=("compute_straggler",), description="intermittent",
                      faults=(FaultSpec(fault_id="slow", type="delay",
                                        target=FaultTarget(rank=2, module_path="", surface="output", node="n1",
                                                           resource="gpu2", component="mlp"),
                                        parameters={"seconds": 0.1, "x_custom": {"a": [1, 2]}}),)),
        FaultIncident(incident_id="perm", trigger=IncidentTrigger(probability=0.01),
                      lifetime=IncidentLifetime(permanent=True), faults=(spec_for(FailureType.HANG, "h2"),)),
    )
    return FaultCampaign(name="everything", incidents=incidents, seed=1234,
                         clock=ClockSpec(ClockType.WALL_CLOCK, ClockOrigin.GENERATION_START), description="all")


# ------------------------------------------------------------------ guide example and taxonomy

def test_guide_example_constructs_and_round_trips():
    campaign = guide_campaign()
    doc = campaign.to_json()
    assert doc["schema_version"] == SCHEMA_VERSION
    assert FaultCampaign.from_json(doc) == campaign
    assert FaultCampaign.from_json(json.dumps(doc)) == campaign
    spec = campaign.incidents[0].faults[0]
    assert spec.type is FailureType.TENSOR_CORRUPTION and spec.safety_class is SafetyClass.IN_PROCESS_SAFE
    assert spec.parameters["operation"] == "sign_flip"
    with pytest.raises(TypeError):
        spec.parameters["operation"] = "zero"  # read-only


def test_twenty_one_failure_types_each_with_a_safety_class():
    names = {t.value for t in FailureType}
    assert names == {
        "tensor_corruption", "stale_state", "drop", "duplicate", "reorder", "delay", "hang", "timeout",
        "exception", "resource_exhaustion", "process_termination", "resource_unavailable",
        "checkpoint_corruption", "checkpoint_truncation", "checkpoint_missing", "io_error",
        "payload_corruption", "collective_desync", "message_drop", "network_partition", "config_drift"}
    for t in FailureType:
        assert isinstance(t.safety_class, SafetyClass)
        assert t.surfaces
    assert FailureType.NETWORK_PARTITION.safety_class is SafetyClass.UNSUPPORTED_HERE
    assert FailureType.PROCESS_TERMINATION.safety_class is SafetyClass.SANDBOXED_DESTRUCTIVE


@pytest.mark.parametrize("failure_type", list(FailureType), ids=lambda t: t.value)
def test_every_failure_type_round_trips(failure_type):
    spec = spec_for(failure_type)
    assert FaultSpec.from_json(spec.to_json()) == spec
    assert FaultSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


@pytest.mark.parametrize("enum_cls", [FailureType, FaultSurface, FaultScope, FaultMagnitude, CorruptionOperation,
                                      SafetyClass, RetriggerPolicy, ClockType, ClockOrigin, InjectionStatus])
def test_enums_are_json_strings(enum_cls):
    for member in enum_cls:
        assert enum_cls(json.loads(json.dumps(member.value))) is member


def test_full_campaign_round_trips_through_text_and_file(tmp_path):
    campaign = full_campaign()
    text = json.dumps(campaign.to_json())
    assert FaultCampaign.from_json(text) == campaign
    path = tmp_path / "campaign.json"
    campaign.to_file(str(path))
    assert FaultCampaign.from_file(str(path)) == campaign


# ------------------------------------------------------------------ each object type

OBJECTS = [
    ClockSpec(),
    ClockSpec(ClockType.WALL_CLOCK, ClockOrigin.RUN_START),
    IterationRange(3),
    IterationRange(3, 9, every=2),
    IncidentTrigger(at=(5, 1)),
    IncidentTrigger(range=IterationRange(0, 4)),
    IncidentTrigger(probability=0.25),
    IncidentLifetime(),
    IncidentLifetime(iterations=4),
    IncidentLifetime(permanent=True),
    FaultTarget(rank=3),
    FaultTarget(rank=0, module_path="a.b", surface=FaultSurface.INPUT, node="h", resource="r", component="c"),
]


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: f"{type(o).__name__}")
def test_object_round_trip(obj):
    assert type(obj).from_json(obj.to_json()) == obj
    assert type(obj).from_json(json.loads(json.dumps(obj.to_json()))) == obj


def test_record_localization_and_report_round_trip():
    record = FaultInjectionRecord(occurrence_id="a@3", incident_id="a", fault_id="f", failure_type="delay",
                                  rank=1, status="injected", tick=3, iteration=3, wall_time=10.0,
                                  surface="process", evidence={"seconds": 0.5, "list": [1, 2]})
    assert FaultInjectionRecord.from_json(json.dumps(record.to_json())) == record
    loc = LocalizationResult(ranks=(1,), kind="compute_straggler", iteration=4, detected_at=12.0,
                             evidence={"slowdown": 3.0})
    assert LocalizationResult.from_json(json.dumps(loc.to_json())) == loc
    report = evaluate([record], [loc], world_size=4)
    again = CampaignReport.from_json(json.dumps(report.to_json()))
    assert again == report


def test_trigger_and_lifetime_normalization():
    assert IncidentTrigger(at=[7, 2]).at == (2, 7)
    assert IncidentLifetime().matching_calls == 1
    assert IncidentLifetime().to_json() == {"matching_calls": 1}


# ------------------------------------------------------------------ construction rejections

@pytest.mark.parametrize("make, path", [
    (lambda: ClockSpec(type="sundial"), "ClockSpec.type"),
    (lambda: ClockSpec(origin="birth"), "ClockSpec.origin"),
    (lambda: IterationRange(-1), "IterationRange.start"),
    (lambda: IterationRange(5, 5), "IterationRange.stop"),
    (lambda: IterationRange(0, 5, every=0), "IterationRange.every"),
    (lambda: IncidentTrigger(), "IncidentTrigger"),
    (lambda: IncidentTrigger(at=(1, 1)), "IncidentTrigger.at"),
    (lambda: IncidentTrigger(at=(1, -2)), "IncidentTrigger.at[1]"),
    (lambda: IncidentTrigger(at=(1,), range=IterationRange(0)), "IncidentTrigger"),
    (lambda: IncidentTrigger(probability=1.5), "IncidentTrigger.probability"),
    (lambda: IncidentTrigger(probability=0.0), "IncidentTrigger.probability"),
    (lambda: IncidentLifetime(matching_calls=0), "IncidentLifetime.matching_calls"),
    (lambda: IncidentLifetime(matching_calls=2, permanent=True), "IncidentLifetime"),
    (lambda: IncidentLifetime(iterations=True), "IncidentLifetime.iterations"),
    (lambda: FaultTarget(rank=-1), "FaultTarget.rank"),
    (lambda: FaultTarget(rank=True), "FaultTarget.rank"),
    (lambda: FaultTarget(rank=0, surface="gpu"), "FaultTarget.surface"),
    (lambda: FaultTarget(rank=0, node=""), "FaultTarget.node"),
    (lambda: FaultSpec("bad id!", FailureType.DROP, FaultTarget(0, surface="dataloader")), "FaultSpec.fault_id"),
    (lambda: FaultSpec("f", "meltdown", FaultTarget(0)), "FaultSpec.type"),
    (lambda: FaultSpec("f", FailureType.DROP, FaultTarget(0, surface="output", module_path="")),
     "FaultSpec.target.surface"),
    (lambda: FaultSpec("f", FailureType.DELAY, FaultTarget(0, surface="output"), {"seconds": 1}),
     "FaultSpec.target.module_path"),
    (lambda: FaultSpec("f", FailureType.DELAY, FaultTarget(0), {}), "FaultSpec.parameters.seconds"),
    (lambda: FaultSpec("f", FailureType.HANG, FaultTarget(0), {"seconds": 0}), "FaultSpec.parameters.seconds"),
    (lambda: FaultSpec("f", FailureType.DELAY, FaultTarget(0), {"seconds": float("inf")}),
     "FaultSpec.parameters.seconds"),
    (lambda: FaultSpec("f", FailureType.DELAY, FaultTarget(0), {"seconds": 1, "secs": 2}),
     "FaultSpec.parameters.secs"),
    (lambda: FaultSpec("f", FailureType.TENSOR_CORRUPTION, FaultTarget(0, "", "output"), {"operation": "melt"}),
     "FaultSpec.parameters.operation"),
    (lambda: FaultSpec("f", FailureType.TENSOR_CORRUPTION, FaultTarget(0, "", "output"),
                       {"operation": "zero", "scope": "fraction"}), "FaultSpec.parameters.fraction"),
    (lambda: FaultSpec("f", FailureType.TENSOR_CORRUPTION, FaultTarget(0, "", "output"),
                       {"operation": "zero", "bit": 3}), "FaultSpec.parameters.bit"),
    (lambda: FaultSpec("f", FailureType.TENSOR_CORRUPTION, FaultTarget(0, "", "output"),
                       {"operation": "zero", "scope": "fraction", "fraction": 1.5}), "FaultSpec.parameters.fraction"),
    (lambda: FaultSpec("f", FailureType.PROCESS_TERMINATION, FaultTarget(0), {"signal": "KILL"}),
     "FaultSpec.parameters.signal"),
    (lambda: FaultSpec("f", FailureType.CONFIG_DRIFT, FaultTarget(0, surface="config"), {"value": 1}),
     "FaultSpec.parameters"),
    (lambda: FaultSpec("f", FailureType.RESOURCE_EXHAUSTION, FaultTarget(0, surface="storage"),
                       {"resource": "sun"}), "FaultSpec.parameters.resource"),
    (lambda: FaultSpec("f", FailureType.DROP, FaultTarget(0, surface="dataloader"), {"x": object()}),
     "FaultSpec.parameters.x"),
    (lambda: FaultIncident("i@1", IncidentTrigger(at=(1,)), (spec_for(FailureType.DROP),)),
     "FaultIncident.incident_id"),
    (lambda: FaultIncident("i", IncidentTrigger(at=(1,)), ()), "FaultIncident.faults"),
    (lambda: FaultIncident("i", IncidentTrigger(at=(1,)), (spec_for(FailureType.DROP), spec_for(FailureType.DROP))),
     "FaultIncident.faults[1].fault_id"),
    (lambda: FaultIncident("i", IncidentTrigger(at=(1,)), (spec_for(FailureType.DROP),), retrigger="twice"),
     "FaultIncident.retrigger"),
    (lambda: FaultCampaign("", (guide_campaign().incidents[0],)), "FaultCampaign.name"),
    (lambda: FaultCampaign("c", ()), "FaultCampaign.incidents"),
    (lambda: FaultCampaign("c", guide_campaign().incidents * 2), "FaultCampaign.incidents[1].incident_id"),
    (lambda: FaultCampaign("c", guide_campaign().incidents, seed=-1), "FaultCampaign.seed"),
    (lambda: LocalizationResult(ranks=(-1,), kind="sdc"), "LocalizationResult.ranks[0]"),
    (lambda: LocalizationResult(ranks=(0,), kind=""), "LocalizationResult.kind"),
    (lambda: FaultInjectionRecord("o", "i", "f", "drop", 0, "maybe", 1, 1, 0.0, "dataloader"),
     "FaultInjectionRecord.status"),
])
def test_construction_rejects_with_field_path(make, path):
    with pytest.raises(CampaignSchemaError) as info:
        make()
    assert info.value.path == path, str(info.value)
    assert str(info.value).startswith(path + ": ")


def test_duplicate_fault_ids_across_incidents_rejected():
    a = FaultIncident("a", IncidentTrigger(at=(1,)), (spec_for(FailureType.DROP, "same"),))
    b = FaultIncident("b", IncidentTrigger(at=(2,)), (spec_for(FailureType.DUPLICATE, "same"),))
    with pytest.raises(CampaignSchemaError, match=r"FaultCampaign.incidents\[1\].faults\[0\].fault_id"):
        FaultCampaign("c", (a, b))


# ------------------------------------------------------------------ manifest rejections (JSON paths)

def _mutate(fn):
    doc = copy.deepcopy(full_campaign().to_json())
    fn(doc)
    return doc


@pytest.mark.parametrize("mutate, path, reason", [
    (lambda d: d["incidents"][0]["faults"][0]["target"].__setitem__("rank", -1),
     "$.incidents[0].faults[0].target.rank", "must be a non-negative int"),
    (lambda d: d.__setitem__("schema_version", 99), "$.schema_version", "unsupported campaign schema version"),
    (lambda d: d.pop("schema_version"), "$.schema_version", "required field is missing"),
    (lambda d: d.__setitem__("surprise", 1), "$.surprise", "unknown field"),
    (lambda d: d.__setitem__("incidents", {}), "$.incidents", "must be a JSON array"),
    (lambda d: d["clock"].__setitem__("type", "sundial"), "$.clock.type", "must be one of"),
    (lambda d: d["incidents"][2]["trigger"].__setitem__("at", [1, "x"]), "$.incidents[2].trigger.at[1]",
     "non-negative int"),
    (lambda d: d["incidents"][21]["trigger"]["range"].__setitem__("every", 0),
     "$.incidents[21].trigger.range.every", "positive int"),
    (lambda d: d["incidents"][3]["lifetime"].__setitem__("matching_calls", 0),
     "$.incidents[3].lifetime.matching_calls", "positive int"),
    (lambda d: d["incidents"][4].pop("trigger"), "$.incidents[4].trigger", "required field is missing"),
    (lambda d: d["incidents"][5]["faults"][0].__setitem__("type", "meltdown"), "$.incidents[5].faults[0].type",
     "must be one of"),
    (lambda d: d["incidents"][0]["faults"][0]["parameters"].__setitem__("operation", "melt"),
     "$.incidents[0].faults[0].parameters.operation", "must be one of"),
    (lambda d: d["incidents"][5]["faults"][0]["parameters"].__setitem__("seconds", -1),
     "$.incidents[5].faults[0].parameters.seconds", "finite number"),
    (lambda d: d["incidents"][0]["faults"][0]["target"].__setitem__("surface", "checkpoint"),
     "$.incidents[0].faults[0].target.surface", "tensor_corruption can target"),
    (lambda d: d["incidents"][0]["faults"][0]["target"].pop("module_path"),
     "$.incidents[0].faults[0].target.module_path", "required for the output surface"),
    (lambda d: d["incidents"][1]["faults"].append(d["incidents"][1]["faults"][0]),
     "$.incidents[1].faults[1].fault_id", "duplicate fault_id"),
    (lambda d: d["incidents"][1].__setitem__("incident_id", d["incidents"][0]["incident_id"]),
     "$.incidents[1].incident_id", "duplicate incident_id"),
    (lambda d: d["incidents"][0].__setitem__("faults", []), "$.incidents[0].faults", "non-empty"),
    (lambda d: d["incidents"][0]["faults"][0].__setitem__("target", 3), "$.incidents[0].faults[0].target",
     "must be a JSON object"),
])
def test_manifest_errors_name_the_json_path(mutate, path, reason):
    with pytest.raises(CampaignSchemaError) as info:
        FaultCampaign.from_json(json.dumps(_mutate(mutate)))
    assert info.value.path == path, str(info.value)
    assert reason in info.value.reason


def test_manifest_text_errors():
    with pytest.raises(CampaignSchemaError, match=r"^\$: campaign manifest is not valid JSON"):
        FaultCampaign.from_json("{nope")
    with pytest.raises(CampaignSchemaError, match="duplicate JSON key"):
        FaultCampaign.from_json('{"name": "a", "name": "b"}')
    with pytest.raises(CampaignSchemaError, match=r"^\$: must be a JSON object"):
        FaultCampaign.from_json("[]")


def test_manifest_file_error_names_file(tmp_path):
    path = tmp_path / "bad.json"
    doc = guide_campaign().to_json()
    doc["incidents"][0]["faults"][0]["target"]["rank"] = "zero"
    path.write_text(json.dumps(doc))
    with pytest.raises(CampaignSchemaError) as info:
        FaultCampaign.from_file(str(path))
    assert info.value.path == f"{path}: $.incidents[0].faults[0].target.rank"
