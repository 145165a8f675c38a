"""Errors of checkpoint certification; every message says what was wrong."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordRejected

if TYPE_CHECKING:
    from lm_resiliency.trust.decision import BoundaryDecision


class CertificationError(ResiliencyError, RuntimeError):
    """Certification state is unusable or the ranks do not agree; the message says why."""


class ManifestRejected(CertificationError, RecordRejected):
    """A durable manifest is malformed, foreign (environment id), unsafe, or inconsistent."""


class TrustRecordRejected(CertificationError, RecordRejected):
    """A persisted certification trust record (in a status sidecar) is malformed or inconsistent."""


class DurableCheckpointError(CertificationError):
    """A durable adapter callback failed on rank 0. Raised on every rank after the trust change
    that did succeed was persisted; `decision` is the boundary's decision (its capture permission
    is still valid: it depends only on the SCOUT verdicts)."""

    def __init__(self, message: str, decision: "BoundaryDecision") -> None:
        super().__init__(message)
        self.decision = decision
