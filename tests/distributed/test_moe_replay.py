"""Expert replay and AllToAll replay on a small expert-parallel MoE over real gloo processes
(tests/distributed/moe_workloads.py: tokens dispatched with all_to_all_single, EP x expert-DP)."""

import pytest

from tests.distributed import moe_workloads as W
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(600)


def _checks(result):
    """(step, checks that were not clean) of a rank's unhealthy results. Straggler findings are
    left out where a test is not about timing: 2 shared CPU cores make step times noisy."""
    return [(step, checks) for step, checks, _ in result if checks]


def test_clean_moe_run_reports_nothing():
    # EP=2 x EDP=2, expert replay of both recipes and the AllToAll replay at every check.
    assert [_checks(r) for r in run_ranks(W.clean, 4, 2, timeout=300)] == [[], [], [], []]


def test_expert_fault_two_replicas_names_the_expert_pair():
    # Two expert-DP replicas cannot say which one is right: the pair holding the faulty expert
    # (ranks 1 and 3, EP coordinate 1) is named at every check, the other pair stays clean.
    results = [_checks(r) for r in run_ranks(W.expert_fault, 4, 2, 1, timeout=300)]
    assert results[0] == [] and results[2] == []
    for rank in (1, 3):
        assert results[rank] == [
            (2, [("expert", "moe.experts[n_exec=2]", "peer_group", [], [1, 3])]),
            (4, [("expert", "moe.experts[n_exec=3]", "peer_group", [], [1, 3])]),
        ]


def test_expert_fault_three_replicas_localizes_the_rank():
    # EP=2 x EDP=3: expert peers [1, 3, 5]; a corrupted expert output on rank 3 is named exactly.
    results = [_checks(r) for r in run_ranks(W.expert_fault, 6, 2, 3, timeout=400)]
    for rank in (0, 2, 4):
        assert results[rank] == []
    for rank in (1, 3, 5):
        assert results[rank] == [
            (2, [("expert", "moe.experts[n_exec=2]", "sdc", [3], [1, 3, 5])]),
            (4, [("expert", "moe.experts[n_exec=3]", "sdc", [3], [1, 3, 5])]),
        ]


def _all_to_all_checks(result):
    return [(step, [c for c in checks if c[0] == "all_to_all"]) for step, checks in _checks(result)]


def test_all_to_all_reorder_on_one_rank_is_caught_and_named():
    # Rank 1's all_to_all_single delivers its received rows reversed. Step 2 replays the first
    # call of the step (the 1-D count exchange, which the fault leaves alone), step 4 the token
    # dispatch: several senders' rows arrive wrong at rank 1 only, so the receiver is named.
    results = run_ranks(W.all_to_all_fault, 4, "reorder", 1, timeout=300)
    assert _checks(results[2]) == [] and _checks(results[3]) == []
    for rank in (0, 1):
        assert _all_to_all_checks(results[rank]) == [
            (4, [("all_to_all", "all_to_all_single#1(group=[0, 1])", "sdc", [1], [0, 1])])]


def test_all_to_all_drop_is_caught_by_routing_verification():
    # One row from rank 0 never arrives intact at rank 1: one bad route, the pair is named.
    results = run_ranks(W.all_to_all_fault, 4, "drop", 1, timeout=300)
    assert _checks(results[2]) == [] and _checks(results[3]) == []
    for rank in (0, 1):
        assert _all_to_all_checks(results[rank]) == [
            (4, [("all_to_all", "all_to_all_single#1(group=[0, 1])", "peer_group", [], [0, 1])])]


def test_delayed_all_to_all_on_one_rank_is_named_by_cross_pg():
    # 2-D dispatch: AllToAll groups [0,1], [2,3] (EP) and [0,2], [1,3] (EDP). Rank 1 starts every
    # all_to_all_single 150 ms late: the replayed groups holding it are slow, the others fast,
    # and their intersection names rank 1, confirmed on the second check, on every rank.
    results = run_ranks(W.all_to_all_delay, 4, 1, timeout=300)
    for rank in range(4):
        found = [(step, [s for s in stragglers if s[3] == "all_to_all_replay"]) for step, _, stragglers in results[rank]]
        assert (4, [("communication", [1], True, "all_to_all_replay")]) in found, results[rank]


def test_dynamic_catalog_candidate_then_recovery_verified(tmp_path):
    # K=2 recipes, one per check (steps 2, 4, 6, 8): the first complete clean cycle (step 4)
    # becomes CANDIDATE, the next (step 8) promotes it to RECOVERY_VERIFIED and is the new candidate.
    results = run_ranks(W.certification, 4, str(tmp_path), None, timeout=400)
    expected = [(1, None, None, False), (2, None, None, False), (3, None, None, False), (4, 4, None, False),
                (5, 4, None, False), (6, 4, None, False), (7, 4, None, False), (8, 8, 4, False)]
    assert results == [expected] * 4


def test_sdc_between_cycles_rejects_the_candidate_and_latches_verified_only(tmp_path):
    # Rank 1's expert output is corrupted from step 5 on: the check at step 6 finds SDC on one
    # expert pair, and every rank rejects candidate 4 and requires RECOVERY_VERIFIED recovery.
    results = run_ranks(W.certification, 4, str(tmp_path), 5, timeout=400)
    for trust in results:
        assert trust[3] == (4, 4, None, False)
        assert trust[5][1] is None and trust[5][2] is None and trust[5][3] is True
        assert all(t[2] is None for t in trust)


def test_moe_sdc_quarantines_the_durable_candidate_and_keeps_the_verified_one(tmp_path):
    # Through the durable-checkpoint adapter: step 4 is saved as candidate, step 8 commits it
    # (RECOVERY_VERIFIED) and saves candidate 8; the SDC found at step 10 quarantines candidate 8
    # and the verified manifest stays at step 4.
    import json

    results = run_ranks(W.certification_durable, 4, str(tmp_path), timeout=400)
    for rank, (trust, calls) in enumerate(results):
        assert trust[7] == (8, 8, 4, False), rank
        assert trust[9] == (10, None, 4, True), rank
        assert calls == ([["save", 4], ["commit", "job-ckpt-4"], ["save", 8], ["quarantine", "job-ckpt-8"]]
                         if rank == 0 else []), rank
    with open(tmp_path / "manifests" / "latest_verified.json") as f:
        assert json.load(f)["checkpoint_id"] == "job-ckpt-4"


def test_full_catalog_sweep_covers_every_recipe():
    # prepare_recovery("hang") replays every recipe of the workload on the expert peers, from each
    # peer group's newest recording (step 4). Clean: every entry agrees and LATEST is selected.
    results = run_ranks(W.recovery_sweep, 4, None, timeout=300)
    for mode, reason, voted in results:
        assert mode == "latest", reason
        assert "2 catalog modules replayed" in reason and "every module agreed bitwise" in reason


def test_full_catalog_sweep_finds_expert_sdc_and_selects_verified():
    # Rank 3's expert output is corrupted from step 4 on: the sweep finds it on both recipes (the
    # step-4 check replayed only n_exec=3) for the expert pair [1, 3]; every rank selects
    # RECOVERY_VERIFIED.
    results = run_ranks(W.recovery_sweep, 4, 3, timeout=300)
    for rank, (mode, reason, voted) in enumerate(results):
        assert mode == "recovery_verified", (rank, reason)
    for rank in (1, 3):
        assert results[rank][2] == [("expert", "moe.experts[n_exec=2]", "peer_group", []),
                                    ("expert", "moe.experts[n_exec=3]", "peer_group", [])]
