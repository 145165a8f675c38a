"""The detection campaign (benchmarks/detection_bench.py): its cells, its scoring, and one real run
of the harness (4 ranks, DDP, the fault kit) scoring an injected fault and a clean run."""

import pytest

from benchmarks import _detection_cells as dc
from benchmarks._detection_ranks import run_cells
from tests.harness import run_ranks

PLAN = {"8": {"embedding": ["embed", 2], "hidden": ["layers.1", 2], "output": ["norm", 2]}}


def _report(kind, ranks, step, detected_at=100.0, resource="hidden:layers.1"):
    return {"kind": kind, "scope": "rank", "ranks": ranks, "resource": resource, "step": step,
            "detected_at": detected_at}


def _rank(reports=(), injected_at=None, state=("a",)):
    injections = [] if injected_at is None else [{"status": "injected", "iteration": 5, "wall_time": injected_at}]
    return {"reports": list(reports), "injections": injections, "state": list(state), "plan": PLAN}


def _sdc(**fields):
    return dict({"class": "sdc", "kind": "sign_flip", "surface": "output", "position": "middle",
                 "lifetime": "recurring", "trial": 0, "faulty": 1}, **fields)


def test_a_report_naming_exactly_the_faulty_rank_is_a_hit_and_every_other_report_is_false():
    same = _report("sdc", [1], 8)
    ranks = [_rank([same], injected_at=1.0), _rank([dict(same)]), _rank([_report("sdc", [2], 12)]),
             _rank([_report("sdc_inconclusive", [0, 1, 2, 3], 16)])]
    scored = dc.score(_sdc(), ranks)
    assert scored["outcome"] == "hit" and scored["latency"] == 3  # onset 5, named at the check of step 8
    assert [(r["kind"], r["ranks"]) for r in scored["false_reports"]] == [("sdc", [2]), ("sdc_inconclusive",
                                                                                         [0, 1, 2, 3])]


def test_misses_are_split_into_real_misses_by_design_misses_and_masked_corruption():
    injected = [_rank(injected_at=1.0)] + [_rank() for _ in range(3)]
    assert dc.score(_sdc(), injected)["outcome"] == "miss"
    between = dc.score(_sdc(lifetime="between_checks"), injected)
    assert (between["outcome"], between["reason"]) == ("by_design", dc.ONE_SHOT_OUTPUT)
    # At the check of step 8 only the source (rank 2) has its live output voted; the head is not sampled.
    assert dc.score(_sdc(lifetime="at_check", faulty=1), injected)["reason"] == dc.NOT_LIVE_COMPARED
    assert dc.score(_sdc(lifetime="at_check", faulty=2, position="head"), injected)["reason"] == dc.NOT_LIVE_COMPARED
    assert dc.score(_sdc(lifetime="at_check", faulty=2), injected)["outcome"] == "miss"
    # A parameter corruption is masked only when no replica's state differs at the end.
    assert dc.score(_sdc(surface="parameter"), injected)["outcome"] == "masked"
    diverged = [_rank(injected_at=1.0, state=("b",))] + [_rank() for _ in range(3)]
    assert dc.score(_sdc(surface="parameter"), diverged)["outcome"] == "miss"
    assert dc.score(_sdc(), [_rank() for _ in range(4)])["outcome"] == "not_injected"


def test_hang_and_straggler_latencies_and_the_summary_row():
    hang = {"class": "hang", "framework": "ddp", "trial": 0, "faulty": 3}
    scored = dc.score(hang, [_rank([_report("hang", [3], 6, detected_at=12.5, resource="comm")]), _rank(), _rank(),
                             _rank(injected_at=10.0)])
    assert (scored["outcome"], scored["latency"]) == ("hit", 2.5)
    slow = {"class": "straggler", "variant": "start_2x", "trial": 0, "faulty": 0}
    scored = dc.score(slow, [_rank([_report("compute_straggler", [0], 8, resource="compute")], injected_at=1.0)])
    assert scored["latency"] == 2  # the checks of steps 4 and 8 after an onset at step 3
    row = dc.summarize([dict(scored, cell=slow)])[0]
    assert {k: row[k] for k in ("class", "hit", "miss", "precision", "recall", "FPR")} == {
        "class": "straggler start_2x", "hit": 1, "miss": 0, "precision": "1.00", "recall": "1.00", "FPR": "0.00"}


def test_the_campaign_grid_and_its_kit_manifests_are_valid():
    from lm_resiliency.faults import FaultCampaign

    grid = dc.cells(dc.CLASSES, trials=1, world=4, clean_runs=30)
    counts = {c: sum(cell["class"] == c for cell in grid) for c in dc.CLASSES}
    assert counts == {"sdc": 4 * 4 * 4 * 3, "non_finite": 4 * 4 * 3, "clean": 30, "hang": 2, "straggler": 3}
    assert {cell["faulty"] for cell in grid if cell.get("lifetime") == "at_check"} == {2}
    for cell in grid:
        if cell["class"] != "clean":
            FaultCampaign.from_json(dc.campaign_json(cell))


@pytest.mark.timeout(300)
def test_the_harness_scores_an_injected_fault_and_a_clean_run():
    cells = [_sdc(surface="parameter", position="final_norm", kind="low_mantissa_bit"),
             {"class": "clean", "trial": 0, "faulty": 1}]
    per_rank = run_ranks(run_cells, 4, {}, cells, timeout=240)
    fault, clean = (dc.score(cell, [per_rank[r][i] for r in range(4)]) for i, cell in enumerate(cells))
    # The final norm is sampled at step 8 (the output rotation: head, norm): its parameters differ on rank 1.
    assert (fault["outcome"], fault["false_reports"], fault["latency"]) == ("hit", [], 3), fault
    assert (clean["outcome"], clean["false_reports"]) == ("clean", []), clean
