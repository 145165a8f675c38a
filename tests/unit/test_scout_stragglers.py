import json
import random

import pytest

from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.probes import default_probe_groups, time_compute
from lm_resiliency.scout.reports import ReplayResult, replay_fault_reports
from lm_resiliency.scout.stragglers import (
    CommunicationStragglerLocalizer,
    ComputeStragglerDetector,
    faster_half_median,
)

HOSTS = {r: f"node-{r // 2}" for r in range(8)}


def config(rounds=2, **kw):
    return ReplayHarnessConfig(straggler_confirmation_rounds=rounds, **kw)


# ---------------------------------------------------------------- compute


def test_three_times_slower_rank_confirmed_after_required_rounds_not_before():
    det = ComputeStragglerDetector(config(rounds=3), range(4), HOSTS)
    healthy = {0: 0.100, 1: 0.102, 2: 0.099, 3: 0.101}
    for _ in range(5):
        assert det.observe(healthy) == []
    slow = {**healthy, 2: 0.300}
    first = det.observe(slow)
    second = det.observe(slow)
    assert [f.ranks for f in first] == [(2,)] and not first[0].confirmed
    assert [f.ranks for f in second] == [(2,)] and not second[0].confirmed
    third = det.observe(slow)
    assert len(third) == 1
    finding = third[0]
    assert finding.confirmed and finding.kind == "compute"
    assert finding.ranks == (2,) and finding.hosts == ("node-1",)
    assert finding.slowdown == pytest.approx(0.300 / 0.1015)  # median of 0.100, 0.101, 0.102, 0.300
    assert first[0].confidence < second[0].confidence < finding.confidence <= 1.0
    ev = finding.evidence
    assert ev["rounds"] == 3 and ev["required_rounds"] == 3
    assert ev["current_s"] == 0.300 and ev["baseline_s"] == pytest.approx(0.099)
    assert ev["onset"] == "became_slow"
    json.dumps(ev)  # JSON-ready

    reports = replay_fault_reports(ReplayResult(step=7, stragglers=tuple(third)))
    assert [(r.kind, r.scope, r.ranks, r.hosts) for r in reports] == [("compute_straggler", "rank", (2,), ("node-1",))]
    json.dumps(reports[0].to_json())


def test_confidence_grows_with_slowdown():
    def confirmed(slow_s):
        det = ComputeStragglerDetector(config(), range(4))
        out = []
        for _ in range(2):
            out = det.observe({0: 0.1, 1: 0.1, 2: slow_s, 3: 0.1})
        return out[0]

    assert confirmed(0.2).confidence < confirmed(0.4).confidence


def test_streak_breaks_when_rank_recovers():
    det = ComputeStragglerDetector(config(rounds=2), range(4))
    slow, healthy = {0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1}, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}
    for _ in range(5):
        assert not any(f.confirmed for f in det.observe(slow) + det.observe(healthy))
    assert det.observe(slow)[0].confirmed is False
    assert det.observe(slow)[0].confirmed is True


def test_always_slow_rank_is_told_apart_from_one_that_became_slow():
    det = ComputeStragglerDetector(config(), range(4))
    for _ in range(2):
        findings = det.observe({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.35})
    assert findings[0].confirmed and findings[0].evidence["onset"] == "always_slow"
    assert findings[0].evidence["baseline_s"] is None and det.baseline(3) is None
    assert det.baseline(0) == pytest.approx(0.1)


def test_jittery_healthy_group_never_confirms():
    rng = random.Random(1234)
    det = ComputeStragglerDetector(config(), range(8))
    for _ in range(50):
        findings = det.observe({r: 0.1 * rng.uniform(0.8, 1.2) for r in range(8)})
        assert not any(f.confirmed for f in findings)


def test_flat_identical_timings_produce_nothing():
    det = ComputeStragglerDetector(config(rounds=1), range(4))
    for _ in range(10):
        assert det.observe({r: 0.05 for r in range(4)}) == []
    det = ComputeStragglerDetector(config(rounds=1), range(4))
    assert det.observe({r: 0.0 for r in range(4)}) == []


