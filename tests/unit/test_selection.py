"""Recovery-step selection: a pure function of every rank's availability report."""

import json

import pytest

from lm_resiliency.gemini.selection import RecoveryPlan, availability_report, choose_plan, missing_owners


def reports(own, held=None, memory=None, hosts=None):
    """Availability reports as they travel between ranks (through JSON). `memory`: the part of each
    rank's (own, held) it holds in memory (default: everything); `hosts`: each rank's host key."""
    held = held or [{} for _ in own]
    made = []
    for rank, (o, h) in enumerate(zip(own, held)):
        report = availability_report(o, h)
        if memory is not None:
            report["memory"] = availability_report(*memory[rank])
        if hosts is not None:
            report["host"] = hosts[rank]
        made.append(json.loads(json.dumps(report)))
    return made


def test_availability_report_is_sorted_deduplicated_and_json_shaped():
    report = availability_report([30, 10, 20, 10], {3: [5, 4, 5], 0: []})
    assert report == {"own": [10, 20, 30], "held": {"3": [4, 5], "0": []}}
    assert json.loads(json.dumps(report)) == report


def test_newest_common_step_is_chosen_from_own_copies():
    plan = choose_plan(reports([[10, 20, 30], [20, 30], [10, 20, 30], [30, 20]]))
    assert plan == RecoveryPlan(30, {0: 0, 1: 1, 2: 2, 3: 3})
    assert plan.transfers() == []


def test_step_present_on_only_part_of_the_job_is_never_chosen():
    # Rank 2 never captured step 40; older step 30 is common.
    plan = choose_plan(reports([[30, 40], [30, 40], [30], [30, 40]]))
    assert plan.step == 30
    # No replica of rank 2 at 40 either: still not eligible, even with replication.
    held = [{3: [30, 40]}, {0: [30, 40]}, {1: [30, 40]}, {2: [30]}]
    assert choose_plan(reports([[30, 40], [30, 40], [30], [30, 40]], held)).step == 30


def test_missing_own_copy_is_planned_from_the_holder():
    # Rank 1 lost its memory (e.g. replaced node); its replica lives on rank 3.
    own = [[10, 20], [], [10, 20], [10, 20]]
    held = [{2: [10, 20]}, {}, {0: [10, 20]}, {1: [10, 20]}]
    plan = choose_plan(reports(own, held))
    assert plan == RecoveryPlan(20, {0: 0, 1: 3, 2: 2, 3: 3})
    assert plan.transfers() == [(3, 1)]


def test_a_copy_on_any_rank_counts_whatever_rank_wrote_it():
    # Ranks moved between hosts: rank 2 now runs where rank 1 ran and found rank 1's own slots
    # there; rank 0 found rank 3's replica of rank 1. Step 20 of rank 1 is at rank 2.
    own = [[10, 20], [10], [10, 20], [10, 20]]
    held = [{}, {}, {1: [20]}, {1: [10]}]
    plan = choose_plan(reports(own, held))
    assert plan == RecoveryPlan(20, {0: 0, 1: 2, 2: 2, 3: 3})
    assert plan.transfers() == [(2, 1)]


def test_no_copy_anywhere_gives_none_and_names_the_missing_owners():
    own = [[10, 20], [], [10, 20], [10, 20]]
    held = [{2: [10]}, {}, {0: [10, 20]}, {3: [20]}]
    assert choose_plan(reports(own, held), exact_step=20) is None
    assert missing_owners(reports(own, held), 20) == [1]
    assert choose_plan(reports(own, held)) is None  # nobody has rank 1 at 10 either
    assert missing_owners(reports(own, held), 10) == [1]


def test_own_copy_is_preferred_over_the_replica():
    own = [[5], [5]]
    held = [{1: [5]}, {0: [5]}]
    plan = choose_plan(reports(own, held))
    assert plan.sources == {0: 0, 1: 1}
    assert plan.transfers() == []


def test_provider_order_memory_same_host_other_host_then_disk():
    # Rank 0 has nothing; copies of its step 5: rank 3 (another host) in memory, rank 1 (its host)
    # on disk, rank 2 (another host) on disk.
    own, held = [[], [5], [5], [5]], [{}, {0: [5]}, {0: [5]}, {0: [5]}]
    memory = [([], {}), ([5], {}), ([5], {}), ([5], {0: [5]})]
    hosts = ["a", "a", "b", "c"]
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 3
    memory[2] = ([5], {0: [5]})  # rank 2 also in memory: the lower rank of equals
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 2
    memory[1] = ([5], {0: [5]})  # rank 1, on rank 0's host, in memory
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 1
    # Only disks: its own disk first, then one on its host, then another host's.
    own[0], memory = [5], [([], {}), ([5], {}), ([5], {}), ([5], {})]
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 0
    own[0] = []
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 1
    hosts = ["a", "d", "b", "c"]
    assert choose_plan(reports(own, held, memory, hosts)).sources[0] == 1  # lowest rank among other hosts' disks


def test_newest_step_mixing_own_and_replica_beats_older_all_own_step():
    own = [[10, 20], [10], [10, 20]]
    held = [{2: [20]}, {0: [20]}, {1: [20]}]
    plan = choose_plan(reports(own, held))
    assert plan == RecoveryPlan(20, {0: 0, 1: 2, 2: 2})


def test_exact_step_restricts_the_choice():
    own = [[10, 20, 30], [10, 20, 30]]
    assert choose_plan(reports(own), exact_step=20).step == 20
    assert choose_plan(reports(own), exact_step=25) is None
    assert choose_plan(reports([[10, 20, 30], [10, 30]]), exact_step=20) is None


@pytest.mark.parametrize("own, held", [
    ([[], [], []], None),
    ([[10], [20], [30]], None),
    ([[10], []], [{}, {0: [10]}]),   # a replica of rank 0 does not recover rank 1
])
def test_no_candidate_gives_none(own, held):
    assert choose_plan(reports(own, held)) is None


def test_empty_job_gives_none():
    assert choose_plan([]) is None


def test_transfers_are_holder_owner_pairs_in_global_order():
    plan = RecoveryPlan(7, {0: 3, 1: 1, 2: 0, 3: 3, 4: 0, 5: 2})
    assert plan.transfers() == [(0, 2), (0, 4), (2, 5), (3, 0)]


def test_every_rank_computes_the_same_plan_regardless_of_report_origin():
    world, jump = 8, 4
    own = [[1, 2, 3] if r % 3 else [1, 2] for r in range(world)]
    held = [{(r - jump) % world: [1, 2, 3]} for r in range(world)]
    first = choose_plan(reports(own, held))
    assert first.step == 3
    assert all(choose_plan(reports(own, held)) == first for _ in range(world))
    assert first.transfers() == sorted(((r + jump) % world, r) for r in range(world) if r % 3 == 0)
