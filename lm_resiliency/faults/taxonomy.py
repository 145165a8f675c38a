"""The 21 canonical failure types, where they can strike (surfaces) and how safe they are."""

from __future__ import annotations

from enum import Enum
from typing import Dict, FrozenSet, Tuple


class SafetyClass(str, Enum):
    """How dangerous a failure type is to perform on a shared host.

    IN_PROCESS_SAFE: the effect stays inside the training process (a corrupted tensor, a sleep,
    a raised exception); the job may fail, the host never suffers.
    SANDBOXED_DESTRUCTIVE: the effect destroys something outside the Python objects (the
    process itself, files, disk space); executors confine it to the target rank's own process,
    its own GEMINI shard files, or a disposable rank-local sandbox directory.
    UNSUPPORTED_HERE: a faithful effect needs infrastructure a single host does not lend safely
    (a real NIC, a switch); the local executor refuses it with `UnsupportedFaultError`.
    """

    IN_PROCESS_SAFE = "in_process_safe"
    SANDBOXED_DESTRUCTIVE = "sandboxed_destructive"
    UNSUPPORTED_HERE = "unsupported_here"


class FaultSurface(str, Enum):
    """Where a fault strikes. The surface decides when a "matching call" happens:

    OUTPUT / INPUT: each forward call of `module_path` (forward hook / forward pre-hook).
    GRADIENT: each optimizer step, before it runs (gradients are present).
    PARAMETER / OPTIMIZER_STATE: tensor corruption at the start of each iteration; stale state
    around each optimizer step (the step's update is undone).
    DATALOADER: each batch fetched through `FaultInjectionSession.wrap_dataloader`.
    PROCESS, CHECKPOINT, COLLECTIVE, NETWORK, STORAGE, DEVICE, CONFIG: once per iteration, at the
    first forward of the iteration (after the previous optimizer step).
    """

    OUTPUT = "output"
    INPUT = "input"
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    CHECKPOINT = "checkpoint"
    COLLECTIVE = "collective"
    DATALOADER = "dataloader"
    PROCESS = "process"
    NETWORK = "network"
    STORAGE = "storage"
    DEVICE = "device"
    CONFIG = "config"


class FailureType(str, Enum):
    """The 21 canonical failure types."""

    TENSOR_CORRUPTION = "tensor_corruption"
    STALE_STATE = "stale_state"
    DROP = "drop"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    DELAY = "delay"
    HANG = "hang"
    TIMEOUT = "timeout"
    EXCEPTION = "exception"
    RESOURCE_EXHAUSTION = "resource_exhaustion"
    PROCESS_TERMINATION = "process_termination"
    RESOURCE_UNAVAILABLE = "resource_unavailable"
    CHECKPOINT_CORRUPTION = "checkpoint_corruption"
    CHECKPOINT_TRUNCATION = "checkpoint_truncation"
    CHECKPOINT_MISSING = "checkpoint_missing"
    IO_ERROR = "io_error"
    PAYLOAD_CORRUPTION = "payload_corruption"
    COLLECTIVE_DESYNC = "collective_desync"
    MESSAGE_DROP = "message_drop"
    NETWORK_PARTITION = "network_partition"
    CONFIG_DRIFT = "config_drift"

    @property
    def safety_class(self) -> SafetyClass:
        return SAFETY_CLASS[self]

    @property
    def surfaces(self) -> Tuple[FaultSurface, ...]:
        """Surfaces this type may target (the first is the usual one)."""
        return SURFACES[self]


S, F = SafetyClass, FailureType
SAFETY_CLASS: Dict[FailureType, SafetyClass] = {
    F.TENSOR_CORRUPTION: S.IN_PROCESS_SAFE,
    F.STALE_STATE: S.IN_PROCESS_SAFE,
    F.DROP: S.IN_PROCESS_SAFE,
    F.DUPLICATE: S.IN_PROCESS_SAFE,
    F.REORDER: S.IN_PROCESS_SAFE,
    F.DELAY: S.IN_PROCESS_SAFE,
    F.HANG: S.IN_PROCESS_SAFE,
    F.TIMEOUT: S.IN_PROCESS_SAFE,
    F.EXCEPTION: S.IN_PROCESS_SAFE,
    F.RESOURCE_EXHAUSTION: S.SANDBOXED_DESTRUCTIVE,
    F.PROCESS_TERMINATION: S.SANDBOXED_DESTRUCTIVE,
    F.RESOURCE_UNAVAILABLE: S.SANDBOXED_DESTRUCTIVE,
    F.CHECKPOINT_CORRUPTION: S.SANDBOXED_DESTRUCTIVE,
    F.CHECKPOINT_TRUNCATION: S.SANDBOXED_DESTRUCTIVE,
    F.CHECKPOINT_MISSING: S.SANDBOXED_DESTRUCTIVE,
    F.IO_ERROR: S.IN_PROCESS_SAFE,
    F.PAYLOAD_CORRUPTION: S.IN_PROCESS_SAFE,
    F.COLLECTIVE_DESYNC: S.IN_PROCESS_SAFE,
    F.MESSAGE_DROP: S.IN_PROCESS_SAFE,
    F.NETWORK_PARTITION: S.UNSUPPORTED_HERE,
    F.CONFIG_DRIFT: S.IN_PROCESS_SAFE,
}

