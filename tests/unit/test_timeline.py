"""Timelines in recovery selection: (step, lineage) entries, never two lineages joined, abandoned
state skipped."""

import json

from lm_resiliency.gemini.selection import RecoveryPlan, availability_report, choose_plan
from lm_resiliency.gemini.timeline import Timeline, abandoned, parse


def reports(own, held=None, timelines=None):
    held = held or [{} for _ in own]
    timelines = timelines or [None for _ in own]
    return [json.loads(json.dumps(availability_report(o, h, t))) for o, h, t in zip(own, held, timelines)]


def test_same_step_on_two_lineages_is_never_joined():
    # Rank 0 holds A's step 40 and rank 1 B's step 40: only their common ancestor step 30 is eligible.
    plan = choose_plan(reports([[(30, "A"), (40, "A")], [(30, "A"), (40, "B")]]))
    assert plan == RecoveryPlan(30, {0: 0, 1: 1}, "A")


def test_unknown_lineage_on_disk_stands_in_for_a_known_one_but_never_joins_two():
    assert choose_plan(reports([[(40, "B")], [40]])) == RecoveryPlan(40, {0: 0, 1: 1}, "B")
    assert choose_plan(reports([[40], [40]])) == RecoveryPlan(40, {0: 0, 1: 1})
    assert choose_plan(reports([[(40, "A")], [(40, "B"), 40]])) == RecoveryPlan(40, {0: 0, 1: 1}, "A")


def test_state_abandoned_by_a_known_timeline_is_skipped():
    # B forked from (A, 30): A's step 40, even if every rank still has it, is abandoned.
    timelines = [{"B": [["A", 30]]}, None]
    plan = choose_plan(reports([[(30, "A"), (40, "A")], [(30, "A"), (40, "A")]], timelines=timelines))
    assert plan == RecoveryPlan(30, {0: 0, 1: 1}, "A")
    assert abandoned("A", 40, [[("A", 30)]]) and not abandoned("A", 30, [[("A", 30)]])


def test_timeline_contains_its_own_steps_and_its_ancestors_up_to_each_fork():
    first = Timeline("A")
    second = first.fork("A", first.ancestry, 30, "B")
    third = second.fork("B", second.ancestry, 50, "C")
    assert third.ancestry == (("B", 50), ("A", 30))
    assert third.contains("C", 70) and third.contains("B", 50) and third.contains("A", 30)
    assert not third.contains("B", 60) and not third.contains("A", 40) and not third.contains(None, 10)
    assert parse({"timeline": third.record()}) == ("C", (("B", 50), ("A", 30)))
    assert parse({}) is None and parse({"timeline": {"lineage": 3, "ancestry": []}}) is None
