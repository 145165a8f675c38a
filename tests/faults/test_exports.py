"""The API guide's names and its example, exactly as written there."""


import lm_resiliency
import lm_resiliency.faults as faults_pkg
from lm_resiliency.faults import FaultInjectionSession, InjectionStatus

from .workloads import batches, make_model, train

GUIDE_TABLE_ROW = (
    "enable_fault_injection, SCHEMA_VERSION, FaultCampaign, FaultIncident, IncidentTrigger, IncidentLifetime, "
    "IterationRange, ClockSpec, ClockType, ClockOrigin, FaultSpec, FaultTarget, FailureType, FaultSurface, "
    "FaultScope, FaultMagnitude, CorruptionOperation, SafetyClass, RetriggerPolicy, FaultExecutor, "
    "CallbackFaultExecutor, FaultExecutionRequest, FaultExecutionResult, UnsupportedFaultError, "
    "FaultInjectionSession, InjectionStatus, FaultInjectionRecord, LocalizationResult, FaultEvaluation, "
    "CampaignReport, CampaignJournal, CampaignStateStore, MemoryCampaignStateStore, JsonCampaignStateStore")

# Verbatim from the API guide, section "Evaluate Fault Localization".
GUIDE_EXAMPLE = '''
from lm_resiliency import (
    CorruptionOperation,
    FailureType,
    FaultCampaign,
    FaultIncident,
    FaultScope,
    FaultSpec,
    FaultSurface,
    FaultTarget,
    IncidentLifetime,
    IncidentTrigger,
    enable_fault_injection,
)

campaign = FaultCampaign(
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
faults = enable_fault_injection(model, optimizer, campaign=campaign)
'''


def test_kit_exports_every_name_of_the_guide_table():
    names = tuple(n.strip() for n in GUIDE_TABLE_ROW.split(","))
    assert len(names) == 34 and names == faults_pkg.STABLE_EXPORTS
    for name in names:
        assert hasattr(faults_pkg, name), name
        assert name in faults_pkg.__all__


def test_guide_example_runs_verbatim_from_the_package_root():
    for name in faults_pkg.STABLE_EXPORTS:
        assert getattr(lm_resiliency, name) is getattr(faults_pkg, name)
    model, optimizer = make_model()
    scope = {"model": model, "optimizer": optimizer}
    exec(compile(GUIDE_EXAMPLE, "<api guide>", "exec"), scope)
    faults = scope["faults"]
    assert isinstance(faults, FaultInjectionSession)
    train(model, optimizer, batches(20))
    assert [(r.occurrence_id, r.status) for r in faults.records] == [("hidden-sdc@20", InjectionStatus.INJECTED)]
    faults.close()


def test_guide_example_body_runs_from_the_kit_package():
    model, optimizer = make_model()
    scope = {"model": model, "optimizer": optimizer}
    exec(compile(GUIDE_EXAMPLE.replace("from lm_resiliency import", "from lm_resiliency.faults import"),
                 "<api guide>", "exec"), scope)
    train(model, optimizer, batches(20))
    assert [(r.occurrence_id, r.status) for r in scope["faults"].records] == [
        ("hidden-sdc@20", InjectionStatus.INJECTED)]