U = FaultSurface
_STALL_SURFACES = (U.OUTPUT, U.INPUT, U.PROCESS, U.DATALOADER, U.COLLECTIVE, U.CHECKPOINT, U.STORAGE)
SURFACES: Dict[FailureType, Tuple[FaultSurface, ...]] = {
    F.TENSOR_CORRUPTION: (U.OUTPUT, U.INPUT, U.PARAMETER, U.GRADIENT, U.OPTIMIZER_STATE),
    F.STALE_STATE: (U.PARAMETER, U.OPTIMIZER_STATE),
    F.DROP: (U.DATALOADER, U.COLLECTIVE),
    F.DUPLICATE: (U.DATALOADER, U.COLLECTIVE),
    F.REORDER: (U.DATALOADER, U.COLLECTIVE),
    F.DELAY: _STALL_SURFACES,
    F.HANG: _STALL_SURFACES,
    F.TIMEOUT: _STALL_SURFACES,
    F.EXCEPTION: _STALL_SURFACES,
    F.RESOURCE_EXHAUSTION: (U.STORAGE, U.PROCESS, U.DEVICE),
    F.PROCESS_TERMINATION: (U.PROCESS,),
    F.RESOURCE_UNAVAILABLE: (U.DEVICE, U.STORAGE),
    F.CHECKPOINT_CORRUPTION: (U.CHECKPOINT,),
    F.CHECKPOINT_TRUNCATION: (U.CHECKPOINT,),
    F.CHECKPOINT_MISSING: (U.CHECKPOINT,),
    F.IO_ERROR: (U.STORAGE, U.CHECKPOINT, U.DATALOADER, U.PROCESS),
    F.PAYLOAD_CORRUPTION: (U.COLLECTIVE, U.DATALOADER),
    F.COLLECTIVE_DESYNC: (U.COLLECTIVE,),
    F.MESSAGE_DROP: (U.COLLECTIVE, U.NETWORK),
    F.NETWORK_PARTITION: (U.NETWORK,),
    F.CONFIG_DRIFT: (U.CONFIG,),
}

# Surfaces whose matching call is a forward call of `module_path` (it must be given).
MODULE_SURFACES: FrozenSet[FaultSurface] = frozenset({U.OUTPUT, U.INPUT})
# Surfaces that may name a `module_path` to select parameters (None: the whole model).
PARAMETER_SURFACES: FrozenSet[FaultSurface] = frozenset({U.PARAMETER, U.GRADIENT, U.OPTIMIZER_STATE})

# Localization kinds (SCOUT report kinds and neutral names) that count as "the right kind" for
# each failure type when an incident does not list its own `expected_kinds`.
DEFAULT_KINDS: Dict[FailureType, FrozenSet[str]] = {
    F.TENSOR_CORRUPTION: frozenset({"sdc", "sdc_peer_group", "tensor_corruption"}),
    F.STALE_STATE: frozenset({"sdc", "sdc_peer_group", "stale_state"}),
    F.DROP: frozenset({"drop", "dataloader_stall", "sdc"}),
    F.DUPLICATE: frozenset({"duplicate", "sdc"}),
    F.REORDER: frozenset({"reorder", "sdc"}),
    F.DELAY: frozenset({"delay", "compute_straggler", "communication_straggler", "dataloader_stall",
                        "checkpoint_io_stall"}),
    F.HANG: frozenset({"hang", "dataloader_stall", "checkpoint_io_stall"}),
    F.TIMEOUT: frozenset({"timeout", "hang"}),
    F.EXCEPTION: frozenset({"exception", "process_failure"}),
    F.RESOURCE_EXHAUSTION: frozenset({"resource_exhaustion", "hardware"}),
    F.PROCESS_TERMINATION: frozenset({"process_termination", "process_failure", "hang"}),
    F.RESOURCE_UNAVAILABLE: frozenset({"resource_unavailable", "hardware"}),
    F.CHECKPOINT_CORRUPTION: frozenset({"checkpoint_corruption", "checkpoint_rejected"}),
    F.CHECKPOINT_TRUNCATION: frozenset({"checkpoint_truncation", "checkpoint_rejected"}),
    F.CHECKPOINT_MISSING: frozenset({"checkpoint_missing", "checkpoint_rejected"}),
    F.IO_ERROR: frozenset({"io_error", "checkpoint_io_stall", "process_failure"}),
    F.PAYLOAD_CORRUPTION: frozenset({"payload_corruption", "sdc", "sdc_peer_group"}),
    F.COLLECTIVE_DESYNC: frozenset({"collective_desync", "hang"}),
    F.MESSAGE_DROP: frozenset({"message_drop", "hang", "communication_straggler"}),
    F.NETWORK_PARTITION: frozenset({"network_partition", "hang", "communication_straggler"}),
    F.CONFIG_DRIFT: frozenset({"config_drift", "sdc"}),
}
del S, F, U

__all__ = ["DEFAULT_KINDS", "FailureType", "FaultSurface", "MODULE_SURFACES", "PARAMETER_SURFACES",
           "SAFETY_CLASS", "SURFACES", "SafetyClass"]
