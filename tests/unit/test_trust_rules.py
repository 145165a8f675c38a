"""The certification ledger's pure rules (lm_resiliency/trust/rules.py): state + event -> state,
driven with the views `CertificationLedger.boundary` gathers, without files or process groups."""

import pytest

from lm_resiliency.recovery import RecoveryMode
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, StragglerFinding
from lm_resiliency.trust import CANDIDATE, PRECEDENCE, RECOVERY_VERIFIED, CertificationError, verdict_of, worst
from lm_resiliency.trust import rules
from lm_resiliency.trust.handoff import recovery_decision


def views(state, step, verdicts, flags=None, finite=None, cycles=None):
    """Every rank's boundary view, as the ledger gathers it (rank r holds verdicts[r])."""
    n = len(verdicts)
    flags = flags or [True] * n
    finite = finite or [True] * n
    cycles = cycles or [[state.cycle_seen, state.cycle_tainted]] * n
    return [{"error": None, "step": step, "verdict": v, "cycle_complete": f, "finite": ok,
             "catalog_size": state.catalog_size, "trust": state.to_doc(), "cycle": list(c)}
            for v, f, ok, c in zip(verdicts, flags, finite, cycles)]


def boundary(state, step, verdicts, **kw):
    """One boundary without a durable store: (state, decision)."""
    state, event = rules.agreed(state, views(state, step, verdicts, **kw))
    state, planned = rules.plan_boundary(state, event)
    return rules.settle_boundary(state, planned, planned.plan.outcome_without_durable())


def test_two_cycle_protocol_promotes_the_candidate_after_the_following_clean_cycle():
    state = rules.TrustState(catalog_size=2)
    decisions = []
    for step in (10, 20, 30, 40):
        state, d = boundary(state, step, ["clean"] * 3, flags=[step % 20 == 0] * 3)
        decisions.append(d)
    assert [d.state for d in decisions] == [None, CANDIDATE, None, CANDIDATE]
    assert [d.verified_step for d in decisions] == [None, None, None, 20]
    assert state.candidate == (40, None) and state.verified_steps() == [20]
    assert all(d.capture for d in decisions)



def test_a_dynamic_catalog_of_one_recipe_still_goes_through_candidate():
    """The GEMINI guide: only dense replay (K = 1) certifies at once; a MoE catalog that
    compresses to one recipe uses the two-cycle candidate protocol."""
    dense = rules.TrustState(catalog_size=1)
    dense, d = boundary(dense, 4, ["clean"] * 3)
    assert d.state == RECOVERY_VERIFIED and dense.verified_steps() == [4]
    moe = rules.TrustState(catalog_size=1, dynamic=True)
    moe, first = boundary(moe, 4, ["clean"] * 3)
    moe, second = boundary(moe, 8, ["clean"] * 3)
    assert (first.state, second.state) == (CANDIDATE, CANDIDATE)
    assert moe.verified_steps() == [4] and moe.candidate == (8, None)

def test_sdc_latches_verified_only_recovery_and_quarantines_the_candidate():
    state = rules.TrustState(catalog_size=1)
    state, first = boundary(state, 5, ["clean", "clean", "clean"])
    assert first.state == RECOVERY_VERIFIED and state.verified_steps() == [5]
    state = rules.TrustState(catalog_size=2, candidate=(8, "ck-8"), history=state.history, last_step=8)
    state, event = rules.agreed(state, views(state, 10, ["clean", "sdc", "straggler"], flags=[False] * 3))
    state, planned = rules.plan_boundary(state, event)
    assert planned.plan.quarantine[:2] == (8, "ck-8") and planned.plan.save is None
    state, sdc = rules.settle_boundary(state, planned, planned.plan.outcome_without_durable())
    assert (sdc.verdict, sdc.capture, sdc.rejected_step, sdc.reporting_ranks) == ("sdc", False, 8, (1,))
    assert state.sdc_pending and state.sdc_step == 10 and state.candidate is None
    state, later = boundary(state, 12, ["clean"] * 3, flags=[True] * 3)
    assert not later.capture and later.requires_verified_recovery
    with pytest.raises(CertificationError, match=r"resume_from\(12\): SDC was detected at step 10"):
        rules.resumed_from(state, 12)
    state = rules.resumed_from(state, 5)
    assert not state.sdc_pending and state.last_step == 5


