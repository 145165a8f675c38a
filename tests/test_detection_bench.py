"""The detection campaign's scoring (benchmarks/detection_bench.py): exact-rank hits, false reports."""

from benchmarks.detection_bench import score


def _report(kind, ranks, at_step, detected_at=100.0):
    return {"kind": kind, "ranks": ranks, "at_step": at_step, "detected_at": detected_at}


def test_a_report_naming_exactly_the_faulty_rank_is_a_hit_and_anything_else_is_false():
    results = [{"reports": [_report("sdc", [1], 5)], "hang_at": None},
               {"reports": [_report("sdc", [2], 6), _report("compute_straggler", [3], 8)], "hang_at": None}]
    assert score("non_finite", 1, results) == {"detected": True, "false_reports": 1, "latency": 0.0}


def test_hang_latency_is_seconds_from_the_hang_and_clean_runs_count_every_report():
    results = [{"reports": [_report("hang", [0], 6, detected_at=12.5)], "hang_at": None},
               {"reports": [], "hang_at": 10.0}]
    assert score("hang", 0, results) == {"detected": True, "false_reports": 0, "latency": 2.5}
    assert score("clean", 0, results) == {"detected": False, "false_reports": 1, "latency": None}
