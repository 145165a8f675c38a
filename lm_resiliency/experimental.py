"""Unstable low-level components. Names here may change within the 0.x series."""

from lm_resiliency.gemini.integrity import IntegrityError, NonFiniteState
from lm_resiliency.gemini.manager import InMemoryCheckpointManager, RecoveryUnavailable

__all__ = ["InMemoryCheckpointManager", "IntegrityError", "NonFiniteState", "RecoveryUnavailable"]
