"""A downstream training script's view of the package root, checked by mypy (`make test`), never run.

Every name in `lm_resiliency.__all__` is used here with the type a user would write; `assert_type`
fails the check if an export degrades to `Any` or changes type.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from typing_extensions import assert_type

from lm_resiliency import (SCHEMA_VERSION, CallbackDurableCheckpointAdapter, CallbackFaultExecutor, CampaignJournal,
                           CampaignReport, CampaignStateStore, ClockOrigin, ClockSpec, ClockType, CorruptionOperation,
                           DurableCheckpointConfig, FailureType, FaultCampaign, FaultEvaluation,
                           FaultExecutionRequest, FaultExecutionResult, FaultExecutor, FaultIncident,
                           FaultInjectionRecord, FaultInjectionSession, FaultMagnitude, FaultScope, FaultSpec,
                           FaultSurface, FaultTarget, FrameworkName, IncidentLifetime, IncidentTrigger,
                           InjectionStatus, InMemoryCkptConfig, IterationRange, JsonCampaignStateStore,
                           LocalizationResult, MemoryCampaignStateStore, OrchestrationHooks, RecoveryDecision,
                           RecoveryDecisionCallback, RecoveryMode, ReplayHarnessConfig, ResiliencyHandle,
                           ResiliencySession, RetriggerPolicy, SafetyClass, SCOUTFaultCallback, SCOUTFaultReport,
                           UnsupportedFaultError, enable_fault_injection, enable_resiliency, estimate_chunk_size,
                           replay_fault_reports)
from lm_resiliency import (BackgroundError, CertificationError, ConfigError, IdentityMismatch, IntegrityError,
                           NonFiniteState, RecoveredStateOverwrite, RecoveryUnavailable, ResiliencyError,
                           StateEncodingError)
from lm_resiliency import (AllToAllCapture, AllToAllReplayPolicy, AllToAllTrafficMatrix, BalancedAndPermutationPolicy,
                           GroupedExpertMaterializer, LeadingDimensionMaterializer, ReplayWorkload)
from lm_resiliency.scout.reports import ReplayResult


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    session = enable_resiliency(model, optimizer, interval=10, checkpoint=InMemoryCkptConfig(interval=10),
                                replay=ReplayHarnessConfig(), recovery_mode=RecoveryMode.LATEST,
                                framework=FrameworkName.PYTORCH)
    assert_type(session, ResiliencySession)
    handle: ResiliencyHandle = session
    mode = handle.prepare_recovery("node_lost")
    assert_type(mode, RecoveryMode)
    decision = handle.last_recovery_decision
    assert_type(decision, Optional[RecoveryDecision])
    step = session.recover()
    assert_type(step, Optional[int])
    session.close()
    return session.step_count


def on_decision(callback: RecoveryDecisionCallback, hooks: OrchestrationHooks,
                on_fault: SCOUTFaultCallback, report: SCOUTFaultReport) -> None:
    on_fault(report)


def durable(config: DurableCheckpointConfig, adapter: CallbackDurableCheckpointAdapter) -> None:
    pass


def tune() -> int:
    size = estimate_chunk_size(nic_bandwidth_gbps=100.0, layer_compute_ms=5.0, ag_time_ms=1.0,
                               max_ag_delay_fraction=0.1)
    assert_type(size, int)
    return size


def reports(result: ReplayResult) -> List[SCOUTFaultReport]:
    found = replay_fault_reports(result)
    assert_type(found, List[SCOUTFaultReport])
    return found


def inject(model: torch.nn.Module, optimizer: torch.optim.Optimizer, campaign: FaultCampaign,
           executor: FaultExecutor, store: CampaignStateStore, journal: CampaignJournal) -> int:
    session = enable_fault_injection(model, optimizer, campaign=campaign, executor=executor, state_store=store,
                                     journal=journal)
    assert_type(session, FaultInjectionSession)
    version: int = SCHEMA_VERSION
    return version


def campaign_types(incident: FaultIncident, trigger: IncidentTrigger, lifetime: IncidentLifetime,
                   iterations: IterationRange, clock: ClockSpec, clock_type: ClockType, origin: ClockOrigin,
                   spec: FaultSpec, target: FaultTarget, failure: FailureType, surface: FaultSurface,
                   scope: FaultScope, magnitude: FaultMagnitude, operation: CorruptionOperation,
                   safety: SafetyClass, retrigger: RetriggerPolicy, callback_executor: CallbackFaultExecutor,
                   request: FaultExecutionRequest, result: FaultExecutionResult, status: InjectionStatus,
                   record: FaultInjectionRecord, localization: LocalizationResult, evaluation: FaultEvaluation,
                   report: CampaignReport, memory: MemoryCampaignStateStore, json_store: JsonCampaignStateStore,
                   unsupported: UnsupportedFaultError) -> Tuple[FaultExecutor, List[CampaignStateStore], Exception]:
    executor: FaultExecutor = callback_executor
    stores: List[CampaignStateStore] = [memory, json_store]
    error: Exception = unsupported
    return executor, stores, error


def recover_or_explain(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    try:
        enable_resiliency(model, optimizer, interval=10)
    except (ConfigError, RecoveryUnavailable, IdentityMismatch, CertificationError) as exc:
        return str(exc)
    try:
        model.load_state_dict({})
    except RecoveredStateOverwrite as exc:
        return str(exc)
    except ResiliencyError as exc:   # any other lm-resiliency failure
        return str(exc)
    failures: Tuple[type, ...] = (BackgroundError, NonFiniteState, IntegrityError, StateEncodingError)
    assert issubclass(NonFiniteState, BackgroundError) and issubclass(IntegrityError, BackgroundError)
    assert issubclass(ConfigError, ValueError) and issubclass(RecoveryUnavailable, RuntimeError)
    return ", ".join(cls.__name__ for cls in failures)


def moe_replay(experts: Tuple[torch.nn.Module, ...]) -> ReplayWorkload:
    grouped = ReplayWorkload(recipes=(4, 4), replay_modules=experts, materializer=GroupedExpertMaterializer())
    assert_type(grouped, ReplayWorkload)
    return ReplayWorkload(recipes=((2, 2),), replay_modules=experts, materializer=LeadingDimensionMaterializer())


def alltoall_matrices(capture: AllToAllCapture) -> List[AllToAllTrafficMatrix]:
    policy: AllToAllReplayPolicy = BalancedAndPermutationPolicy(max_payload_bytes_per_rank=1 << 20)
    matrices = list(policy.generate(capture))
    assert_type(matrices, List[AllToAllTrafficMatrix])
    return matrices
