"""SCOUT verdicts as checkpoint trust reads them: the one verdict order, and a result's verdict.

A boundary's verdict is the worst of the verdicts since the previous boundary (`worst`), first on
each rank (the session) and then job-wide (the ledger), in the same `PRECEDENCE`.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

VERDICTS = ("clean", "straggler", "sdc", "inconclusive", "incomplete", "error")
# Worst first.
PRECEDENCE = ("sdc", "inconclusive", "incomplete", "error", "straggler", "clean")
ACCEPTED = ("clean", "straggler")
# "error": a SCOUT check failed for an internal reason. No evidence either way: the step is
# captured, but the cycle cannot certify it (it stays plain latest state, never RECOVERY_VERIFIED).
CAPTURED_UNCERTIFIED = ("error",)


class StragglerEvidence(Protocol):
    @property
    def confirmed(self) -> bool: ...


class ReplayEvidence(Protocol):
    """What a verdict reads from one SCOUT check result (`scout.reports.ReplayResult`)."""

    @property
    def sdc(self) -> bool: ...
    @property
    def inconclusive(self) -> bool: ...
    @property
    def errors(self) -> Sequence[object]: ...
    @property
    def stragglers(self) -> Sequence[StragglerEvidence]: ...


def verdict_of(result: Optional[ReplayEvidence]) -> str:
    """The local verdict `CertificationLedger.boundary` expects for one SCOUT result on this rank
    (None: the check did not produce a result, "incomplete")."""
    if result is None:
        return "incomplete"
    if result.sdc:
        return "sdc"
    if result.inconclusive:
        return "inconclusive"
    if result.errors:
        return "error"
    if any(s.confirmed for s in result.stragglers):
        return "straggler"
    return "clean"


def worst(*verdicts: str) -> str:
    """The worst of `verdicts` in `PRECEDENCE` (at least one, each one of `VERDICTS`)."""
    unknown = [v for v in verdicts if v not in VERDICTS]
    if unknown or not verdicts:
        raise ValueError(f"worst: verdicts must be one or more of {', '.join(VERDICTS)}, got {verdicts!r}")
    return next(v for v in PRECEDENCE if v in verdicts)
