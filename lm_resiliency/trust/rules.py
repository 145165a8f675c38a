"""The certification ledger's rules as pure transitions: state + event -> new state.

No files, no process groups: `trust.ledger.CertificationLedger` gathers every rank's view, calls
these functions with it, runs the durable side of a boundary's `Plan` on rank 0 and persists the
state. Given the same inputs every rank computes the same state. The rules themselves are in the
`lm_resiliency.trust` package docstring.

A boundary is two transitions, because the durable callbacks run between them:
`plan_boundary(state, event) -> (state, Boundary)` decides, `settle_boundary(state, boundary,
outcome) -> (state, BoundaryDecision)` applies what rank 0's callbacks achieved.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lm_resiliency.files import RecordSchema, array, boolean, check_record, integer, nested, nullable, text
from lm_resiliency.trust.decision import CANDIDATE, RECOVERY_VERIFIED, BoundaryDecision, is_step
from lm_resiliency.trust.errors import CertificationError, TrustRecordRejected
from lm_resiliency.trust.verdicts import ACCEPTED, CAPTURED_UNCERTIFIED, VERDICTS, worst

logger = logging.getLogger(__name__)

TRUST_SCHEMA_VERSION = 1
VERIFIED_HISTORY_LIMIT = 8

_STEP = nullable(integer(0))
_CHECKPOINT_ID = nullable(text(max_length=None))
_VERIFIED_ENTRY = RecordSchema(what="verified_history entry",
                               fields={"step": integer(0), "checkpoint_id": _CHECKPOINT_ID})
# The trust record a rank persists in its status sidecar (`TrustState.to_doc`).
TRUST_SCHEMA = RecordSchema(what="persisted certification trust", identity=("schema_version", TRUST_SCHEMA_VERSION),
                            fields={"catalog_size": integer(1), "candidate_step": _STEP,
                                    "candidate_checkpoint_id": _CHECKPOINT_ID, "recovery_verified_step": _STEP,
                                    "verified_history": array(nested(_VERIFIED_ENTRY), max_length=None),
                                    "sdc_detected_step": _STEP, "sdc_pending": boolean(), "last_boundary_step": _STEP})

Entry = Tuple[int, Optional[str]]  # (step, durable checkpoint id or None)


@dataclass(frozen=True)
class TrustState:
    """One rank's certification state. `to_doc` is what is persisted; the cycle counters are
    not (a restart never continues a cycle)."""

    catalog_size: int
    # A dynamic catalog (MoE recipes) goes through CANDIDATE even when it compresses to K = 1;
    # only a dense catalog certifies at once. Not persisted: the session sets it from SCOUT.
    dynamic: bool = False
    candidate: Optional[Entry] = None
    history: Tuple[Entry, ...] = ()          # RECOVERY_VERIFIED, newest first
    sdc_step: Optional[int] = None
    sdc_pending: bool = False
    last_step: Optional[int] = None
    cycle_seen: int = 0
    cycle_tainted: bool = False

    @property
    def immediate(self) -> bool:
        """Dense (K = 1, not dynamic): an accepted check's capture is RECOVERY_VERIFIED at once."""
        return self.catalog_size == 1 and not self.dynamic

    @property
    def candidate_step(self) -> Optional[int]:
        return self.candidate[0] if self.candidate else None

    @property
    def verified_step(self) -> Optional[int]:
        return self.history[0][0] if self.history else None

    def verified_steps(self) -> List[int]:
        return [s for s, _ in self.history]

    def to_doc(self) -> Dict[str, Any]:
        return {
            "schema_version": TRUST_SCHEMA_VERSION,
            "catalog_size": self.catalog_size,
            "candidate_step": self.candidate_step,
            "candidate_checkpoint_id": self.candidate[1] if self.candidate else None,
            "recovery_verified_step": self.verified_step,
            "verified_history": [{"step": s, "checkpoint_id": i} for s, i in self.history],
            "sdc_detected_step": self.sdc_step,
            "sdc_pending": self.sdc_pending,
            "last_boundary_step": self.last_step,
        }