def test_flat_group_with_one_slow_rank_uses_the_scale_floor():
    # MAD is 0 here; the floor keeps the robust test meaningful and the slow rank is found.
    det = ComputeStragglerDetector(config(rounds=1), range(4))
    (finding,) = det.observe({0: 0.05, 1: 0.05, 2: 0.05, 3: 0.2})
    assert finding.confirmed and finding.ranks == (3,) and finding.evidence["group_mad_s"] == 0


def test_ratio_and_margin_are_both_required():
    # 2x slower but only 1 ms above the median: below the default 5 ms margin.
    det = ComputeStragglerDetector(config(rounds=1), range(4))
    assert det.observe({0: 0.001, 1: 0.001, 2: 0.001, 3: 0.002}) == []
    # 40 ms above the median but only 1.1x slower: below the 1.5 ratio.
    det = ComputeStragglerDetector(config(rounds=1), range(4))
    assert det.observe({0: 0.4, 1: 0.4, 2: 0.4, 3: 0.44}) == []


def test_small_rounds_are_not_judged_and_break_streaks():
    det = ComputeStragglerDetector(config(rounds=2), range(4))
    assert len(det.observe({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.4})) == 1
    assert det.observe({0: 0.1, 3: 0.4}) == []
    assert det.streak(3) == 0
    assert det.observe({0: 0.1, 1: 0.1, 2: 0.1, 3: 0.4})[0].confirmed is False


def test_compute_detector_rejects_bad_input():
    det = ComputeStragglerDetector(config(), range(4))
    with pytest.raises(ValueError, match="not in this group"):
        det.observe({0: 0.1, 9: 0.1, 1: 0.1})
    with pytest.raises(ValueError, match="finite"):
        det.observe({0: 0.1, 1: float("nan"), 2: 0.1})
    with pytest.raises(ValueError, match="finite"):
        det.observe({0: 0.1, 1: -1.0, 2: 0.1})
    with pytest.raises(ValueError, match="distinct"):
        ComputeStragglerDetector(config(), [0, 0, 1])
    with pytest.raises(TypeError):
        ComputeStragglerDetector({"straggler_min_ratio": 2}, range(4))


# ---------------------------------------------------------------- communication

PAIRS4 = [tuple(g) for g in default_probe_groups(4)]


def pair_latencies(slow_rank=None, fast=0.001, slow=0.031, jitter=None):
    out = {}
    for g in PAIRS4:
        base = slow if slow_rank in g else fast
        out[g] = base * (jitter.uniform(0.8, 1.2) if jitter else 1.0)
    return out


def test_cross_pg_intersection_names_the_shared_rank_with_evidence():
    loc = CommunicationStragglerLocalizer(config(rounds=2), HOSTS)
    (first,) = loc.observe(pair_latencies(slow_rank=1))
    assert first.ranks == (1,) and not first.confirmed
    (finding,) = loc.observe(pair_latencies(slow_rank=1))
    assert finding.confirmed and finding.kind == "communication"
    assert finding.ranks == (1,) and finding.hosts == ("node-0",)
    ev = finding.evidence
    assert ev["localized"] and ev["endpoint_rank"] == 1 and ev["endpoint_host"] == "node-0"
    assert sorted(tuple(g["ranks"]) for g in ev["supporting_groups"]) == [(0, 1), (1, 2), (1, 3)]
    assert ev["contradicting_groups"] == []
    assert finding.slowdown == pytest.approx(31.0)
    assert finding.confidence > first.confidence
    reports = replay_fault_reports(ReplayResult(step=3, stragglers=(finding,)))
    assert [(r.kind, r.scope, r.ranks, r.hosts) for r in reports] == [
        ("communication_straggler", "node", (1,), ("node-0",))]
    json.dumps(reports[0].to_json())


def test_grid_groups_localize_by_row_and_column():
    groups = [tuple(g) for g in default_probe_groups(16)]
    loc = CommunicationStragglerLocalizer(config(rounds=1))
    (finding,) = loc.observe({g: (0.05 if 6 in g else 0.002) for g in groups})
    assert finding.confirmed and finding.ranks == (6,)
    assert len(finding.evidence["supporting_groups"]) == 2


