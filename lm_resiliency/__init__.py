"""lm-resiliency: keep distributed PyTorch training alive and correct when hardware fails.

Stable package-root API. Only names whose features exist are exported (see docs/api.md).
"""

from lm_resiliency.config import InMemoryCkptConfig
from lm_resiliency.gemini.chunking import estimate_chunk_size

__all__ = [
    "InMemoryCkptConfig",
    "estimate_chunk_size",
]
