"""lm-resiliency: keep distributed PyTorch training alive and correct when hardware fails.

Stable package-root API. Only names whose features exist are exported (see docs/api.md).
"""

from lm_resiliency.api import FrameworkName, enable_resiliency
from lm_resiliency.codec import StateEncodingError
from lm_resiliency.config import ConfigError, InMemoryCkptConfig
from lm_resiliency.errors import ResiliencyError
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
from lm_resiliency.gemini.identity import IdentityMismatch
from lm_resiliency.gemini.integrity import IntegrityError, NonFiniteState
from lm_resiliency.gemini.manager import RecoveryUnavailable
from lm_resiliency.gemini.workers import BackgroundError
from lm_resiliency.log_level import apply_environment_log_level
from lm_resiliency.manager_api.hooks import OrchestrationHooks
from lm_resiliency.recovered_state import RecoveredStateOverwrite
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
from lm_resiliency.trust.errors import CertificationError

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
    # Errors users catch (what each one means: docs/api.md, "Errors")
    "ResiliencyError", "ConfigError", "RecoveryUnavailable", "RecoveredStateOverwrite", "IdentityMismatch",
    "BackgroundError", "NonFiniteState", "IntegrityError", "CertificationError", "StateEncodingError",
    # Fault injection evaluation
    "enable_fault_injection", "SCHEMA_VERSION", "FaultCampaign", "FaultIncident", "IncidentTrigger",
    "IncidentLifetime", "IterationRange", "ClockSpec", "ClockType", "ClockOrigin", "FaultSpec", "FaultTarget",
    "FailureType", "FaultSurface", "FaultScope", "FaultMagnitude", "CorruptionOperation", "SafetyClass",
    "RetriggerPolicy", "FaultExecutor", "CallbackFaultExecutor", "FaultExecutionRequest", "FaultExecutionResult",
    "UnsupportedFaultError", "FaultInjectionSession", "InjectionStatus", "FaultInjectionRecord",
    "LocalizationResult", "FaultEvaluation", "CampaignReport", "CampaignJournal", "CampaignStateStore",
    "MemoryCampaignStateStore", "JsonCampaignStateStore",
]

apply_environment_log_level()  # LM_RESILIENCY_LOG_LEVEL (docs/api.md, "Logging")