def _with_verified(history: Sequence[Entry], entry: Entry) -> Tuple[Entry, ...]:
    kept = sorted([h for h in history if h[0] != entry[0]] + [entry], key=lambda h: -h[0])
    return tuple(kept[:VERIFIED_HISTORY_LIMIT])


# ---------------------------------------------------------------------------- persisted trust


def parse_trust(trust: Any) -> Dict[str, Any]:
    """`trust` if it is a valid persisted trust record; CertificationError naming the field if not."""
    def bad(reason: str) -> CertificationError:
        return TrustRecordRejected(f"persisted certification trust is invalid: {reason}; refusing to use it")

    check_record(trust, TRUST_SCHEMA, "persisted certification trust (refusing to use it)", error=TrustRecordRejected)
    cid = trust["candidate_checkpoint_id"]
    if cid is not None and trust["candidate_step"] is None:
        raise bad(f"candidate_checkpoint_id {cid!r} does not go with candidate_step {trust['candidate_step']!r}")
    history = trust["verified_history"]
    previous = None
    for entry in history:
        if previous is not None and entry["step"] >= previous:
            raise bad("verified_history is not strictly newest first")
        previous = entry["step"]
    newest = history[0]["step"] if history else None
    if trust["recovery_verified_step"] != newest:
        raise bad(f"recovery_verified_step {trust['recovery_verified_step']!r} is not the newest verified_history "
                  f"step {newest!r}")
    return trust


def loaded(state: TrustState, trust: Any) -> Tuple[TrustState, bool]:
    """`state` with the persisted record `trust` loaded, and whether it had to be adjusted (and
    should be rewritten). A candidate of another catalog size is dropped; verified steps stay."""
    trust = parse_trust(trust)
    history = [(e["step"], e["checkpoint_id"]) for e in trust["verified_history"]]
    changed = len(history) > VERIFIED_HISTORY_LIMIT or trust["catalog_size"] != state.catalog_size
    candidate = None
    if trust["candidate_step"] is not None:
        if trust["catalog_size"] != state.catalog_size:
            logger.warning("certification catalog changed from %d to %d recipes: dropping candidate step %d "
                           "(verified steps are kept)", trust["catalog_size"], state.catalog_size,
                           trust["candidate_step"])
        else:
            candidate = (trust["candidate_step"], trust["candidate_checkpoint_id"])
    state = dataclasses.replace(state, candidate=candidate, history=tuple(history[:VERIFIED_HISTORY_LIMIT]),
                                sdc_step=trust["sdc_detected_step"], sdc_pending=trust["sdc_pending"],
                                last_step=trust["last_boundary_step"])
    if state.sdc_pending:
        logger.warning("certification: SDC was detected at step %s and no verified recovery has been recorded; "
                       "restore RECOVERY_VERIFIED state (verified steps %s) and call resume_from()",
                       state.sdc_step, state.verified_steps())
    return state, changed


def reconcile(state: TrustState, trusts: Sequence[Dict[str, Any]]) -> TrustState:
    """Keep only what every rank's trust record holds (conservative): the candidate if all agree,
    the verified entries all hold, any rank's SDC latch, the newest SDC and boundary steps."""
    candidates = {(t["candidate_step"], t["candidate_checkpoint_id"]) for t in trusts}
    candidate: Optional[Entry] = None
    if len(candidates) == 1:
        step, cid = candidates.pop()
        candidate = (step, cid) if step is not None else None
    else:
        logger.warning("certification: ranks hold different candidates %s; dropping the candidate",
                       sorted(candidates, key=str))
    common: Optional[set] = None
    for t in trusts:
        entries = {(e["step"], e["checkpoint_id"]) for e in t["verified_history"]}
        common = entries if common is None else common & entries
    history = sorted(common or (), key=lambda h: -h[0])
    steps = [s for s, _ in history]
    if len(set(steps)) != len(steps):   # same step, different ids: ambiguous, keep neither
        history = [h for h in history if steps.count(h[0]) == 1]
    sdc = [t["sdc_detected_step"] for t in trusts if t["sdc_detected_step"] is not None]
    last = [t["last_boundary_step"] for t in trusts if t["last_boundary_step"] is not None]
    return dataclasses.replace(state, candidate=candidate, history=tuple(history[:VERIFIED_HISTORY_LIMIT]),
                               sdc_step=max(sdc) if sdc else None,
                               sdc_pending=any(t["sdc_pending"] for t in trusts),
                               last_step=max(last) if last else None)


