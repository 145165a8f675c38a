"""SCOUT on 4 real DDP ranks over gloo: every parameter is in a rotated check, the live output
joins the vote, 0-d parameters are checked, and SCOUT's own failures never stop captures."""

import pytest
import torch

from tests.distributed import scout_coverage_workloads as w
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)


def _not_clean(outcomes):
    return [o for o in outcomes if o[2] != "clean"]


def test_final_norm_outside_the_old_catalog_is_replayed_and_localized():
    outs = run_ranks(w.detector_run, 4, 3, 2, "norm", timeout=120)
    for coverage, results in outs:
        assert coverage == {"parameters": 1.0, "bytes": 1.0, "checks": 3, "steps": 3, "uncovered": []}
        assert _not_clean(results[1]) == []  # step 1 replays the head
        # Step 2: the output check's rotation reaches the final LayerNorm.
        assert _not_clean(results[2]) == [("output", "norm", "sdc", (2,))]


def test_optimizer_state_corruption_of_an_unsampled_parameter_is_localized():
    # norm.bias is the 9th optimizer parameter: the optimizer check's rotation reaches it at check 9.
    outs = run_ranks(w.detector_run, 4, 2, 1, None, None, 1, timeout=120)
    for _, results in outs:
        assert _not_clean(results[1]) == []
        assert _not_clean(results[2]) == [("optimizer_state", "norm", "sdc", (1,))]


def test_one_shot_fault_in_the_live_forward_of_the_sampled_module_is_caught():
    # Step 3: the output check samples the head with rank 3 as its source; only the live forward
    # of that call is corrupted, so every replay (rank 3's included) is clean.
    outs = run_ranks(w.detector_run, 4, 4, 3, None, 3, timeout=120)
    for _, results in outs:
        assert [_not_clean(results[s]) for s in (1, 2, 4)] == [[], [], []]
        assert ("output", "head", "clean", ()) in results[3]
        assert _not_clean(results[3]) == [("live", "head", "sdc", (3,))]


def test_ranks_faulty_alike_outnumbering_the_healthy_one_do_not_get_it_blamed():
    # Ranks 0, 1 and 2 flip a sign in the final norm from step 3 on; step 2 checked it clean.
    # Step 4 votes 3 against 1: the step-2 reference replay shows the majority is the faulty side.
    outs = run_ranks(w.detector_run, 4, 4, (0, 1, 2), "norm", None, None, 3, timeout=120)
    for _, results in outs:
        assert [_not_clean(results[s]) for s in (1, 2, 3)] == [[], [], []]
        assert _not_clean(results[4]) == [("output", "norm", "inconclusive", ())]


def test_a_late_fault_on_one_rank_is_confirmed_by_the_reference_replay():
    outs = run_ranks(w.detector_run, 4, 4, 1, "norm", None, None, 3, timeout=120)
    for _, results in outs:
        assert _not_clean(results[4]) == [("output", "norm", "sdc", (1,))]


def test_zero_dim_parameters_are_checked_captured_and_resumed(tmp_path):
    folder = str(tmp_path)
    baseline = run_ranks(w.scalar_session, 4, str(tmp_path / "baseline"), 6, "regression", timeout=200)
    killed = run_ranks(w.scalar_session, 4, folder, 6, "regression", 5, timeout=200, check=False)
    assert [o.killed_by for o in killed] == [9] * 4, [o.error for o in killed]
    resumed = run_ranks(w.scalar_session, 4, folder, 6, "regression", timeout=200)
    for rank in range(4):
        assert baseline[rank]["errors"] == 0 and baseline[rank]["verdicts"] == [["clean"]] * 3
        assert baseline[rank]["own_steps"][-1] == 6 and baseline[rank]["verified"][0] == 6
        assert resumed[rank]["resumed"] == 4
        assert all(torch.equal(a, b) for a, b in zip(resumed[rank]["params"], baseline[rank]["params"]))


def test_internal_check_failure_is_counted_and_the_capture_happens_uncertified(tmp_path):
    outs = run_ranks(w.scalar_session, 4, str(tmp_path), 4, "failing", timeout=200)
    for out in outs:
        assert out["errors"] >= 2  # the embedding/output replay of `gate` fails on every peer, each check
        assert all("sdc" not in v for v in out["verdicts"]) and all("error" in v for v in out["verdicts"])
        assert out["own_steps"] == [2, 4]  # captured...
        assert out["verified"] == []       # ...but never certified


def test_accelerate_regression_model_is_checked_and_certified(tmp_path):
    # Accelerate hooks the model root, which is also the module SCOUT samples: the capture must
    # still see that call ("(root) was not called" before), and the 0-d optimizer check must run.
    outs = run_ranks(w.accelerate_regression, 3, str(tmp_path), timeout=200)
    for out in outs:
        assert out["errors"] == 0 and out["verdicts"] == [["clean"]] * 3, out
        assert out["verified"] == [6, 4, 2]
        assert "was not called" not in out["log"] and "vetoed" not in out["log"], out["log"]
