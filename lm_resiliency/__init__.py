"""lm-resiliency: keep distributed PyTorch training alive and correct when hardware fails.

Stable package-root API. Only names whose features exist are exported (see docs/api.md).
"""

from lm_resiliency.api import FrameworkName, enable_resiliency
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.faults import (
    SCHEMA_VERSION,
    CallbackFaultExecutor,
    CampaignJournal,
    CampaignReport,
    CampaignStateStore,
    ClockOrigin,
    ClockSpec,
    ClockType,
    CorruptionOperation,
    FailureType,
    FaultCampaign,
    FaultEvaluation,
    FaultExecutionRequest,
    FaultExecutionResult,
    FaultExecutor,
    FaultIncident,
    FaultInjectionRecord,
    FaultInjectionSession,
    FaultMagnitude,
    FaultScope,
    FaultSpec,
    FaultSurface,
    FaultTarget,
    IncidentLifetime,
    IncidentTrigger,
    InjectionStatus,
    IterationRange,
    JsonCampaignStateStore,
    LocalizationResult,
    MemoryCampaignStateStore,
    RetriggerPolicy,
    SafetyClass,
    UnsupportedFaultError,
    enable_fault_injection,
)
from lm_resiliency.gemini.chunking import estimate_chunk_size
from lm_resiliency.manager_api.hooks import OrchestrationHooks
from lm_resiliency.recovery import RecoveryDecision, RecoveryDecisionCallback, RecoveryMode
from lm_resiliency.scout.alltoall_policy import (
    AllToAllCapture,
    AllToAllReplayPolicy,
    AllToAllTrafficMatrix,
    BalancedAndPermutationPolicy,
)
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.moe_workload import GroupedExpertMaterializer, LeadingDimensionMaterializer, ReplayWorkload
from lm_resiliency.scout.reports import SCOUTFaultCallback, SCOUTFaultReport, replay_fault_reports
from lm_resiliency.session import ResiliencyHandle, ResiliencySession
from lm_resiliency.trust import CallbackDurableCheckpointAdapter, DurableCheckpointConfig

__all__ = [
    # Activation and lifecycle
    "enable_resiliency", "FrameworkName", "ResiliencySession", "ResiliencyHandle",
    # Configuration
    "InMemoryCkptConfig", "ReplayHarnessConfig",
    # Dynamic and MoE replay
    "ReplayWorkload", "GroupedExpertMaterializer", "LeadingDimensionMaterializer",
    # AllToAll replay
    "AllToAllReplayPolicy", "AllToAllCapture", "AllToAllTrafficMatrix", "BalancedAndPermutationPolicy",
    # Durable certification
    "DurableCheckpointConfig", "CallbackDurableCheckpointAdapter",
    # Fault reporting
    "SCOUTFaultReport", "SCOUTFaultCallback", "OrchestrationHooks", "replay_fault_reports",
    # Recovery handoff
    "RecoveryDecision", "RecoveryDecisionCallback", "RecoveryMode",
    # Checkpoint tuning
    "estimate_chunk_size",
    # Fault injection evaluation
    "enable_fault_injection", "SCHEMA_VERSION", "FaultCampaign", "FaultIncident", "IncidentTrigger",
    "IncidentLifetime", "IterationRange", "ClockSpec", "ClockType", "ClockOrigin", "FaultSpec", "FaultTarget",
    "FailureType", "FaultSurface", "FaultScope", "FaultMagnitude", "CorruptionOperation", "SafetyClass",
    "RetriggerPolicy", "FaultExecutor", "CallbackFaultExecutor", "FaultExecutionRequest", "FaultExecutionResult",
    "UnsupportedFaultError", "FaultInjectionSession", "InjectionStatus", "FaultInjectionRecord",
    "LocalizationResult", "FaultEvaluation", "CampaignReport", "CampaignJournal", "CampaignStateStore",
    "MemoryCampaignStateStore", "JsonCampaignStateStore",
]