# ---------------------------------------------------------------------------- recovery


def resumed(state: TrustState, step: int, verified: Optional[Entry] = None) -> TrustState:
    """Training state was restored to `step` (from the durable checkpoint `verified`, if given):
    drop newer candidate and verified entries, restart cycle counting, clear the SDC latch."""
    candidate = state.candidate
    if candidate is not None and candidate[0] > step:
        logger.info("resumed from step %d: dropping newer candidate step %d", step, candidate[0])
        candidate = None
    history: Tuple[Entry, ...] = tuple(h for h in state.history if h[0] <= step)
    if verified is not None and verified[0] not in [s for s, _ in history]:
        history = _with_verified(history, verified)
    return dataclasses.replace(state, candidate=candidate, history=history, sdc_pending=False, last_step=step,
                               cycle_seen=0, cycle_tainted=False)


def resumed_from(state: TrustState, step: int) -> TrustState:
    """`resumed`, refusing a step that is not RECOVERY_VERIFIED while SDC is pending."""
    if not is_step(step):
        raise ValueError(f"resume_from: step must be a non-negative integer, got {step!r}")
    if state.sdc_pending and step not in state.verified_steps():
        raise CertificationError(
            f"resume_from({step}): SDC was detected at step {state.sdc_step}, so training must restart from "
            f"a RECOVERY_VERIFIED step (known: {state.verified_steps()}); step {step} is not one")
    return resumed(state, step)


def sdc_noted(state: TrustState, step: int) -> TrustState:
    """SDC found outside a boundary at `step`: verified-only recovery is latched."""
    if not is_step(step):
        raise ValueError(f"note_sdc: step must be a non-negative integer, got {step!r}")
    return dataclasses.replace(state, sdc_step=step, sdc_pending=True)


# ---------------------------------------------------------------------------- boundary


def boundary_problem(step: object, local_verdict: object, cycle_complete: object, finite: object) -> Optional[str]:
    """What is wrong with one rank's `boundary` arguments, or None."""
    if not is_step(step):
        return f"step must be a non-negative integer, got {step!r}"
    if local_verdict not in VERDICTS:
        return f"local_verdict must be one of {', '.join(VERDICTS)}, got {local_verdict!r}"
    if not isinstance(cycle_complete, bool):
        return f"cycle_complete must be True or False, got {cycle_complete!r}"
    if not isinstance(finite, bool):
        return f"finite must be True or False, got {finite!r}"
    return None


@dataclass(frozen=True)
class BoundaryEvent:
    """Every rank's view of one boundary, agreed: same step, same catalog size."""

    step: int
    verdicts: Tuple[str, ...]              # by group rank
    cycle_flags: Tuple[bool, ...]
    nonfinite_ranks: Tuple[int, ...]


