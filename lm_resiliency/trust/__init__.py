"""Checkpoint trust: which captured step a restart after SDC may trust.

The bridge between SCOUT's evidence and GEMINI's (or the framework's) checkpoints. Modules:
`verdicts` (the verdict order), `rules` (the ledger as pure transitions), `ledger` (the
collective, persistent `CertificationLedger`), `manifests` (durable manifest files), `durable`
(the framework's durable-checkpoint adapter), `publish` (the durable side of a boundary, rank 0),
`handoff` (the `RecoveryDecision` builder). It imports only the core layer.

Checkpoint states
-----------------
- *latest*: a step GEMINI captured after an accepted SCOUT check. Usable after a straggler or a
  clean hang sweep, never after SDC.
- ``CANDIDATE``: (dynamic catalogs only) the boundary at the end of a complete accepted recipe
  cycle. It stays excluded from conservative (SDC) recovery.
- ``RECOVERY_VERIFIED``: dense catalog (K=1): every accepted boundary, at once. Dynamic catalog
  (K>1): the previous candidate, once the *following* complete cycle was accepted too, so
  verification covers two consecutive K-recipe cycles.
- ``QUARANTINED``: a durable candidate rejected by SDC (or left uncertified by an inconclusive or
  incomplete cycle). Never loaded.

Rules, per boundary (`CertificationLedger.boundary`, collective over the checkpoint group)
------------------------------------------------------------------------------------------
All ranks first exchange their local verdicts and cycle flags (JSON, no pickle) so that checkpoint
acceptance is job-wide even though SCOUT comparison groups are topology-specific:

- every rank "clean" or "straggler": accepted; GEMINI may capture this step;
- "sdc" on any rank: the capture is vetoed everywhere, the current candidate is rejected
  (quarantined), the preceding RECOVERY_VERIFIED generation is kept, ``sdc_detected_step`` is
  recorded and verified recovery is required. Until `resume_from` (or `load_verified_durable`)
  says training state was restored from verified state, no later boundary captures or certifies
  anything: SDC folded into all replicas by a gradient all-reduce is no longer visible to replay,
  so post-SDC state must never be certified;
- "inconclusive" or "incomplete" on any rank (and no SDC): no capture, and no certification for
  the cycle it belongs to; at the end of that cycle a pending candidate is retired (quarantined,
  not marked SDC) and the two-cycle protocol restarts.
- non-finite state (NaN/Inf in parameters or optimizer state, ``finite=False``) on any rank is
  treated the same way: a state that replay cannot tell from healthy (the NaN reached every
  replica through the gradient all-reduce, so peers agree) is never captured or certified.

A cycle counts as complete only if every rank flags ``cycle_complete`` at the same boundary and
the ledger saw exactly K boundaries since the previous cycle end (a cycle joined midway after a
restart never counts). Boundary steps must increase; a step at or below the previous boundary
means training rolled back: the candidate and any verified entry at or after that step (which the
new timeline will overwrite) are dropped.

Persistence
-----------
Every change is written to the per-rank status sidecar (`StatusStore.write_status`; GEMINI's
`NodeLocalStore` is one) under the key ``"trust"``, keeping any other keys of the sidecar; a new ledger
on the same storage loads it, so a restart after SDC still knows the verified step and cannot
pick a newer candidate. With a group, construction is collective: ranks reconcile what they
loaded conservatively (common verified steps only, a candidate only if all agree).

Durable checkpoints
-------------------
With a `DurableCheckpointConfig`, the framework's own checkpoint store follows the same states
through the adapter callbacks and JSON manifests in ``manifest_dir`` (one per checkpoint id plus
``latest_verified.json``, each published by same-directory temp file, fsync, atomic rename and
directory fsync; directory 0700, files 0600). **Only rank 0 of the group** calls
``save_candidate``, ``commit_candidate`` and ``quarantine_candidate`` and writes manifests; the
framework callback is assumed to coordinate its own ranks (for example by saving from rank 0, or
by signalling the other ranks itself). Rank 0's outcome is then shared with every rank, and a
callback failure raises `DurableCheckpointError` on every rank. ``load_checkpoint`` is called on
every rank by `load_verified_durable`, so ``manifest_dir`` must be readable by every rank.
"""

from lm_resiliency.trust.decision import (CANDIDATE, MANIFEST_STATES, QUARANTINED, RECOVERY_VERIFIED,
                                          BoundaryDecision)
from lm_resiliency.trust.durable import (CallbackDurableCheckpointAdapter, DurableCheckpointAdapter,
                                         DurableCheckpointConfig)
from lm_resiliency.trust.errors import CertificationError, DurableCheckpointError, ManifestRejected
from lm_resiliency.trust.ledger import CertificationLedger, StatusStore
from lm_resiliency.trust.manifests import LATEST_VERIFIED_FILE, manifest_name
from lm_resiliency.trust.verdicts import PRECEDENCE, VERDICTS, verdict_of, worst

__all__ = [
    "BoundaryDecision",
    "CallbackDurableCheckpointAdapter",
    "CANDIDATE",
    "CertificationError",
    "CertificationLedger",
    "DurableCheckpointAdapter",
    "DurableCheckpointConfig",
    "DurableCheckpointError",
    "LATEST_VERIFIED_FILE",
    "MANIFEST_STATES",
    "ManifestRejected",
    "PRECEDENCE",
    "QUARANTINED",
    "RECOVERY_VERIFIED",
    "StatusStore",
    "VERDICTS",
    "manifest_name",
    "verdict_of",
    "worst",
]
