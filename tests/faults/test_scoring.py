"""evaluate(): attribution, per-occurrence evaluation and campaign metrics, with exact numbers."""

import json

import pytest

from lm_resiliency.faults import (CampaignReport, FaultInjectionRecord, InjectionStatus, LocalizationResult,
                                  evaluate)
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, SCOUTFaultReport, replay_fault_reports


def rec(occ, rank, iteration, wall, ftype="tensor_corruption", status=InjectionStatus.INJECTED):
    incident = occ.split("@")[0]
    return FaultInjectionRecord(occurrence_id=occ, incident_id=incident, fault_id=f"{incident}-{rank}",
                                failure_type=ftype, rank=rank, status=status, tick=iteration, iteration=iteration,
                                wall_time=wall, surface="process", world_size=4)


RECORDS = [
    rec("sdc@10", 1, 10, 100.0),
    rec("slow@20", 2, 20, 200.0, "delay"),
    rec("slow@20", 3, 20, 200.5, "delay"),
    rec("hang@30", 0, 30, 300.0, "hang"),
    rec("net@40", 2, 40, 400.0, "network_partition", InjectionStatus.UNSUPPORTED),
    rec("quiet@50", 1, 50, 500.0, status=InjectionStatus.NO_EFFECT),
    rec("missed@60", 2, 60, 600.0),
]

LOCS = [
    LocalizationResult(ranks=(3,), kind="sdc", iteration=5, detected_at=50.0),                  # false alarm
    LocalizationResult(ranks=(1,), kind="sdc", iteration=12, detected_at=103.0),                # -> sdc@10
    LocalizationResult(ranks=(2,), kind="compute_straggler", iteration=22, detected_at=204.0),  # -> slow@20
    LocalizationResult(ranks=(2, 3), kind="sdc_peer_group", scope="peer_group", iteration=21,
                       detected_at=202.0),                                                      # detects slow@20
    LocalizationResult(ranks=(3, 0), kind="compute_straggler", iteration=25, detected_at=210.0),  # -> slow@20
    LocalizationResult(ranks=(0,), kind="hang", iteration=31, detected_at=330.0),               # -> hang@30
]


def test_campaign_metrics_exact():
    report = evaluate(RECORDS, LOCS, world_size=4)
    assert (report.true_positives, report.false_positives, report.false_negatives, report.true_negatives) == (
        4, 2, 1, 13)
    assert report.precision == pytest.approx(4 / 6)
    assert report.recall == pytest.approx(4 / 5)
    assert report.false_positive_rate == pytest.approx(2 / 15)
    assert (report.injected, report.detected, report.localized_exactly, report.kind_matched,
            report.unattributed_localizations) == (4, 3, 2, 3, 1)
    assert report.time_to_localize_median_s == pytest.approx(16.5)
    assert report.time_to_localize_max_s == pytest.approx(30.0)
    assert report.time_to_localize_median_iterations == 1.5
    assert report.time_to_localize_max_iterations == 2


def test_per_occurrence_evaluations_exact():
    report = evaluate(RECORDS, LOCS, world_size=4)
    sdc, slow, hang = report.evaluation("sdc@10"), report.evaluation("slow@20"), report.evaluation("hang@30")
    assert (sdc.injected, sdc.detected, sdc.localized_exactly, sdc.kind_matches) == (True, True, True, True)
    assert (sdc.latency_iterations, sdc.latency_s, sdc.time_to_localize_s) == (2, 3.0, 3.0)
    assert slow.truth_ranks == (2, 3) and slow.claimed_ranks == (0, 2, 3)
    assert slow.false_positive_ranks == (0,) and slow.missed_ranks == ()
    assert (slow.detected, slow.localized_exactly, slow.kind_matches, slow.localizations) == (True, False, True, 3)
    assert (slow.detected_iteration, slow.latency_iterations, slow.latency_s) == (21, 1, 2.0)
    assert slow.time_to_localize_s is None and slow.failure_types == ("delay",)
    assert (hang.latency_iterations, hang.time_to_localize_s, hang.kind_matches) == (1, 30.0, True)
    net, quiet, missed = report.evaluation("net@40"), report.evaluation("quiet@50"), report.evaluation("missed@60")
    assert (net.injected, net.status) == (False, "unsupported")
    assert (quiet.injected, quiet.status) == (False, "no_effect")
    assert (missed.injected, missed.detected, missed.missed_ranks) == (True, False, (2,))
    assert [e.occurrence_id for e in report.evaluations] == [
        "sdc@10", "slow@20", "hang@30", "net@40", "quiet@50", "missed@60"]


