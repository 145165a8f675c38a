"""Stable, platform-neutral manager API.

What an external manager needs to coordinate with lm-resiliency workers: the orchestration
hooks, the JSON-ready recovery decisions and fault reports they carry and the helpers that turn a
SCOUT replay result into them, the optional hardware-health monitor, configuration-drift
fingerprints, and checkpoint transfer (`make_transfer`: move a flushed GEMINI shard to a
replacement node, keyed, checksummed per chunk and bounded by timeouts; docs/gemini.md).
"""

from lm_resiliency.manager_api.drift import find_drift, format_drift, local_fingerprint
from lm_resiliency.manager_api.health import HardwareHealthMonitor, HealthSource
from lm_resiliency.manager_api.health_policy import HealthConfig
from lm_resiliency.manager_api.health_reading import HealthEvent, HealthReading, HealthSeverity
from lm_resiliency.manager_api.nvml import NvmlSource
from lm_resiliency.manager_api.hooks import OrchestrationHooks, RestartDestinationResolver, dispatch_replay_faults
from lm_resiliency.manager_api.transfer import (
    CheckpointTransfer,
    TransferBackendUnavailable,
    TransferReceipt,
    make_transfer,
)
from lm_resiliency.manager_api.transfer_metadata import TransferKey, TransferMetadataStore, TransferRefused
from lm_resiliency.recovery import RecoveryDecision, RecoveryDecisionCallback
from lm_resiliency.scout.reports import SCOUTFaultCallback, SCOUTFaultReport, replay_fault_reports

__all__ = [
    # Coordination
    "OrchestrationHooks",
    "RestartDestinationResolver",
    "RecoveryDecision",
    "RecoveryDecisionCallback",
    # Fault reports
    "SCOUTFaultReport",
    "SCOUTFaultCallback",
    "replay_fault_reports",
    "dispatch_replay_faults",
    # Hardware health
    "HealthConfig",
    "HardwareHealthMonitor",
    "HealthEvent",
    "HealthReading",
    "HealthSeverity",
    "HealthSource",
    "NvmlSource",
    # Configuration drift
    "local_fingerprint",
    "find_drift",
    "format_drift",
    # Checkpoint transfer
    "CheckpointTransfer",
    "TransferMetadataStore",
    "make_transfer",
    "TransferKey",
    "TransferReceipt",
    "TransferRefused",
    "TransferBackendUnavailable",
]
