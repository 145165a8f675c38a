"""SCOUT replay localization on real gloo ranks: injected SDC is pinned on exactly the faulty rank."""

import pytest

from lm_resiliency.scout.reports import SCOPE_PEER_GROUP, SCOPE_RANK, SDC, SDC_PEER_GROUP
from tests.distributed import scout_workloads as w
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(60)


def _by_check(result, check):
    return [c for c in result.checks if c.check == check]


@pytest.mark.parametrize("fault,fault_rank", [("sign_flip", 3), ("bit_flip", 1), ("tiny_perturbation", 0)])
def test_hidden_fault_localized_to_one_rank_within_one_interval(fault, fault_rank):
    interval = 4
    outs = run_ranks(w.localize_hidden_fault, 4, fault, fault_rank, interval, timeout=40)
    for rank, (result, reports) in enumerate(outs):
        assert result.step == interval
        hidden = _by_check(result, "hidden")
        assert len(hidden) == 1
        assert (hidden[0].verdict, hidden[0].faulty) == ("sdc", (fault_rank,)), (rank, hidden[0])
        assert hidden[0].group_ranks == (0, 1, 2, 3)
        assert set(hidden[0].timings_s) == {0, 1, 2, 3} and all(t >= 0 for t in hidden[0].timings_s.values())
        assert set(hidden[0].hosts) == {0, 1, 2, 3}
        others = [c for c in result.checks if c.check != "hidden"]
        assert others and all(c.verdict == "clean" for c in others), others
        assert len(reports) == 1
        report = reports[0]
        assert (report.kind, report.scope, report.ranks) == (SDC, SCOPE_RANK, (fault_rank,))
        assert report.resource == f"hidden:{hidden[0].module_path}" and report.step == interval
        assert report.to_json()["ranks"] == [fault_rank]
    # Every peer reached the same decision.
    assert len({tuple((c.check, c.verdict, c.faulty) for c in r.checks) for r, _ in outs}) == 1


def test_rotation_reaches_the_faulty_layer_within_one_rotation():
    outs = run_ranks(w.rotation_finds_layer, 4, 2, timeout=40)
    for per_step in outs:
        paths = [_by_check(per_step[s][0], "hidden")[0].module_path for s in (1, 2, 3)]
        assert paths == ["layers.0", "layers.1", "layers.2"]
        assert per_step[1][1] == [] and per_step[2][1] == []
        reports = per_step[3][1]
        assert [(r.kind, r.ranks, r.resource) for r in reports] == [(SDC, (2,), "hidden:layers.2")]


def test_parameter_corruption_caught_by_parameters_check():
    # Corrupt head.weight on rank 2 after step 2's optimizer step; check at step 3.
    outs = run_ranks(w.parameter_corruption, 4, 2, "head.weight", 2, 3, False, timeout=40)
    for per_step in outs:
        assert per_step[1][1] == [] and per_step[2][1] == []
        result, reports = per_step[3]
        params = [c for c in _by_check(result, "parameters") if c.module_path == "head"]
        assert len(params) == 1 and (params[0].verdict, params[0].faulty) == ("sdc", (2,))
        assert reports and all(r.kind == SDC and r.ranks == (2,) for r in reports)
        assert any(r.resource == "parameters:head" for r in reports)


def test_parameter_corruption_caught_by_optimizer_check():
    # Only the optimizer check runs; corrupt the parameter it samples at step 3, after step 2.
    outs = run_ranks(w.parameter_corruption, 4, 1, "@optimizer:3", 2, 3, True, timeout=40)
    for per_step in outs:
        assert per_step[1][1] == [] and per_step[2][1] == []
        result, reports = per_step[3]
        optimizer = _by_check(result, "optimizer")
        assert len(optimizer) == 1 and (optimizer[0].verdict, optimizer[0].faulty) == ("sdc", (1,))
        assert set(optimizer[0].timings_s) == {0, 1, 2, 3}
        params = _by_check(result, "parameters")
        assert len(params) == 1 and (params[0].verdict, params[0].faulty) == ("sdc", (1,))
        assert {r.resource.split(":")[0] for r in reports} == {"optimizer", "parameters"}
        assert all(r.kind == SDC and r.ranks == (1,) for r in reports)


def test_thirty_clean_checks_produce_no_reports():
    outs = run_ranks(w.clean_run, 4, 30, False, timeout=40)
    for per_step in outs:
        assert sorted(per_step) == list(range(1, 31))
        for step, (result, reports) in per_step.items():
            assert reports == [] and result.healthy, (step, result)
            # Optimizer state exists once the first step has run; from then on it is signed too.
            assert {c.check for c in result.checks} == {"embedding", "hidden", "output", "optimizer", "parameters",
                                                        "backward"} | ({"optimizer_state"} if step > 1 else set())


def test_ddp_wrapped_model_clean_and_localized():
    outs = run_ranks(w.ddp_fault, 4, 2, timeout=40)
    for per_step in outs:
        assert sorted(per_step) == [2, 4]
        assert per_step[2][1] == [] and per_step[2][0].healthy
        assert [(r.kind, r.ranks, r.resource) for r in per_step[4][1]] == [(SDC, (2,), "hidden:layers.1")]


@pytest.mark.parametrize("ddp", [False, True])
def test_backward_only_fault_localized_by_backward_replay(ddp):
    outs = run_ranks(w.backward_fault, 4, 1, ddp, timeout=40)
    for per_step in outs:
        result, reports = per_step[2]
        assert reports == [] and result.healthy
        # Every dense activation check also replays its backward on the source's output gradient.
        assert [c.module_path for c in _by_check(result, "backward")] == ["emb", "layers.0", "head"]
        result, reports = per_step[4]
        backward = [c for c in _by_check(result, "backward") if c.verdict != "clean"]
        hidden = _by_check(result, "hidden")[0]
        assert [(c.module_path, c.verdict, c.faulty) for c in backward] == [(hidden.module_path, "sdc", (1,))]
        assert hidden.verdict == "clean"  # the forward is healthy; only the backward is corrupted
        assert [(r.kind, r.scope, r.ranks, r.resource) for r in reports] == \
            [(SDC, SCOPE_RANK, (1,), f"backward:{hidden.module_path}")]


def test_two_peers_disagreeing_blame_the_pair_not_a_rank():
    outs = run_ranks(w.two_peer_output_fault, 2, timeout=40)
    for result, reports in outs:
        output = _by_check(result, "output")
        assert len(output) == 1 and (output[0].verdict, output[0].faulty) == ("peer_group", ())
        assert result.sdc and not result.healthy
        assert len(reports) == 1
        assert (reports[0].kind, reports[0].scope, reports[0].ranks) == (SDC_PEER_GROUP, SCOPE_PEER_GROUP, (0, 1))


def test_concurrent_subgroups_decide_independently():
    outs = run_ranks(w.subgroups, 4, 3, timeout=40)
    for rank, (mine, result) in enumerate(outs):
        output = _by_check(result, "output")[0]
        assert output.group_ranks == tuple(mine)
        if 3 in mine:
            assert output.verdict == "peer_group"
        else:
            assert result.healthy


def test_peers_with_different_plans_all_raise():
    messages = run_ranks(w.plan_mismatch, 4, timeout=40)
    assert all(m is not None and "disagree on the replay plan" in m for m in messages), messages