def test_report_json_and_table(tmp_path):
    report = evaluate(RECORDS, LOCS, world_size=4)
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["precision"] == pytest.approx(4 / 6) and len(doc["evaluations"]) == 6
    assert CampaignReport.from_json(doc) == report
    path = tmp_path / "report.json"
    report.write(str(path))
    assert json.loads(path.read_text()) == doc
    table = report.format_table()
    assert "slow@20" in table and "precision=0.667 recall=0.8" in table


def test_pinned_occurrence_window_and_wrong_kind():
    records = [rec("a@10", 1, 10, 100.0)]
    pinned = LocalizationResult(ranks=(1,), kind="hang", occurrence_id="a@10")
    report = evaluate(records, [pinned], world_size=2)
    e = report.evaluation("a@10")
    assert e.localized_exactly and not e.kind_matches and e.latency_iterations is None
    late = LocalizationResult(ranks=(1,), kind="sdc", iteration=20)
    assert evaluate(records, [late], world_size=2, window_iterations=5).unattributed_localizations == 1
    assert evaluate(records, [late], world_size=2, window_iterations=10).precision == 1.0
    # No localizations at all: recall 0, precision and FPR undefined (no positive claims).
    empty = evaluate(records, [], world_size=2)
    assert (empty.recall, empty.precision, empty.false_positive_rate) == (0.0, None, 0.0)
    # World size defaults to what the records say.
    assert evaluate(records).world_size == 4


def test_time_attribution_by_wall_clock_when_iterations_are_unknown():
    records = [rec("a@10", 1, 10, 100.0), rec("b@20", 2, 20, 200.0)]
    loc = LocalizationResult(ranks=(2,), kind="sdc", detected_at=150.0)  # before b: must go to a
    report = evaluate(records, [loc], world_size=4)
    assert report.evaluation("a@10").false_positive_ranks == (2,)
    assert report.evaluation("b@20").detected is False


def test_from_scout_fault_report():
    result = ReplayResult(step=20, checks=(
        CheckOutcome(check="output", module_path="layers.2", group_ranks=(0, 1, 2),
                     signatures={0: "aa", 1: "aa", 2: "bb"},
                     verdict="sdc", faulty=(2,), hosts={2: "node-b"}),
        CheckOutcome(check="hidden", module_path="layers.1", group_ranks=(0, 3), signatures={0: "aa", 3: "cc"},
                     verdict="peer_group"),
    ))
    sdc, peer = [LocalizationResult.from_fault_report(r) for r in replay_fault_reports(result)]
    assert (sdc.ranks, sdc.kind, sdc.scope, sdc.iteration, sdc.hosts, sdc.resource, sdc.source) == (
        (2,), "sdc", "rank", 20, ("node-b",), "output:layers.2", "scout")
    assert sdc.claimed_ranks == {2} and peer.claimed_ranks == frozenset() and peer.kind == "sdc_peer_group"
    assert sdc.evidence["group_ranks"] == (0, 1, 2)
    direct = SCOUTFaultReport(kind="hang", scope="rank", ranks=(3,), step=None, detected_at=12.5)
    loc = LocalizationResult.from_fault_report(direct)
    assert (loc.iteration, loc.detected_at) == (None, 12.5)
    report = evaluate([rec("x@20", 2, 20, 10.0)], [sdc, peer], world_size=4)
    assert report.evaluation("x@20").localized_exactly and report.precision == 1.0


def test_rejects_wrong_inputs():
    with pytest.raises(TypeError, match="from_fault_report"):
        evaluate(RECORDS, [SCOUTFaultReport(kind="sdc", scope="rank", ranks=(1,))])
    with pytest.raises(TypeError, match="records\\[0\\]"):
        evaluate([{"occurrence_id": "x"}], [])