def test_ranks_seen_in_fast_groups_are_dropped_when_that_disambiguates():
    # 13 ranks on a 4-wide grid: rank 12 is alone in its row, so only its column {0,4,8,12} is
    # slow; 0, 4 and 8 also sit in fast rows, which leaves rank 12.
    groups = [tuple(g) for g in default_probe_groups(13)]
    loc = CommunicationStragglerLocalizer(config(rounds=1))
    (finding,) = loc.observe({g: (0.05 if 12 in g else 0.002) for g in groups})
    assert finding.confirmed and finding.ranks == (12,)
    assert finding.evidence["intersection"] == [0, 4, 8, 12]


def test_contradicting_groups_lower_confidence_and_are_reported():
    loc = CommunicationStragglerLocalizer(config(rounds=1), HOSTS)
    timings = pair_latencies(slow_rank=1)
    timings[(1, 3)] = 0.001   # one of rank 1's groups looked fast this round
    (finding,) = loc.observe(timings)
    assert finding.confirmed and finding.ranks == (1,)
    assert [g["ranks"] for g in finding.evidence["contradicting_groups"]] == [[1, 3]]
    assert len(finding.evidence["supporting_groups"]) == 2
    clean = CommunicationStragglerLocalizer(config(rounds=1)).observe(pair_latencies(slow_rank=1))[0]
    assert finding.confidence < clean.confidence


def test_one_slow_pair_is_ambiguous_never_confirmed():
    # 2x2 grid: only {0, 1} is slow; both ranks also sit in fast groups: a link, not a rank.
    grid = {(0, 1): 0.05, (2, 3): 0.001, (0, 2): 0.001, (1, 3): 0.001}
    loc = CommunicationStragglerLocalizer(config(rounds=1), HOSTS)
    for _ in range(5):
        (finding,) = loc.observe(grid)
        assert not finding.confirmed and finding.ranks == (0, 1) and finding.confidence == 0.0
        assert finding.evidence["localized"] is False and finding.evidence["reason"] == "several_candidates"
    assert replay_fault_reports(ReplayResult(step=1, stragglers=(finding,))) == []
    # All pairs: a single slow pair is contradicted by each end's other (fast) groups.
    pairs = {g: (0.05 if g == (0, 1) else 0.001) for g in PAIRS4}
    findings = CommunicationStragglerLocalizer(config(rounds=1)).observe(pairs)
    assert not any(f.confirmed for f in findings)
    # A 2-rank world has one group: nothing to intersect with.
    assert CommunicationStragglerLocalizer(config(rounds=1)).observe({(0, 1): 0.5}) == []


def test_slow_groups_without_a_shared_rank_are_ambiguous():
    groups = {(0, 1): 0.05, (2, 3): 0.05, (4, 5): 0.001, (6, 7): 0.001, (0, 4): 0.001, (2, 6): 0.001}
    (finding,) = CommunicationStragglerLocalizer(config(rounds=1)).observe(groups)
    assert not finding.confirmed and finding.evidence["reason"] == "empty_intersection"


def test_healthy_jittery_groups_never_confirm():
    rng = random.Random(7)
    loc = CommunicationStragglerLocalizer(config(rounds=2))
    for _ in range(50):
        assert not any(f.confirmed for f in loc.observe(pair_latencies(jitter=rng)))


def test_localizer_rejects_bad_groups():
    loc = CommunicationStragglerLocalizer(config())
    with pytest.raises(ValueError, match="distinct"):
        loc.observe({(0,): 0.1, (0, 1): 0.1})
    with pytest.raises(ValueError, match="twice"):
        loc.observe({(0, 1): 0.1, (1, 0): 0.2, (1, 2): 0.1})
    with pytest.raises(ValueError, match="finite"):
        loc.observe({(0, 1): float("inf"), (1, 2): 0.1})


def test_faster_half_median_survives_half_slow():
    assert faster_half_median([1, 1, 1, 9, 9, 9]) == 1
    assert faster_half_median([1, 2, 3, 4]) == 1.5


# ---------------------------------------------------------------- probe helpers (no processes)


