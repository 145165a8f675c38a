"""Recovery-step selection: a pure function of every rank's availability report."""

import json

import pytest

from lm_resiliency.gemini.selection import RecoveryPlan, availability_report, choose_plan


def ring(world, jump=1):
    """The replication holder map: owner's replica lives `jump` ranks ahead."""
    return lambda owner: (owner + jump) % world


def reports(own, held=None):
    """Availability reports as they travel between ranks (through JSON)."""
    held = held or [{} for _ in own]
    return [json.loads(json.dumps(availability_report(o, h))) for o, h in zip(own, held)]


def test_availability_report_is_sorted_deduplicated_and_json_shaped():
    report = availability_report([30, 10, 20, 10], {3: [5, 4, 5], 0: []})
    assert report == {"own": [10, 20, 30], "held": {"3": [4, 5], "0": []}}
    assert json.loads(json.dumps(report)) == report


def test_newest_common_step_is_chosen_from_own_copies():
    plan = choose_plan(reports([[10, 20, 30], [20, 30], [10, 20, 30], [30, 20]]), None)
    assert plan == RecoveryPlan(30, {0: 0, 1: 1, 2: 2, 3: 3})
    assert plan.transfers() == []


def test_step_present_on_only_part_of_the_job_is_never_chosen():
    # Rank 2 never captured step 40; older step 30 is common.
    plan = choose_plan(reports([[30, 40], [30, 40], [30], [30, 40]]), ring(4))
    assert plan.step == 30
    # No replica of rank 2 at 40 either: still not eligible, even with replication.
    held = [{3: [30, 40]}, {0: [30, 40]}, {1: [30, 40]}, {2: [30]}]
    assert choose_plan(reports([[30, 40], [30, 40], [30], [30, 40]], held), ring(4)).step == 30


def test_missing_own_copy_is_planned_from_the_holder():
    world, jump = 4, 2
    holder_of = ring(world, jump)
    # Rank 1 lost its memory (e.g. replaced node); its replica lives on rank 3.
    own = [[10, 20], [], [10, 20], [10, 20]]
    held = [{2: [10, 20]}, {}, {0: [10, 20]}, {1: [10, 20]}]
    plan = choose_plan(reports(own, held), holder_of)
    assert plan == RecoveryPlan(20, {0: 0, 1: 3, 2: 2, 3: 3})
    assert plan.transfers() == [(3, 1)]


def test_without_replication_a_missing_copy_is_not_recovered_from_peers():
    own = [[10, 20], [], [10, 20], [10, 20]]
    held = [{2: [10, 20]}, {}, {0: [10, 20]}, {1: [10, 20]}]
    assert choose_plan(reports(own, held), None) is None


def test_replica_on_a_rank_that_is_not_the_holder_is_ignored():
    # Rank 1's replica of step 20 sits on rank 2, but holder_of(1) == 3.
    own = [[10, 20], [10], [10, 20], [10, 20]]
    held = [{}, {}, {1: [20]}, {1: [10]}]
    plan = choose_plan(reports(own, held), ring(4, 2))
    assert plan == RecoveryPlan(10, {0: 0, 1: 1, 2: 2, 3: 3})


def test_own_copy_is_preferred_over_the_replica():
    own = [[5], [5]]
    held = [{1: [5]}, {0: [5]}]
    plan = choose_plan(reports(own, held), ring(2))
    assert plan.sources == {0: 0, 1: 1}
    assert plan.transfers() == []


def test_newest_step_mixing_own_and_replica_beats_older_all_own_step():
    own = [[10, 20], [10], [10, 20]]
    held = [{2: [20]}, {0: [20]}, {1: [20]}]
    plan = choose_plan(reports(own, held), ring(3))
    assert plan == RecoveryPlan(20, {0: 0, 1: 2, 2: 2})


def test_exact_step_restricts_the_choice():
    own = [[10, 20, 30], [10, 20, 30]]
    assert choose_plan(reports(own), None, exact_step=20).step == 20
    assert choose_plan(reports(own), None, exact_step=25) is None
    assert choose_plan(reports([[10, 20, 30], [10, 30]]), None, exact_step=20) is None


@pytest.mark.parametrize("own, held", [
    ([[], [], []], None),
    ([[10], [20], [30]], None),
    ([[10], []], [{}, {0: [10]}]),   # a replica of rank 0 does not recover rank 1
])
def test_no_candidate_gives_none(own, held):
    assert choose_plan(reports(own, held), ring(len(own))) is None


def test_empty_job_gives_none():
    assert choose_plan([], None) is None


def test_transfers_are_holder_owner_pairs_in_global_order():
    plan = RecoveryPlan(7, {0: 3, 1: 1, 2: 0, 3: 3, 4: 0, 5: 2})
    assert plan.transfers() == [(0, 2), (0, 4), (2, 5), (3, 0)]


def test_every_rank_computes_the_same_plan_regardless_of_report_origin():
    world, jump = 8, 4
    own = [[1, 2, 3] if r % 3 else [1, 2] for r in range(world)]
    held = [{(r - jump) % world: [1, 2, 3]} for r in range(world)]
    first = choose_plan(reports(own, held), ring(world, jump))
    assert first.step == 3
    assert all(choose_plan(reports(own, held), ring(world, jump)) == first for _ in range(world))
    assert first.transfers() == sorted(((r + jump) % world, r) for r in range(world) if r % 3 == 0)
