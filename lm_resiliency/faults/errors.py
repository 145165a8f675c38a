"""Exceptions of the fault injection kit."""

from __future__ import annotations

from typing import Any, Dict, Optional

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import RecordRejected


class CampaignSchemaError(RecordRejected):
    """A campaign object or manifest field is invalid.

    `path` names the field: ``FaultTarget.rank`` when an object is constructed directly,
    ``$.incidents[0].faults[0].target.rank`` when a JSON manifest is loaded.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class CampaignIdentityError(ResiliencyError, ValueError):
    """A campaign state store or journal belongs to another manifest than the one attached: its
    claims and records would be taken for this manifest's (a changed fault recorded
    `already_claimed` and never injected). The message names both manifest digests."""


class UnsupportedFaultError(ResiliencyError, ValueError):
    """An executor cannot perform this fault here (or the campaign cannot be bound to this
    model); the message says why. A `ValueError`: the fault as given is refused."""

    def __init__(self, fault_id: str, reason: str) -> None:
        self.fault_id = fault_id
        self.reason = reason
        super().__init__(f"fault {fault_id!r} cannot be injected here: {reason}")


class InjectedFault(ResiliencyError, RuntimeError):
    """Raised on purpose by an `exception` fault (and its `timeout`/`io_error` subclasses);
    never raised by anything else. Catching it in a test proves the fault was the cause."""

    def __init__(self, message: str, *, occurrence_id: str = "", fault_id: str = "",
                 evidence: Optional[Dict[str, Any]] = None) -> None:
        self.occurrence_id = occurrence_id
        self.fault_id = fault_id
        self.evidence = dict(evidence or {})
        super().__init__(message)


class InjectedTimeout(InjectedFault, TimeoutError):
    """Raised on purpose by a `timeout` fault after its wait."""


class InjectedIOError(InjectedFault, OSError):
    """Raised on purpose by an `io_error` fault (errno EIO unless the fault says otherwise)."""

    def __init__(self, message: str, *, errno_value: int, occurrence_id: str = "",
                 fault_id: str = "", evidence: Optional[Dict[str, Any]] = None) -> None:
        InjectedFault.__init__(self, message, occurrence_id=occurrence_id, fault_id=fault_id,
                               evidence=evidence)
        self.errno = errno_value
        self.strerror = message


__all__ = ["CampaignIdentityError", "CampaignSchemaError", "InjectedFault", "InjectedIOError", "InjectedTimeout",
           "UnsupportedFaultError"]
