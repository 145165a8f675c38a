"""lm-resiliency: keep distributed PyTorch training alive and correct when hardware fails.

Stable package-root API. Only names whose features exist are exported (see docs/api.md).
"""

from lm_resiliency.api import FrameworkName, enable_resiliency
from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.gemini.chunking import estimate_chunk_size
from lm_resiliency.recovery import RecoveryDecision, RecoveryDecisionCallback, RecoveryMode
from lm_resiliency.session import ResiliencyHandle, ResiliencySession

__all__ = [
    "FrameworkName",
    "InMemoryCkptConfig",
    "RecoveryDecision",
    "RecoveryDecisionCallback",
    "RecoveryMode",
    "ResiliencyHandle",
    "ResiliencySession",
    "enable_resiliency",
    "estimate_chunk_size",
]
