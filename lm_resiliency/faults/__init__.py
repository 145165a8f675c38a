"""Fault injection evaluation kit: declarative campaigns, real injection, verified ground truth,
and localization scoring. See docs/fault_injection.md.

    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    ...train unchanged...
    report = faults.evaluate([LocalizationResult.from_fault_report(r) for r in scout_reports])
"""

from .campaign import SCHEMA_VERSION, FaultCampaign, FaultIncident, FaultSpec, FaultTarget
from .corruption import CorruptionOperation, FaultMagnitude, FaultScope
from .errors import (CampaignIdentityError, CampaignSchemaError, InjectedFault, InjectedIOError,
                     InjectedTimeout, UnsupportedFaultError)
from .executor import CallbackFaultExecutor, FaultExecutionRequest, FaultExecutionResult, FaultExecutor
from .journal import CampaignJournal
from .local_executor import LocalFaultExecutor
from .records import FaultInjectionRecord, InjectionStatus
from .schedule import (ClockOrigin, ClockSpec, ClockType, IncidentLifetime, IncidentTrigger,
                       IterationRange, RetriggerPolicy)
from .scoring import CampaignReport, FaultEvaluation, LocalizationResult, evaluate
from .session import FaultInjectionSession, enable_fault_injection
from .state import CampaignStateStore, JsonCampaignStateStore, MemoryCampaignStateStore
from .taxonomy import FailureType, FaultSurface, SafetyClass

# The API guide's "Fault injection evaluation" row, in its order (re-exported at the package root).
STABLE_EXPORTS = (
    "enable_fault_injection", "SCHEMA_VERSION", "FaultCampaign", "FaultIncident", "IncidentTrigger",
    "IncidentLifetime", "IterationRange", "ClockSpec", "ClockType", "ClockOrigin", "FaultSpec",
    "FaultTarget", "FailureType", "FaultSurface", "FaultScope", "FaultMagnitude", "CorruptionOperation",
    "SafetyClass", "RetriggerPolicy", "FaultExecutor", "CallbackFaultExecutor", "FaultExecutionRequest",
    "FaultExecutionResult", "UnsupportedFaultError", "FaultInjectionSession", "InjectionStatus",
    "FaultInjectionRecord", "LocalizationResult", "FaultEvaluation", "CampaignReport", "CampaignJournal",
    "CampaignStateStore", "MemoryCampaignStateStore", "JsonCampaignStateStore",
)

__all__ = sorted(STABLE_EXPORTS + (
    "CampaignIdentityError", "CampaignSchemaError", "InjectedFault", "InjectedIOError", "InjectedTimeout",
    "LocalFaultExecutor", "evaluate",
))
