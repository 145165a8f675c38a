"""Checkpoint trust states, the job-wide outcome of one SCOUT boundary, and the step check of
trust records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

CANDIDATE = "CANDIDATE"
RECOVERY_VERIFIED = "RECOVERY_VERIFIED"
QUARANTINED = "QUARANTINED"
MANIFEST_STATES = (CANDIDATE, RECOVERY_VERIFIED, QUARANTINED)


@dataclass(frozen=True)
class BoundaryDecision:
    """The job-wide outcome of one SCOUT boundary (identical on every rank of the group).

    step: the boundary's optimizer step.
    verdict: the job-wide verdict ("sdc" > "inconclusive" > "incomplete" > "error" > "straggler" >
        "clean"; "error" is captured uncertified).
    capture: whether GEMINI may capture this step.
    cycle_complete: every rank finished the scheduled recipe cycle at this boundary (all K
        recipes seen, no incomplete check).
    state: trust of this step's checkpoint: "RECOVERY_VERIFIED" (dense), "CANDIDATE" (dynamic)
        or None (plain latest, or not captured).
    verified_step: the step that became RECOVERY_VERIFIED at this boundary, if any.
    candidate_step: the ledger's candidate after this boundary (this step or an older one).
    rejected_step: the candidate rejected (quarantined) at this boundary, if any.
    sdc_detected: some rank reported SDC at this boundary.
    requires_verified_recovery: SDC was detected and training has not yet been restored from a
        RECOVERY_VERIFIED checkpoint.
    reporting_ranks: group ranks whose local verdict was not accepted (sdc, inconclusive or
        incomplete).
    nonfinite_ranks: group ranks whose parameters or optimizer state held NaN or Inf.
    checkpoint_id: the durable checkpoint id saved for this step, if any.
    reason: a sentence for logs and reports.
    """

    step: int
    verdict: str
    capture: bool
    cycle_complete: bool
    state: Optional[str]
    verified_step: Optional[int]
    candidate_step: Optional[int]
    rejected_step: Optional[int]
    sdc_detected: bool
    requires_verified_recovery: bool
    reporting_ranks: Tuple[int, ...]
    checkpoint_id: Optional[str]
    reason: str
    nonfinite_ranks: Tuple[int, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        return {
            "step": self.step, "verdict": self.verdict, "capture": self.capture,
            "cycle_complete": self.cycle_complete, "state": self.state, "verified_step": self.verified_step,
            "candidate_step": self.candidate_step, "rejected_step": self.rejected_step,
            "sdc_detected": self.sdc_detected, "requires_verified_recovery": self.requires_verified_recovery,
            "reporting_ranks": list(self.reporting_ranks), "checkpoint_id": self.checkpoint_id,
            "reason": self.reason, "nonfinite_ranks": list(self.nonfinite_ranks),
        }


def is_step(value: object) -> bool:
    """An optimizer step: a true non-negative int (never a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