def test_default_probe_groups():
    assert default_probe_groups(1) == []
    assert default_probe_groups(2) == [[0, 1]]
    assert default_probe_groups(4) == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]
    for world in (9, 10, 13, 16, 64):
        groups = default_probe_groups(world)
        assert all(len(g) >= 2 for g in groups)
        assert set().union(*map(set, groups)) == set(range(world))
        # every rank is singled out: intersect its groups, drop ranks seen in other groups
        for rank in range(world):
            mine = [set(g) for g in groups if rank in g]
            others = set().union(*(set(g) for g in groups if rank not in g))
            common = set.intersection(*mine)
            assert common == {rank} or common - others == {rank}
    with pytest.raises(ValueError):
        default_probe_groups(0)


def test_time_compute_measures_and_validates():
    import time

    assert 0.009 < time_compute(lambda: time.sleep(0.01), repeat=3) < 0.5
    calls = []
    time_compute(lambda: None, synchronize=lambda: calls.append(1))
    assert calls == [1, 1]
    with pytest.raises(ValueError):
        time_compute(lambda: None, repeat=0)


# ---------------------------------------------------------------- probe cadence


def test_probe_cadence_defaults_to_every_fifth_check_and_is_validated():
    from lm_resiliency.config import ConfigError
    from lm_resiliency.scout.config import PROBE_EVERY_CHECKS

    assert PROBE_EVERY_CHECKS == 5
    assert ReplayHarnessConfig().probe_interval == 50
    assert ReplayHarnessConfig(check_interval=3).probe_interval == 15
    assert ReplayHarnessConfig(check_interval=3, communication_probe_interval=1).probe_interval == 1
    # 0 turns the probe off, like every check class (docs/scout.md, "Switching replay off").
    assert ReplayHarnessConfig(communication_probe_interval=0).probe_interval == 0
    assert ReplayHarnessConfig(check_interval=0).probe_interval == 0
    for bad in (-2, 1.5, True, "10", 10**9 + 1):
        with pytest.raises(ConfigError, match="ReplayHarnessConfig.communication_probe_interval"):
            ReplayHarnessConfig(communication_probe_interval=bad)


def test_an_unconfirmed_suspicion_of_a_healthy_rank_says_what_it_is_and_nothing_acts_on_it():
    """The contract (docs/scout.md, "What a straggler finding says"): one noisy round may name a
    healthy rank, unconfirmed, with its measure and its rounds; it makes nothing unhealthy and
    confirms nothing unless the same measure flags the rank again in the next round."""
    from lm_resiliency.trust.verdicts import verdict_of

    healthy = {0: 0.100, 1: 0.102, 2: 0.099, 3: 0.101}
    replay = ComputeStragglerDetector(config(), range(4), HOSTS)
    work = ComputeStragglerDetector(config(), range(4), HOSTS, measure="rank_step_work")
    noisy = replay.observe({**healthy, 0: 0.400})   # rank 0's replay was timed while its host was busy
    assert [(f.ranks, f.confirmed, f.evidence["rounds"], f.evidence["required_rounds"], f.evidence["measure"])
            for f in noisy] == [((0,), False, 1, 2, "replay_compute")]
    result = ReplayResult(8, (), tuple(noisy))
    assert result.healthy and replay_fault_reports(result) == [] and verdict_of(result) == "clean"
    assert work.observe({**healthy, 0: 0.400})[0].confirmed is False   # another measure: its own streak
    assert replay.observe(healthy) == [] and replay.streak(0) == 0      # healthy again: forgotten
    again = replay.observe({**healthy, 0: 0.400})
    assert again[0].confirmed is False and again[0].evidence["rounds"] == 1
    probe = CommunicationStragglerLocalizer(config(), HOSTS)
    ambiguous = probe.observe({(0, 1): 0.5, (2, 3): 0.01, (0, 2): 0.01, (1, 3): 0.01})
    assert [(f.confirmed, f.evidence["rounds"], f.evidence["measure"]) for f in ambiguous] == \
        [(False, 0, "collective_probe")]
    with pytest.raises(ValueError, match="measure"):
        ComputeStragglerDetector(config(), range(4), measure="")