def test_agreement_refuses_misaligned_ranks_and_taints_differing_cycles():
    state = rules.TrustState(catalog_size=2)
    seen = views(state, 4, ["clean", "clean"])
    seen[1]["step"] = 6
    with pytest.raises(CertificationError, match=r"ranks are at different steps \[4, 6\]"):
        rules.agreed(state, seen)
    seen = views(state, 4, ["clean", "clean"])
    seen[0]["error"] = "step must be a non-negative integer, got -1"
    with pytest.raises(CertificationError, match="rank 0: step must be a non-negative integer"):
        rules.agreed(state, seen)
    merged, _ = rules.agreed(state, views(state, 4, ["clean", "clean"], cycles=[[1, False], [0, False]]))
    assert (merged.cycle_seen, merged.cycle_tainted) == (1, True)


def test_nonfinite_state_is_not_captured_and_a_rollback_drops_newer_trust():
    state = rules.TrustState(catalog_size=1, history=((30, None), (20, None)), last_step=30)
    state, d = boundary(state, 25, ["clean", "clean"], finite=[True, False])
    assert (d.capture, d.nonfinite_ranks, d.state) == (False, (1,), None)
    assert state.verified_steps() == [20] and state.last_step == 25


def test_persisted_trust_round_trips_and_a_foreign_record_is_refused():
    state = rules.TrustState(catalog_size=2, candidate=(40, "c"), history=((20, "b"), (10, None)),
                             sdc_step=15, last_step=40, cycle_seen=1)
    loaded, changed = rules.loaded(rules.TrustState(catalog_size=2), state.to_doc())
    assert loaded == rules.TrustState(catalog_size=2, candidate=(40, "c"), history=((20, "b"), (10, None)),
                                      sdc_step=15, last_step=40) and not changed
    other, changed = rules.loaded(rules.TrustState(catalog_size=3), state.to_doc())
    assert other.candidate is None and other.verified_steps() == [20, 10] and changed
    doc = dict(state.to_doc(), recovery_verified_step=10)
    with pytest.raises(CertificationError, match="recovery_verified_step 10 is not the newest verified_history"):
        rules.loaded(rules.TrustState(catalog_size=2), doc)


def test_one_verdict_order_for_results_and_ranks():
    assert PRECEDENCE == ("sdc", "inconclusive", "incomplete", "error", "straggler", "clean")
    assert worst("clean", "straggler", "error") == "error"
    assert worst("incomplete", "sdc") == "sdc"
    with pytest.raises(ValueError, match="worst: verdicts must be one or more of"):
        worst("fine")
    slow = StragglerFinding("compute", (1,), ("h1",), 3.0, True, 0.9)
    assert verdict_of(ReplayResult(step=1, stragglers=(slow,))) == "straggler"
    assert verdict_of(ReplayResult(step=1, checks=(CheckOutcome("hidden", "l1", (0, 1), {}, "error"),))) == "error"
    assert verdict_of(None) == "incomplete"


def test_recovery_decision_appends_the_lookup_problem_and_names_this_rank():
    d = recovery_decision("sdc", RecoveryMode.RECOVERY_VERIFIED, "silent data corruption was detected",
                          step=None, source=None, topology="t", problem="no recovery_verified checkpoint")
    assert d.to_json() == {"failure": "sdc", "mode": "recovery_verified", "source": None, "step": None,
                           "durable_checkpoint_id": None, "topology": "t", "available": False,
                           "reason": "silent data corruption was detected; no recovery_verified checkpoint",
                           "ranks": [0]}
