"""The durable side of one boundary, on rank 0: the adapter's callbacks and the manifests.

Order: quarantine first, then commit the previous candidate, then save (and, dense, commit)
this boundary's checkpoint. A QUARANTINED manifest is written before the framework's callback, so
the candidate is excluded even if the callback fails; a RECOVERY_VERIFIED manifest only after the
framework's commit succeeded, so an interruption never leaves a candidate looking verified.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from lm_resiliency.trust.decision import CANDIDATE, QUARANTINED, RECOVERY_VERIFIED
from lm_resiliency.trust.durable import DurableCheckpointAdapter
from lm_resiliency.trust.errors import CertificationError, ManifestRejected
from lm_resiliency.trust.manifests import ManifestStore, manifest_name
from lm_resiliency.trust.rules import Plan

logger = logging.getLogger(__name__)


def run_plan(adapter: DurableCheckpointAdapter, manifests: ManifestStore, plan: Plan) -> Dict[str, Any]:
    """Run `plan`; the JSON outcome every rank then applies (`rules.settle_boundary`). A failure
    is not raised here: it is in ``outcome["error"]``, so every rank raises it alike."""
    out: Dict[str, Any] = {"committed": False, "saved": False, "saved_id": None, "verified_new": False,
                           "invalidated_id": None, "error": None}
    try:
        manifests.ensure_directory()
        if plan.quarantine is not None:
            q_step, q_id, q_reason = plan.quarantine
            if q_id is not None:                                       # excluded before anything else
                manifests.write(q_id, q_step, QUARANTINED, q_reason)
                adapter.quarantine_candidate(q_id, q_step, q_reason)
        if plan.commit is not None:
            out["committed"] = _commit(adapter, manifests, *plan.commit)
        if plan.save is not None:
            new_id = _save(adapter, manifests, plan.save, out)
            out["saved"], out["saved_id"] = True, new_id
            if plan.verify_new:
                adapter.commit_candidate(new_id, plan.save)
                manifests.write(new_id, plan.save, RECOVERY_VERIFIED)
                out["verified_new"] = True
    except Exception as exc:  # noqa: BLE001 - shared with every rank, then raised there
        logger.exception("durable checkpoint callback or manifest publication failed")
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _commit(adapter: DurableCheckpointAdapter, manifests: ManifestStore, step: int,
            checkpoint_id: Optional[str]) -> bool:
    """Promote the candidate to RECOVERY_VERIFIED (True; a candidate without a durable copy has
    nothing to commit)."""
    if checkpoint_id is None:
        return True
    current = manifests.read(manifest_name(checkpoint_id))
    if current is None or current["state"] != CANDIDATE or current["step"] != step:
        found = "missing" if current is None else f"{current['state']} at step {current['step']}"
        raise ManifestRejected(f"candidate {checkpoint_id!r} (step {step}) has manifest {found}; "
                               "refusing to promote it")
    adapter.commit_candidate(checkpoint_id, step)
    manifests.write(checkpoint_id, step, RECOVERY_VERIFIED)
    return True


def _save(adapter: DurableCheckpointAdapter, manifests: ManifestStore, step: int, out: Dict[str, Any]) -> str:
    """Save the candidate of `step` and publish its CANDIDATE manifest; its checkpoint id. An id
    that names a RECOVERY_VERIFIED checkpoint quarantines that checkpoint (its bytes may have been
    overwritten; `out["invalidated_id"]`) and fails."""
    new_id = adapter.save_candidate(step)
    if not isinstance(new_id, str) or not new_id:
        raise CertificationError(f"save_candidate({step}) returned {new_id!r}, not a non-empty "
                                 "checkpoint id string")
    existing = manifests.read(manifest_name(new_id))
    if existing is not None and existing["state"] == RECOVERY_VERIFIED:
        out["invalidated_id"] = new_id
        manifests.write(new_id, existing["step"], QUARANTINED,
                        f"checkpoint id reused by save_candidate({step}); the verified bytes "
                        "may have been overwritten")
        manifests.refresh_pointer()
        raise CertificationError(f"save_candidate({step}) returned {new_id!r}, the id of a "
                                 f"RECOVERY_VERIFIED checkpoint (step {existing['step']}); ids must be "
                                 "unique and a verified checkpoint must never be overwritten")
    manifests.write(new_id, step, CANDIDATE)
    return new_id
