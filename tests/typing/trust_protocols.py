"""The engines satisfy trust's protocols, checked by mypy (`make test`), never run.

trust imports neither GEMINI nor SCOUT (tests/test_layering.py); these assignments fail the
check if GEMINI's storage or SCOUT's result stops matching what trust reads from it.
"""

from __future__ import annotations

from lm_resiliency.gemini.storage import NodeLocalStore
from lm_resiliency.scout.reports import ReplayResult
from lm_resiliency.trust.ledger import StatusStore
from lm_resiliency.trust.verdicts import ReplayEvidence


def gemini_storage_is_a_status_store(store: NodeLocalStore) -> StatusStore:
    return store


def scout_result_is_replay_evidence(result: ReplayResult) -> ReplayEvidence:
    return result