def agreed(state: TrustState, views: Sequence[Dict[str, Any]]) -> Tuple[TrustState, BoundaryEvent]:
    """The boundary every rank reported (`views`, by group rank, as `CertificationLedger.boundary`
    gathers them), with the ranks' trust and cycle counters merged conservatively and a rollback
    applied. CertificationError if a rank's arguments were invalid or the ranks are not aligned."""
    failed = [(r, v["error"]) for r, v in enumerate(views) if v["error"]]
    if failed:
        raise CertificationError("boundary: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
    steps = sorted({v["step"] for v in views})
    if len(steps) > 1:
        raise CertificationError(f"boundary: ranks are at different steps {steps}; the SCOUT schedule is not "
                                 "aligned across the checkpoint group, refusing any trust decision")
    sizes = sorted({v["catalog_size"] for v in views})
    if len(sizes) > 1:
        raise CertificationError(f"boundary: ranks disagree on catalog_size ({sizes})")
    step = steps[0]
    if any(v["trust"] != views[0]["trust"] for v in views):
        logger.warning("certification trust differed across ranks at step %d; keeping only what every "
                       "rank holds", step)
        state = reconcile(state, [v["trust"] for v in views])
    if any(v["cycle"] != views[0]["cycle"] for v in views):
        state = dataclasses.replace(state, cycle_seen=max(v["cycle"][0] for v in views), cycle_tainted=True)
    if state.last_step is not None and step <= state.last_step:
        logger.warning("boundary step %d is not after the previous boundary %d: training rolled back without "
                       "resume_from(); dropping the candidate and verified entries at or after step %d",
                       step, state.last_step, step)
        state = dataclasses.replace(state, candidate=None, history=tuple(h for h in state.history if h[0] < step),
                                    cycle_seen=0, cycle_tainted=False)
    event = BoundaryEvent(step=step, verdicts=tuple(v["verdict"] for v in views),
                          cycle_flags=tuple(v["cycle_complete"] for v in views),
                          nonfinite_ranks=tuple(r for r, v in enumerate(views) if v["finite"] is not True))
    return state, event


@dataclass(frozen=True)
class Plan:
    """The durable side of a boundary, in the order rank 0 runs it."""

    quarantine: Optional[Tuple[int, Optional[str], str]] = None   # (step, id, reason)
    commit: Optional[Entry] = None                                # (step, id)
    save: Optional[int] = None                                    # step
    verify_new: bool = False                                      # dense: commit the save at once

    def durable_work(self) -> bool:
        return ((self.quarantine is not None and self.quarantine[1] is not None)
                or (self.commit is not None and self.commit[1] is not None) or self.save is not None)

    def outcome_without_durable(self) -> Dict[str, Any]:
        """The outcome when no durable store is configured or the plan needs none."""
        return {"committed": self.commit is not None, "saved": self.save is not None, "saved_id": None,
                "verified_new": self.verify_new, "invalidated_id": None, "error": None}


@dataclass(frozen=True)
class Boundary:
    """What `plan_boundary` decided, before the durable side ran."""

    step: int
    verdict: str
    capture: bool
    complete: bool
    reporting_ranks: Tuple[int, ...]
    sdc_ranks: Tuple[int, ...]
    nonfinite_ranks: Tuple[int, ...]
    reason: str
    plan: Plan


def _reason(state: TrustState, event: BoundaryEvent, verdict: str, sdc_ranks: Tuple[int, ...],
            reporting: Tuple[int, ...]) -> str:
    """Why this boundary is (not) captured, before the cycle's outcome is added."""
    if sdc_ranks:
        verified = state.verified_step
        return (f"SDC reported by group ranks {list(sdc_ranks)}: capture vetoed on every rank; recovery must "
                + (f"use RECOVERY_VERIFIED step {verified}" if verified is not None
                   else "use a RECOVERY_VERIFIED checkpoint, and none exists yet"))
    if state.sdc_pending:
        return (f"SDC was detected at step {state.sdc_step} and training has not been restored from "
                "RECOVERY_VERIFIED state since; nothing is captured or certified")
    if event.nonfinite_ranks:
        return (f"non-finite parameters or optimizer state (NaN/Inf) on group ranks {list(event.nonfinite_ranks)}: "
                "no capture, and the current cycle cannot certify anything")
    if verdict in CAPTURED_UNCERTIFIED:
        return (f"a SCOUT check failed internally on group ranks {list(reporting)}: captured uncertified, "
                "and the current cycle cannot certify anything")
    if verdict not in ACCEPTED:
        return (f"{verdict} SCOUT evidence from group ranks {list(reporting)}: no capture, and the current "
                "cycle cannot certify anything")
    return f"accepted ({verdict})"


def plan_boundary(state: TrustState, event: BoundaryEvent) -> Tuple[TrustState, Boundary]:
    """Apply the certification rules to an agreed boundary: the new state (SDC latch, cycle
    counters, last step) and the durable plan (quarantine, commit, save)."""
    verdicts, flags, step = event.verdicts, event.cycle_flags, event.step
    reporting = tuple(r for r, v in enumerate(verdicts) if v not in ACCEPTED)
    sdc_ranks = tuple(r for r, v in enumerate(verdicts) if v == "sdc")
    verdict = worst(*verdicts)
    latched = state.sdc_pending
    accepted = verdict in ACCEPTED and not latched and not event.nonfinite_ranks
    capture = accepted or (verdict in CAPTURED_UNCERTIFIED and not latched and not event.nonfinite_ranks)
    reason = _reason(state, event, verdict, sdc_ranks, reporting)
    cycle_end = any(flags)
    seen = state.cycle_seen + 1
    tainted = state.cycle_tainted or not accepted or len(set(flags)) > 1
    complete = all(flags) and seen == state.catalog_size and "incomplete" not in verdicts
    certified = complete and not tainted

    plan = Plan()
    if sdc_ranks:
        state = dataclasses.replace(state, sdc_step=step, sdc_pending=True)
        if state.candidate is not None:
            plan = Plan(quarantine=(state.candidate[0], state.candidate[1],
                                    f"SDC detected at step {step} (reported by group ranks {list(sdc_ranks)})"))
    elif cycle_end and not latched:
        if certified and state.immediate:
            plan = Plan(save=step, verify_new=True)
        elif certified:
            plan = Plan(commit=state.candidate, save=step)
        elif tainted and state.candidate is not None and not state.immediate:
            plan = Plan(quarantine=(state.candidate[0], state.candidate[1],
                                    f"not certified: the cycle ending at step {step} was not a complete accepted "
                                    "cycle (inconclusive or incomplete SCOUT evidence)"))
            reason += "; the pending candidate is retired uncertified"
        elif not complete:
            reason += "; the cycle was not seen complete (joined midway), nothing certified"
    if cycle_end:
        seen, tainted = 0, False
    state = dataclasses.replace(state, cycle_seen=seen, cycle_tainted=tainted, last_step=step)
    return state, Boundary(step=step, verdict=verdict, capture=capture, complete=complete,
                           reporting_ranks=reporting, sdc_ranks=sdc_ranks, nonfinite_ranks=event.nonfinite_ranks,
                           reason=reason, plan=plan)


def settle_boundary(state: TrustState, boundary: Boundary,
                    outcome: Dict[str, Any]) -> Tuple[TrustState, BoundaryDecision]:
    """Apply rank 0's durable `outcome` of `boundary.plan` (as `publish.run_plan` returns it, or
    `Plan.outcome_without_durable`): the final state and the boundary's decision."""
    plan, step, reason = boundary.plan, boundary.step, boundary.reason
    candidate, history = state.candidate, state.history
    trust_state, verified_step, rejected_step, checkpoint_id = None, None, None, None
    if plan.quarantine is not None:
        candidate, rejected_step = None, plan.quarantine[0]
    if outcome["invalidated_id"] is not None:
        history = tuple(h for h in history if h[1] != outcome["invalidated_id"])
    if plan.commit is not None:
        candidate = None
        if outcome["committed"]:
            history = _with_verified(history, plan.commit)
            verified_step = plan.commit[0]
            reason += f"; candidate step {verified_step} promoted to RECOVERY_VERIFIED"
    if plan.save is not None and outcome["saved"]:
        checkpoint_id = outcome["saved_id"]
        if plan.verify_new:
            if outcome["verified_new"]:
                history = _with_verified(history, (step, checkpoint_id))
                trust_state, verified_step = RECOVERY_VERIFIED, step
                reason += "; dense catalog: RECOVERY_VERIFIED at once"
        else:
            candidate = (step, checkpoint_id)
            trust_state = CANDIDATE
            reason += "; this boundary is the new CANDIDATE"
    state = dataclasses.replace(state, candidate=candidate, history=history)
    decision = BoundaryDecision(
        step=step, verdict=boundary.verdict, capture=boundary.capture, cycle_complete=boundary.complete,
        state=trust_state, verified_step=verified_step, candidate_step=state.candidate_step,
        rejected_step=rejected_step, sdc_detected=bool(boundary.sdc_ranks),
        requires_verified_recovery=state.sdc_pending, reporting_ranks=boundary.reporting_ranks,
        checkpoint_id=checkpoint_id, reason=reason, nonfinite_ranks=boundary.nonfinite_ranks)
    return state, decision
